"""Red team of the replacement template (a fresh interpreter, ``executor.workers.template``), the worker's
``procfs.dying`` check, the template-made std files, and the 256-character name bound on the wire.

Tools: ``tests/tools/template_attacks.py``. A test marked ``xfail(strict=True, reason="HOLE: ...")``
is an attack that succeeds on the current code; it turns into a failure (XPASS) once the hole is
closed, when the mark must go."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller import ExecutorClient, ExecutorUnavailable, LocalExecutor
from protocol import Call, Result
from tests.conftest import TESTS, template_of
from tests.support.hostile import HostileServer
from tests.support.hostile import tool_entry as _tool
from tests.support.waiting import wait_until

TOOLS = str(TESTS / "tools" / "template_attacks.py")
TIMEOUT = 10.0
REPLACED_WITHIN = 15.0  # a fresh interpreter imports the tools: slower than a fork on a loaded 2-core box


@pytest.fixture
def start() -> Iterator[Callable[..., ExecutorClient]]:
    made: list[LocalExecutor] = []

    def make(**options: Any) -> ExecutorClient:
        local = LocalExecutor(tools=[TOOLS], timeout=TIMEOUT, **options)
        made.append(local)
        client = local.start()
        client.local = local  # type: ignore[attr-defined]
        return client

    yield make
    for local in made:
        local.stop()


def _call(client: ExecutorClient, tool: str, **kwargs: Any) -> Result:
    return client.call(Call(tool=tool, kwargs=kwargs))


def _replace_template(client: ExecutorClient) -> int:
    """SIGKILL the template from outside (a tool cannot: it is the init of the workers' PID
    namespace); wait until a worker of its replacement answers. Returns the new template's pid."""
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    old = _call(client, "template_pid").value
    os.kill(template_of(local.proc.pid), signal.SIGKILL)

    def replaced() -> int:
        r = _call(client, "template_pid")
        return template_of(local.proc.pid) if r.ok and r.value != old else 0  # type: ignore[union-attr]

    return int(wait_until("a worker of the replacement template to answer", replaced, timeout=REPLACED_WITHIN))


# ------------------------------------------------------------------ 1. the replacement template


# What may differ: the channel's descriptor number, and -P (safe_path) in the fresh interpreter.
EXPECTED_TO_DIFFER = ("fds", "flags")


def test_workers_of_a_replacement_template_run_exactly_as_the_first_ones(start: Callable[..., ExecutorClient]) -> None:
    """Environment, rlimits, capabilities, ignored/blocked signals (worker and template), dumpable,
    cgroups, cwd, sys.path, std files, nice, affinity, OOM score: the same before and after a tool
    killed the template. Descriptors: the same kinds (stdin /dev/null, two pipes, one socket)."""
    client = start()
    first = _call(client, "probe")
    assert first.ok, first.error
    _replace_template(client)
    fresh = _call(client, "probe")
    assert fresh.ok, fresh.error
    differ = {k: (first.value[k], fresh.value[k]) for k in first.value
              if k not in EXPECTED_TO_DIFFER and first.value[k] != fresh.value[k]}
    assert not differ, f"a worker of the replacement template differs from the first's: {differ}"
    kinds = [fd.split("->", 1)[1] for fd in fresh.value["fds"]]
    assert kinds == [fd.split("->", 1)[1] for fd in first.value["fds"]] == ["/dev/null", "pipe:", "pipe:", "socket:"]
    assert fresh.value["dumpable"] == 0


SHADOW = """import importlib, os, sys
with open({marker!r}, "w") as f:
    f.write(str(os.getpid()))
del sys.modules["difflib"]
sys.path[:] = [p for p in sys.path if p != {workspace!r}]
globals().update(importlib.import_module("difflib").__dict__)
"""


# Closed: the supervisor takes its working directory (the workspace) off sys.path before the first
# template is forked, so neither template ever searches it (executor.supervisor._never_import_from).
def test_a_module_planted_in_the_start_directory_never_runs_in_a_replacement_template(
    start: Callable[..., ExecutorClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    marker = tmp_path / "shadow-ran"
    monkeypatch.chdir(workspace)  # as `ciayn run` in a project directory: the workspace is "."
    client = start()
    assert _call(client, "probe").value["cwd"] == str(workspace)
    planted = _call(client, "plant", name="difflib.py",
                    text=SHADOW.format(marker=str(marker), workspace=str(workspace)))
    assert planted.ok, planted.error
    template = _replace_template(client)
    assert _call(client, "diff", a="a\n", b="b\n").ok
    ran_in = marker.read_text() if marker.exists() else ""
    assert not ran_in, f"difflib.py from the workspace ran in process {ran_in} (the new template is {template})"


# ------------------------------------------------------------------ 2. procfs.dying in the worker


def test_a_reused_worker_that_cannot_read_proc_only_costs_itself(start: Callable[..., ExecutorClient]) -> None:
    """A reused worker's tool leaves RLIMIT_NOFILE at 3: the worker cannot open the template's stat
    file before its next call, so ``procfs.dying`` says the template is dying and the worker quits.
    The call goes back to the queue and another worker runs it: no loop, no lost call."""
    client = start(reuse_workers=True, workers=1)
    poisoned = _call(client, "poison_open_files")
    assert poisoned.ok, poisoned.error
    for n in range(3):
        after = _call(client, "echo", value=n)
        assert after.ok and after.value == n, after
    assert _call(client, "whoami").value["pid"] != poisoned.value


def test_calls_after_repeated_template_kills_are_answered(start: Callable[..., ExecutorClient]) -> None:
    """Kill the template, then at once an innocent call, three times: the innocent call (which may
    meet a worker of the dying template and be sent back to the queue) is answered, never lost."""
    client = start(workers=2)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    for n in range(3):
        template = wait_until("a template", lambda: template_of(local.proc.pid), timeout=REPLACED_WITHIN)  # type: ignore[union-attr]
        os.kill(template, signal.SIGKILL)
        after = _call(client, "echo", value=n)
        assert after.ok and after.value == n, after.error


# ------------------------------------------------------------------ 3. the template-made std files


def test_output_left_in_the_std_files_never_reaches_another_call(start: Callable[..., ExecutorClient]) -> None:
    """Unterminated lines (not flushed by line buffering), a worker that dies with them buffered, and
    undecodable text: each call's output is its own, before and after a template replacement."""
    client = start()
    for round_ in ("first", "fresh"):
        mark = f"LEAK-{round_}-{uuid.uuid4().hex[:6]}"
        kept = _call(client, "unflushed", text=mark + "\u00e9")
        assert kept.ok and kept.stdout == mark + "\u00e9\\udcff", kept
        died = _call(client, "buffered_then_die", text=mark)
        assert died.error is not None and died.error.kind == "crashed", died
        after = _call(client, "echo", value=1)
        assert after.ok and after.stdout == "" and after.stderr == "", after
        if round_ == "first":
            _replace_template(client)


# ------------------------------------------------------------------ 4. what a hostile server can announce


@pytest.fixture
def hostile_dir() -> Iterator[Path]:
    directory = Path(f"/tmp/ciayn-hostile-{uuid.uuid4().hex[:8]}")
    directory.mkdir(mode=0o700)
    yield directory
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()


# Closed: ToolSpec.signature is at most 4096 characters, doc 32768, the parameters' schema 64 KiB, 32 deep,
# with keys of at most 256 (protocol.spec); a welcome breaking one is refused.
@pytest.mark.parametrize("field", ["signature", "parameters", "doc"])
def test_a_welcome_with_a_huge_signature_or_schema_name_is_not_believed(hostile_dir: Path, field: str) -> None:
    huge = "x" * 100_000
    spec = (_tool(signature=f"({huge})") if field == "signature" else _tool(doc=huge * 10) if field == "doc" else
            _tool(parameters={"type": "object", "properties": {huge: {"type": "string"}}}))
    endpoint = f"ipc://{hostile_dir}/evil.sock"
    server = HostileServer(endpoint, [spec], {}, lambda call: [])
    client = ExecutorClient(endpoint, connect_timeout=3)
    try:
        with pytest.raises(ExecutorUnavailable, match="a welcome this client cannot use"):
            client.tools()
    finally:
        client.close()
        server.close()

