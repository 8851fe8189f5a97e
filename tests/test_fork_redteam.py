"""Red team of the template's bare ``fork()`` (``executor.workers.quickfork``), of the first template forked
early (``executor.workers.spawn``, waiting for its ``Configure``) and of the rights the template drops before
it imports tool modules (``executor.workers.template.template_main``).

Tools: ``tests/tools/fork_attacks.py``. The five holes it found are closed, and their tests now
pass (each failed on the code before its fix); the others are attacks the defence held against
from the start."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from controller import ExecutorClient
from executor.workers.privacy import CAP_SYS_PTRACE, CAP_SYS_RESOURCE, HOST_ADMIN_CAPS
from protocol import Call, Result
from tests.conftest import TESTS, pid_namespaces, template_of
from tests.support.net import free_port
from tests.support.waiting import wait_until

ROOT = TESTS.parent
ATTACKS = str(TESTS / "tools" / "fork_attacks.py")
MARKER_TOOLS = str(TESTS / "tools" / "import_marker.py")
DROPPED = (CAP_SYS_PTRACE, CAP_SYS_RESOURCE, *HOST_ADMIN_CAPS.values())
CAP_SYS_ADMIN = HOST_ADMIN_CAPS["CAP_SYS_ADMIN"]
CAP_SYS_PACCT = 20


def _call(client: ExecutorClient, tool: str, **kwargs: Any) -> Result:
    r = client.call(Call(tool=tool, kwargs=kwargs))
    assert r.ok, r.error
    return r


def _after_warm_up(client: ExecutorClient) -> dict[str, Any]:
    """``late_hook``'s answer from the first worker forked after the thread fork_attacks left in the
    template registered its after-fork hook (some time after the tools' import) and ended."""
    def seen() -> dict[str, Any] | None:
        value = _call(client, "late_hook").value
        assert isinstance(value, dict)
        return value if value["registered"] else None

    value: dict[str, Any] = wait_until("a worker forked after the warm-up thread's hook", seen, timeout=15)
    return value


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: other users hold none of these capabilities anyway")


# ------------------------------------------------------------------ 1. the hook check's window


def test_an_after_fork_hook_registered_after_the_import_still_runs_in_every_worker(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[ATTACKS], workers=1)
    seen = _after_warm_up(client)
    assert seen["ran"], f"a hook registered in the template before the fork did not run in the worker: {seen}"


# ------------------------------------------------------------------ 2. threading state of a bare-forked worker


def test_a_bare_forked_workers_threading_module_describes_that_worker(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[ATTACKS], workers=1)
    _after_warm_up(client)  # the template is one thread again; its threading module still lists a dummy
    seen = _call(client, "threading_state").value
    assert isinstance(seen, dict)
    assert seen["tasks"] == 1
    assert seen["main_is_current"]
    assert seen["names"] == ["MainThread"] and not seen["dummies"], seen


# ------------------------------------------------------------------ 3. rights: what the drop holds


def test_a_program_a_root_call_execs_gets_none_of_the_dropped_rights_back(
        make_client: Callable[..., ExecutorClient]) -> None:
    """Root regains its bounding set at exec: the drop took the rights out of it, so it stays."""
    _root_only()
    client = make_client(tools=[ATTACKS], workers=1)
    caps = _call(client, "exec_caps").value
    for cap in DROPPED:
        for which in ("CapBnd", "CapPrm", "CapEff", "CapAmb"):
            assert not caps[which] & (1 << cap), f"capability {cap} in {which} of an exec'd program: {caps}"


def test_a_user_namespace_gives_rights_over_nothing_of_the_executor(
        make_client: Callable[..., ExecutorClient]) -> None:
    """unshare(CLONE_NEWUSER) needs no capability and hands back a full set, bounding set included,
    but over the new namespace only: the template stays out of reach (no ptrace, no memory)."""
    _root_only()
    if not pid_namespaces():
        pytest.skip("workers share the executor's PID namespace here: PID 1 is not the template")
    client = make_client(tools=[ATTACKS], workers=1)
    seen = _call(client, "user_namespace_reach").value
    if seen["unshare"]:
        pytest.skip(f"no user namespaces here ({seen['unshare']})")
    assert seen["caps"]["CapEff"] & (1 << CAP_SYS_PTRACE)  # the full set, in the new namespace
    assert seen["ptrace"] == "Operation not permitted", seen
    assert seen["mem"] in ("Permission denied", "Operation not permitted"), seen


def test_a_root_call_cannot_watch_the_processes_of_later_calls(make_client: Callable[..., ExecutorClient],
                                                               workspace: Path) -> None:
    _root_only()
    if not pid_namespaces():
        pytest.skip("no PID namespace of the executor's own: accounting would cover the host")
    client = make_client(tools=[ATTACKS], workers=2, workspace=str(workspace))
    log = str(workspace / "acct")
    error = _call(client, "acct_on", path=log).value
    try:
        if error and error != "Operation not permitted":
            pytest.skip(f"no process accounting in this kernel ({error})")
        assert _call(client, "name_a_process", name="victim-9f2c").value == 7  # another client's call
        seen = _call(client, "read_acct", path=log).value
        assert "victim-9f2c" not in seen, f"a call read what the processes of a later call were: {seen}"
        assert error == "Operation not permitted"
    finally:
        client.call(Call(tool="acct_off"))


# ------------------------------------------------------------------ 4. rights: the replacement template


PAYLOAD = """
import os as _os
with open({mark!r}, "a") as _f:
    with open("/proc/self/status") as _s:
        _f.write(str(_os.getpid()) + " " + [ln for ln in _s if ln.startswith("CapEff:")][0])
"""


def test_code_a_root_call_plants_never_runs_with_the_dropped_rights(tmp_path: Path) -> None:
    _root_only()
    src = tmp_path / "src"  # a private copy of the executor: the call writes it, not the checkout
    for package in ("executor", "protocol"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    mark = tmp_path / "planted-ran"
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-test-"))
    endpoint = f"ipc://{sock_dir}/exec.sock"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    proc = subprocess.Popen([sys.executable, "-m", "executor.cli", "serve", "--tools", ATTACKS, "--bind", endpoint,
                             "--workers", "1", "--workspace", str(workspace)], cwd=src, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ExecutorClient(endpoint) as client:
            where = _call(client, "executor_source").value
            assert where == str(src / "executor"), where
            planted = os.path.join(where, "workers", "framing.py")  # a module every new template imports
            _call(client, "plant", path=planted, text=PAYLOAD.format(mark=str(mark)))
            old = _call(client, "whoami").value
            template = wait_until("the template", lambda: template_of(proc.pid), timeout=10)
            os.kill(template, signal.SIGKILL)  # as the OOM killer would

            def replaced() -> bool:
                r = client.call(Call(tool="whoami"))
                return bool(r.ok and r.value != old and template_of(proc.pid) not in (0, template))

            wait_until("a worker of the replacement template to answer", replaced, timeout=20)
        assert mark.exists(), "the replacement template did not import the planted module (the attack misfired)"
        cap_eff = int(mark.read_text().split()[-1], 16)
        held = [cap for cap in DROPPED if cap_eff & (1 << cap)]
        assert not held, f"code a tool call planted ran with capabilities {held} (CAP_SYS_ADMIN: {CAP_SYS_ADMIN})"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------ 5. the early template and a refused start


# Each way a start is refused after the template was forked: the metrics port in use, a tcp address in
# use, a key file that is not one (server side and link side), a broker address that is not one.
REFUSALS = {
    "metrics-port-busy": (lambda busy, sock: ["--bind", f"ipc://{sock}", "--metrics-port", f"127.0.0.1:{busy}"],
                          "cannot serve metrics"),
    "tcp-bind-busy": (lambda busy, sock: ["--bind", f"tcp://127.0.0.1:{busy}", "--insecure"], "cannot bind"),
    "bad-curve-secret": (lambda busy, sock: ["--bind", f"tcp://127.0.0.1:{free_port()}", "--curve-secret",
                                             str(TESTS / "tools" / "import_marker.py")], "CurveZMQ key file"),
    "bad-broker-key": (lambda busy, sock: ["--connect", f"tcp://127.0.0.1:{free_port()}", "--curve-server-key",
                                           str(TESTS / "tools" / "import_marker.py")], "CurveZMQ key file"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_a_start_refused_after_the_template_was_forked_imports_no_tool_module(tmp_path: Path, refusal: str) -> None:
    """The template is forked first (before ZeroMQ), but it reads no tool module before every part of
    the start that can be refused has passed: import-time code of tools must not run on the machine
    for an executor the operator was told could not start."""
    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-test-"))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    args, message = REFUSALS[refusal]
    try:
        out = subprocess.run([sys.executable, "-m", "executor.cli", "serve", "--tools", MARKER_TOOLS, "--workers", "1",
                              "--workspace", str(workspace), *args(busy.getsockname()[1], sock_dir / "exec.sock")],
                             cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "cannot start" in out.stderr and message in out.stderr, out.stderr
        assert not (workspace / "imported-by").exists(), "a refused executor imported a tool module"
        assert not (sock_dir / "exec.sock").exists(), "a refused executor left its socket file"
    finally:
        busy.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_the_same_executor_started_with_nothing_refused_imports_the_tools(tmp_path: Path) -> None:
    """The control for the refusals above: with the metrics port free, the same start imports the
    tool module (in the template, not in the supervisor) and serves."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-test-"))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    endpoint = f"ipc://{sock_dir}/exec.sock"
    proc = subprocess.Popen([sys.executable, "-m", "executor.cli", "serve", "--tools", MARKER_TOOLS, "--workers", "1",
                             "--workspace", str(workspace), "--bind", endpoint, "--metrics-port",
                             f"127.0.0.1:{free_port()}"], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with ExecutorClient(endpoint, timeout=30) as client:
            result = client.call(Call(tool="present"), timeout=30)
        assert result.ok and result.value is True, result
        marks = (workspace / "imported-by").read_text().split()
        assert marks and str(proc.pid) not in marks, "the supervisor itself imported the tool module"
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(sock_dir, ignore_errors=True)
