"""Red team of the lean template (e6c7aaf and the commits after it): the template is always a new
interpreter (``python -P -m executor.workers.template``) that maps no pydantic; the tool specs are
described in a child the template forks after the import; argument types are checked by the
supervisor against the spec's JSON Schema (``ToolSpec.check_arguments``, ``_SchemaCheck``), which
comes from code a hostile tool module controls; the worker side holds plain ``WorkerLimits``.

Every attack runs real executor processes on real sockets. Tool modules: ``tests/tools/lean_*.py``
(and ``tests/tools/attacks.py`` for the secrets). Seven holes were found, and each test below failed
on the code before its fix: a schema keyword of the wrong JSON type crashed the supervisor;
``enum``/``required`` work per node was not counted by the step budget; constraints pydantic
enforced (a pattern, a validator, literal keys, a size) were checked nowhere (now a tool whose
annotations say more than their schema has its arguments checked by its workers with pydantic, as
before); an empty or relative PYTHONPATH entry put the workspace on every new template's path; and,
in older code reached by the same attacks, a template's malformed ``ToolsLoaded`` or a forged
``Spawned`` crashed the supervisor. Held from the start: the budget on a plain schema, the check's
depth bound against the deepest value, a describe child that never returns, and the environment a
template is exec'd with."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from controller import ExecutorClient, LocalExecutor
from controller.local import ExecutorStartError
from protocol import Call, Ping, Pong
from tests.conftest import TESTS, template_of
from tests.support.attacks import start_raw
from tests.support.net import free_port
from tests.support.serve import EXIT_BOUND, Executor, executors
from tests.support.serve import start as _start
from tests.support.waiting import wait_until
from tests.support.wire import Wire

__all__ = ["executors", "start_raw"]  # fixtures, used by name

ROOT = TESTS.parent
TOOLS = TESTS / "tools"
CRASH = str(TOOLS / "lean_schema_crash.py")
COST = str(TOOLS / "lean_schema_cost.py")
CONSTRAINTS = str(TOOLS / "lean_constraints.py")
FORGE = str(TOOLS / "lean_forge_specs.py")
HANG = str(TOOLS / "lean_describe_hang.py")
PLANT_TOOLS = str(TOOLS / "lean_plant.py")
CHANNEL_THREAD = str(TOOLS / "lean_channel_thread.py")


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _started_or_refused(make_client: Callable[..., ExecutorClient], tools: list[str]) -> ExecutorClient | str:
    """A client of an executor serving ``tools``, or the reason it refused to start (a fix may refuse
    a tool whose schema the supervisor cannot check: that holds too)."""
    try:
        return make_client(tools=tools)
    except ExecutorStartError as e:
        assert "cannot start" in str(e), e
        return str(e)


def _refused_cleanly(ex: Executor, message: str) -> None:
    code = ex.wait_exit(15)
    log = ex.log()
    assert code == 1, log
    assert "cannot start" in log and message in log, log
    ex.assert_nothing_left()
    assert not ex.sock.exists(), "a refused executor left its socket file"


# ------------------------------------------------------------------ 1. the supervisor checks a schema a module wrote


@pytest.mark.parametrize("tool, kwargs", [("all_of_int", {"x": 1}), ("type_of_lists", {"x": 1}),
                                          ("required_lists", {"x": {"a": 1}})],
                         ids=["allOf-int", "type-list-of-list", "required-list-of-list"])
def test_a_schema_keyword_of_the_wrong_json_type_is_no_crash_of_the_supervisor(
        make_client: Callable[..., ExecutorClient], tool: str, kwargs: dict[str, Any]) -> None:
    """pydantic writes whatever ``json_schema_extra`` / ``WithJsonSchema`` says, and ``ToolSpec``
    bounds a schema's size and depth, not its keywords' types."""
    client = _started_or_refused(make_client, [CRASH])
    if isinstance(client, str):
        return  # refused at start, naming why: the defence holds
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    proc = local.proc
    assert proc is not None
    answer = client.submit(Call(tool=tool, kwargs=kwargs), timeout=5)
    wait_until("an answer, or the executor's exit", lambda: answer.done() or proc.poll() is not None, 15)
    assert proc.poll() is None, f"one call to {tool} ended the executor (exit {proc.returncode}):\n{local.log_tail(6)}"
    result = answer.result()
    assert result.ok or (result.error is not None and result.error.kind == "bad_arguments"), result
    assert client.call(Call(tool="echo", kwargs={"value": 7})).value == 7


@pytest.fixture(scope="module")
def costly() -> Iterator[tuple[ExecutorClient, psutil.Process]]:
    """One executor serving ``lean_schema_cost`` for the CPU measurements: its client and its
    supervisor process."""
    local = LocalExecutor(tools=[COST], workers=1)
    client = local.start()
    try:
        assert local.proc is not None
        yield client, psutil.Process(local.proc.pid)
    finally:
        local.stop()


def _supervisor_cpu(costly: tuple[ExecutorClient, psutil.Process], tool: str, kwargs: dict[str, Any]) -> float:
    client, supervisor = costly
    before = _cpu(supervisor)
    result = client.call(Call(tool=tool, kwargs=kwargs), timeout=120)
    assert result.ok, result.error
    return _cpu(supervisor) - before


COSTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # an honest tool (a list of codes out of 250) and a hostile client: 40,000 valid codes, 40% of the
    # step budget; at the budget (99k codes, 0.5 MB) one call costs the supervisor about 3 s here
    "honest-literal-of-250": ("pick", {"codes": ["c249"] * 40_000}, {"codes": ["c249"] * 40_000}),
    # a hostile module: an IntEnum of 10,000; 1,500 items (1.5% of the budget) cost about 1.5 s here,
    # a budget's worth (100k items, 0.3 MB) about 100 s
    "hostile-enum-of-10000": ("pick_big", {"values": [9999] * 1_500}, {"codes": ["x"] * 1_500}),
    # a hostile module: 'required' naming one key 12,000 times; 3,000 items cost about 1 s here,
    # a budget's worth (33k items) about 12 s
    "hostile-required-12000-times": ("keyed", {"items": [{"a": 1}] * 3_000}, {"codes": ["x"] * 3_000}),
}


@pytest.mark.parametrize("case", sorted(COSTS))
def test_a_calls_schema_check_costs_the_supervisor_about_what_the_same_call_costs_unconstrained(
        costly: tuple[ExecutorClient, psutil.Process], case: str) -> None:
    tool, kwargs, control = COSTS[case]
    plain = _supervisor_cpu(costly, "tag", control)
    checked = _supervisor_cpu(costly, tool, kwargs)
    assert checked <= 3 * plain + 0.25, (f"{tool}: the supervisor spent {checked:.2f} s of CPU on one call, "
                                         f"against {plain:.2f} s for the same number of items to tag(list[str])")


def test_a_call_of_150000_items_against_a_plain_list_schema_costs_the_supervisor_under_a_second(
        costly: tuple[ExecutorClient, psutil.Process]) -> None:
    """The control of the holes above: 150,000 strings against ``list[str]`` run the check out of its
    100,000 steps, which costs about 0.25 s here (decoding the call about half of it): the budget of
    nodes bounds a schema whose nodes each cost a constant."""
    assert _supervisor_cpu(costly, "tag", {"codes": ["c249"] * 150_000}) < 1.0


def test_the_supervisor_answers_a_ping_sent_behind_a_call_to_a_hostile_enum_schema(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[COST])
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    wire = Wire(local.endpoint)
    try:
        sock = wire.socket()
        wire.send(sock, Call(id="lean-ping-behind", tool="pick_big", kwargs={"values": [9999] * 3_000}))
        wire.send(sock, Ping(nonce=4242))  # same socket: it reaches the supervisor after the call
        sent = time.monotonic()
        deadline = sent + 1.0
        pong = None
        while pong is None and time.monotonic() < deadline:
            msg = wire.receive(sock, within=max(0.0, deadline - time.monotonic()))
            pong = msg if isinstance(msg, Pong) else None
        assert pong is not None and pong.nonce == 4242, (
            f"no pong within 1 s of a ping queued behind one call ({time.monotonic() - sent:.1f} s)")
    finally:
        wire.close()


@pytest.fixture(scope="module")
def constrained() -> Iterator[ExecutorClient | str]:
    """An executor serving ``lean_constraints``, or why it refused to start."""
    local = LocalExecutor(tools=[CONSTRAINTS], workers=1)
    try:
        client = local.start()
    except ExecutorStartError as e:
        yield str(e)
        return
    try:
        yield client
    finally:
        local.stop()


CONSTRAINED: dict[str, tuple[str, dict[str, Any]]] = {
    "pattern": ("note_name", {"name": "../../etc/passwd"}),
    "after-validator": ("inside", {"path": "../outside"}),
    "literal-keys": ("settings", {"values": {"color": 1, "__class__": 2}}),
    "dict-max-length": ("few", {"values": {str(i): i for i in range(1000)}}),
}


@pytest.mark.parametrize("case", sorted(CONSTRAINED))
def test_an_annotation_constraint_still_keeps_a_refused_argument_from_the_tool(
        constrained: ExecutorClient | str, case: str) -> None:
    if isinstance(constrained, str):
        assert "cannot start" in constrained
        return  # refused at start, naming the unchecked constraint: the defence holds
    tool, kwargs = CONSTRAINED[case]
    result = constrained.call(Call(tool=tool, kwargs=kwargs))
    assert result.error is not None and result.error.kind == "bad_arguments", (
        f"{tool} ran with {str(kwargs)[:60]}: {result.value!r:.60}")


# ------------------------------------------------------------------ 2. the template's report of the specs


def _forging(tmp_path: Path, executors: list[Executor], at: int, specs: Any, go_on: bool = False,
             **kw: Any) -> Executor:
    workspace = tmp_path / f"ws-ex{len(executors)}"  # the one ``start`` gives it
    workspace.mkdir()
    (workspace / "forge-at").write_text(str(at))
    (workspace / "forge-specs").write_text(json.dumps(specs))
    if go_on:
        (workspace / "forge-then-go-on").write_text("")
    return _start(executors, tmp_path, [FORGE], **kw)


def _served_again(client: ExecutorClient, proc: subprocess.Popen[Any], within: float) -> str:
    """"served" once a call is served after a forged report, "exited" if the executor exits first."""

    def outcome() -> str | None:
        if proc.poll() is not None:
            return "exited"
        return "served" if client.call(Call(tool="whoami"), timeout=3).ok else None

    return str(wait_until("a call served after the forged report, or the executor's exit", outcome, within))


def test_a_replacement_template_reporting_a_malformed_spec_is_backed_off_not_a_crash_of_the_supervisor(
        tmp_path: Path, executors: list[Executor]) -> None:
    ex = _forging(tmp_path, executors, at=2, specs=[{"name": 5}])
    with ExecutorClient(ex.endpoint, timeout=30) as client:
        assert client.call(Call(tool="whoami")).ok
        first = wait_until("the template", lambda: template_of(ex.proc.pid), 10)
        os.kill(first, signal.SIGKILL)  # as the OOM killer would: the replacement imports the module again
        wait_until("the replacement's forged report", lambda: (ex.workspace / "forged").exists(), 15)

        outcome = _served_again(client, ex.proc, 30)
    assert outcome == "served", (f"the executor exited ({ex.proc.returncode}) on a replacement template's "
                                 f"forged report:\n{ex.log()[-600:]}")


def test_a_first_template_reporting_a_spec_that_is_not_a_map_is_refused_cleanly(
        tmp_path: Path, executors: list[Executor]) -> None:
    ex = _forging(tmp_path, executors, at=1, specs=[5])
    _refused_cleanly(ex, "")


def test_a_schema_nested_to_the_checks_depth_bound_under_the_deepest_value_costs_no_recursion_error(
        tmp_path: Path, executors: list[Executor]) -> None:
    """The worst nesting of Python calls the check can make, found by search (``$ref`` to a definition
    of two nested ``anyOf`` around an array of itself, under a value nested as deep as a call may
    carry): about 640 frames at ``SCHEMA_CHECK_DEPTH``, under the interpreter's 1,000 with the
    supervisor's own below. The tool module forges the spec (no pydantic annotation writes these
    ``$defs``), then serves."""
    level: dict[str, Any] = {"anyOf": [{"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/L"}}]}]}
    spec = {"name": "whoami", "signature": "(value=None)", "params": [{"name": "value", "required": False}],
            "parameters": {"type": "object", "properties": {"value": {"$ref": "#/$defs/L"}}, "$defs": {"L": level}}}
    ex = _forging(tmp_path, executors, at=1, specs=[spec], go_on=True)
    value: Any = "bottom"
    for _ in range(63):
        value = [value]
    with ExecutorClient(ex.endpoint, timeout=30) as client:
        served = {t.name: t for t in client.tools()}
        assert "$defs" in served["whoami"].parameters, "the module did not forge the spec (the attack misfired)"
        result = client.call(Call(tool="whoami", kwargs={"value": value}))
        assert result.ok or (result.error is not None and result.error.kind == "bad_arguments"), result
        assert ex.proc.poll() is None, ex.log()[-600:]
        assert client.call(Call(tool="whoami")).ok
    assert "RecursionError" not in ex.log()


def test_a_thread_a_tool_module_left_in_the_template_forging_a_spawned_report_is_no_crash_of_the_supervisor(
        make_client: Callable[..., ExecutorClient], workspace: Path) -> None:
    client = make_client(tools=[CHANNEL_THREAD], workspace=str(workspace))
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None
    assert client.call(Call(tool="strike")).ok
    wait_until("the template's thread to write its report", lambda: (workspace / "struck").exists(), 10)

    assert local.proc is not None
    outcome = _served_again(client, local.proc, 20)
    assert outcome == "served", (f"a forged Spawned report ended the executor (exit {local.proc.returncode}):\n"
                                 f"{local.log_tail(4)}")


# ------------------------------------------------------------------ 3. the describe child


def test_a_describe_child_that_never_returns_is_bounded_by_the_start_bound_and_leaves_no_process(
        tmp_path: Path, executors: list[Executor]) -> None:
    """The annotation's schema hook runs only in the template's describe child (never at import),
    and hangs there: the template waits for that child, the supervisor for the template's report.
    The start bound (made 2 s) covers it, and the child dies with the template."""
    ex = _start(executors, tmp_path, [HANG], import_timeout=2.0)
    ex.wait_for("describing")
    started = time.monotonic()
    _refused_cleanly(ex, "still importing the tools after 2 s")
    assert time.monotonic() - started < 2.0 + EXIT_BOUND


# ------------------------------------------------------------------ 4. what a new template's interpreter reads


# A module a template imports before its Configure (``executor.workers.framing`` imports msgpack):
# planted in the workspace, it records the process that ran it, then hands over the real one.
PLANTED = '''
import os, sys
with open(os.path.join(os.getcwd(), "planted-ran"), "a") as _f:
    _f.write(f"{os.getpid()} {sys.argv!r}\\n")
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
import msgpack as _real
sys.modules[__name__] = _real
'''


@pytest.mark.parametrize("refused", [True, False], ids=["refused-start", "served-start"])
def test_code_a_tool_left_in_the_workspace_never_runs_in_a_new_template(tmp_path: Path, refused: bool) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "msgpack.py").write_text(PLANTED)  # as a tool of an earlier run on this workspace wrote it
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-lean-"))
    endpoint = f"ipc://{sock_dir}/exec.sock"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env["PYTHONPATH"] = os.pathsep + str(ROOT)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    metrics = busy.getsockname()[1] if refused else free_port()
    cmd = [sys.executable, "-m", "executor.cli", "serve", "--tools", PLANT_TOOLS, "--workers", "1",
           "--workspace", str(workspace), "--bind", endpoint, "--metrics-port", f"127.0.0.1:{metrics}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if refused:
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 1 and "cannot serve metrics" in err, err
        else:
            with ExecutorClient(endpoint, timeout=30) as client:
                assert client.call(Call(tool="whoami")).ok
        ran = workspace / "planted-ran"
        assert not ran.exists(), f"the workspace's msgpack.py ran in the template: {ran.read_text().strip()}"
    finally:
        busy.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(EXIT_BOUND)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(EXIT_BOUND)
        shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------ 5. the environment a new template is exec'd with


SECRETS = {"OPENAI_API_KEY": "sk-lean-0penai-5e1", "AWS_SECRET_ACCESS_KEY": "aws-lean-secret-77",
           "GITHUB_TOKEN": "ghp_lean_passed_token"}


def test_a_variable_not_passed_reaches_no_tool_of_a_template_execd_with_the_supervisors_environment(
        start_raw: Callable[..., LocalExecutor]) -> None:
    """``serve`` started by an operator with secrets in its environment and one of them handed on
    (``--pass-env GITHUB_TOKEN``): the template is exec'd with the supervisor's environment, which
    ``serve`` made the allowlist by exec'ing itself first. A tool sees the one passed and nothing of
    the others: not in its environment, its ``/proc/self/environ``, the template's, nor its memory."""
    local = start_raw(env={**os.environ, **SECRETS}, pass_env=["GITHUB_TOKEN"])
    assert local.client is not None
    seen = local.client.call(Call(tool="read_secrets")).value
    assert seen["environ"].get("GITHUB_TOKEN") == SECRETS["GITHUB_TOKEN"], "the variable passed did not arrive"
    withheld = {"OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY"}
    assert not withheld & set(seen["environ"]), sorted(seen["environ"])
    assert not withheld & set(seen["proc_self"]) and not withheld & set(seen["proc_parent"]), seen
    halves = [[v[: len(v) // 2], v[len(v) // 2:]] for k, v in SECRETS.items() if k in withheld]
    found = local.client.call(Call(tool="secrets_in_memory", args=[halves]))
    assert found.ok, found.error
    assert found.value == {"posix_environ": [], "memory": []}, found.value
