"""Red team of the executor's start-up and shutdown paths (``ciayn-executor serve``: the template is
forked first, then the endpoint bound or the broker connected, keys and the metrics port taken, and
only then is the template sent its ``Configure`` and imports the tool modules, up to 60 s; a linked
executor announces itself to its broker once its tools are loaded).

Every attack runs real executor processes on real sockets. The window while the tools are being
imported is controlled by a tool module whose import blocks until the test writes a file
(``tests/tools/startup_gate.py``), never by a sleep. Tool modules: ``tests/tools/startup_*.py``.

The red team found 8 holes; each is closed and its test failed on the code before the fix: SIGTERM,
SIGINT and the parent's exit during the import (the socket file was left; the parent's exit went
unnoticed); an import bound per read, not per report (a trickling module held the start forever);
a tool module forging the template's "no PID namespace" report (namespaces turned off, or templates
restarted without end); the import's report decoded without a bound on work; and the Python client
giving a call up after 6 s of an executor still importing. The other tests are attacks the defence
held against from the start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from controller import ExecutorClient
from protocol import Bye, Call, Heartbeat, Hello, Ping, Pong, Ready, Result, Status, Welcome, encode
from tests.conftest import TESTS, pid_namespaces, template_of
from tests.support.serve import (
    ENV,
    EXIT_BOUND,
    FLAKY,
    GATE,
    Executor,
    MiB,
    ctx,
    executors,
)
from tests.support.serve import collect as _collect
from tests.support.serve import dealer as _dealer
from tests.support.serve import rss as _rss
from tests.support.serve import start as _start
from tests.support.waiting import wait_until

__all__ = ["ctx", "executors"]  # fixtures, used by name

ROOT = TESTS.parent
TOOLS = TESTS / "tools"
BROKEN = str(TOOLS / "startup_broken.py")
SUICIDE = str(TOOLS / "startup_suicide.py")
FORKER = str(TOOLS / "startup_forker.py")
FORGE = str(TOOLS / "startup_forge.py")
FORGE_LOOP = str(TOOLS / "startup_forge_loop.py")
TRICKLE = str(TOOLS / "startup_trickle.py")
BLOAT = str(TOOLS / "startup_bloat.py")


# ------------------------------------------------------------------ 1. clients while the tools import


def test_early_clients_of_many_connections_are_answered_correctly_once_the_tools_are_loaded(
        tmp_path: Path, executors: list[Executor], ctx: zmq.Context[Any]) -> None:
    """Thirty-two clients connect while the tool module is importing and each sends a ping, a
    hello and a call: nothing answers before the tools are known (no welcome with an empty tool
    list, no unknown_tool for a call that will be valid), then every one is answered, correctly."""
    ex = _start(executors, tmp_path, [GATE])
    ex.wait_for("importing")
    socks = [_dealer(ctx, ex.endpoint, b"c%02d" % i) for i in range(32)]
    for i, s in enumerate(socks):
        s.send_multipart(encode(Ping(nonce=1000 + i)))
        s.send_multipart(encode(Hello(client="early")))
        s.send_multipart(encode(Call(id=f"early-{i}", tool="echo", kwargs={"x": i})))
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    assert not poller.poll(300), "the executor answered before its tools were loaded"
    ex.release()
    got = _collect(socks, lambda g: all(len(v) >= 3 for v in g.values()), 20)
    for i, msgs in got.items():
        pongs = [m for m in msgs if isinstance(m, Pong)]
        welcomes = [m for m in msgs if isinstance(m, Welcome)]
        results = [m for m in msgs if isinstance(m, Result)]
        assert [p.nonce for p in pongs] == [1000 + i], msgs
        assert len(welcomes) == 1 and {t.name for t in welcomes[0].tools} == {"echo", "length"}, msgs
        assert len(results) == 1 and results[0].id == f"early-{i}", msgs
        assert results[0].ok and results[0].value == i, results[0]


def test_a_flood_while_the_tools_import_waits_in_the_client_not_in_the_executor(
        tmp_path: Path, executors: list[Executor], ctx: zmq.Context[Any]) -> None:
    """One client sends calls of 2 MiB as fast as the executor takes them while it is importing its
    tools: ZeroMQ must stop reading it ahead (RCVHWM) although nothing reads the socket yet, so the
    flood stays in the client; the executor's memory stays bounded (its peak), and every call it
    took is run once the tools are loaded."""
    ex = _start(executors, tmp_path, [GATE])
    ex.wait_for("importing")
    base = _rss(ex.proc.pid)
    flood = _dealer(ctx, ex.endpoint, b"flooder")
    flood.setsockopt(zmq.SNDHWM, 1)
    payload = os.urandom(2 * MiB)
    sent = 0
    while sent < 64 and flood.poll(500, zmq.POLLOUT):  # the executor's side took the last one
        flood.send_multipart(encode(Call(id=f"flood-{sent}", tool="length", args=[payload])), zmq.NOBLOCK)
        sent += 1
    grown = _rss(ex.proc.pid, "VmHWM") - base
    assert sent < 32, f"the importing executor took {sent} calls of 2 MiB without reading any"
    assert grown < 32 * MiB, f"the importing executor grew by {grown // MiB} MiB under a flood of {sent} calls"
    ex.release()
    got = _collect([flood], lambda g: len(g[0]) >= sent, 30)[0]
    assert sorted(r.id for r in got) == sorted(f"flood-{i}" for i in range(sent))
    assert all(r.ok and r.value == 2 * MiB for r in got), [r.error for r in got if not r.ok][:3]


def test_the_python_client_waits_out_a_slow_tool_import(tmp_path: Path, executors: list[Executor],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import controller.client.link

    monkeypatch.setattr(controller.client.link, "UNAVAILABLE_AFTER", 1.5)
    ex = _start(executors, tmp_path, [GATE])
    ex.wait_for("importing")
    with ExecutorClient(ex.endpoint, timeout=30) as client:
        future = client.submit(Call(tool="echo", kwargs={"x": 7}), timeout=30)
        with contextlib.suppress(TimeoutError):
            early = future.result(timeout=2.5)  # the import is not over: nothing may answer the call yet
            assert early.ok, f"the client gave the call up while the executor imported its tools: {early.error}"
        ex.release()
        result = future.result(timeout=20)
    assert result.ok and result.value == 7, result.error


# ------------------------------------------------------------------ 2. signals and parent death during the import


def test_sigterm_while_the_tools_import_leaves_nothing_behind(tmp_path: Path, executors: list[Executor]) -> None:
    ex = _start(executors, tmp_path, [GATE])
    ex.wait_for("importing")
    assert ex.sock.exists()
    os.kill(ex.proc.pid, signal.SIGTERM)
    ex.wait_exit()
    ex.assert_nothing_left()
    assert not ex.sock.exists(), "the executor stopped by SIGTERM during the import left its socket file"


def test_sigint_while_the_tools_import_leaves_nothing_behind(tmp_path: Path, executors: list[Executor]) -> None:
    ex = _start(executors, tmp_path, [GATE])
    ex.wait_for("importing")
    os.kill(ex.proc.pid, signal.SIGINT)
    ex.wait_exit()
    ex.assert_nothing_left()
    assert not ex.sock.exists(), "the executor stopped by SIGINT during the import left its socket file"
    assert "Traceback" not in ex.log(), ex.log()


def test_sigterm_while_a_replacement_template_imports_the_tools_stops_promptly(
        tmp_path: Path, executors: list[Executor]) -> None:
    """The template dies after serving; its replacement (a new interpreter) imports the tools again,
    and that import blocks. A SIGTERM then ends the wait at once (the signal's wakeup pipe is watched
    there too), not once the import is over: the executor exits 0 and leaves nothing."""
    ex = _start(executors, tmp_path, [GATE])
    ex.release()
    with ExecutorClient(ex.endpoint, timeout=30) as client:
        assert client.call(Call(tool="echo", kwargs={"x": 5})).value == 5
    (ex.workspace / "release").unlink()
    (ex.workspace / "importing").unlink()
    template = template_of(ex.proc.pid)
    assert template, "no template under the supervisor"
    os.kill(template, signal.SIGKILL)
    ex.wait_for("importing")  # the replacement is inside the import now
    os.kill(ex.proc.pid, signal.SIGTERM)
    assert ex.wait_exit() == 0, ex.log()
    ex.assert_nothing_left()
    assert not ex.sock.exists(), "the executor stopped during a replacement's import left its socket file"


def test_while_a_replacement_template_imports_the_tools_the_executor_answers_and_queues(
        tmp_path: Path, executors: list[Executor], ctx: zmq.Context[Any]) -> None:
    """The template dies after serving, and its replacement's import blocks. The event loop waits
    for that template, not the other way round: pings are answered at once (saying a call is
    queued), so no client or broker takes the executor for dead, and the call that came meanwhile
    runs once the tools are loaded."""
    ex = _start(executors, tmp_path, [GATE])
    ex.release()
    sock = _dealer(ctx, ex.endpoint, b"replacing")
    sock.send_multipart(encode(Call(id="before", tool="echo", kwargs={"x": 1})))
    assert [r.value for r in _collect([sock], lambda g: len(g[0]) >= 1, 20)[0]] == [1]
    (ex.workspace / "release").unlink()
    (ex.workspace / "importing").unlink()
    template = template_of(ex.proc.pid)
    assert template, "no template under the supervisor"
    os.kill(template, signal.SIGKILL)
    ex.wait_for("importing")  # the replacement is inside the import now
    sock.send_multipart(encode(Call(id="during", tool="echo", kwargs={"x": 2})))
    for nonce in (1, 2, 3):
        sock.send_multipart(encode(Ping(nonce=nonce)))
        pong = _collect([sock], lambda g: len(g[0]) >= 1, 2.0)[0][0]
        assert isinstance(pong, Pong) and pong.nonce == nonce, pong
        assert pong.queued == 1 and pong.busy == 0, pong
    ex.release()
    result = _collect([sock], lambda g: len(g[0]) >= 1, 20)[0][0]
    assert isinstance(result, Result) and result.id == "during" and result.ok and result.value == 2, result


def test_a_replacement_template_that_cannot_start_is_tried_again_and_the_executor_stays_up(
        tmp_path: Path, executors: list[Executor], ctx: zmq.Context[Any]) -> None:
    """The template dies, and the next two templates cannot load the tools (the module fails at its
    second and third import). The executor does not exit for it: it goes on answering pings, tries
    again later (0.5 s, then 1 s), and the call that came meanwhile runs in the third replacement."""
    (tmp_path / "ws-ex0").mkdir()
    (tmp_path / "ws-ex0" / "fail-imports").write_text("2 3")
    ex = _start(executors, tmp_path, [FLAKY])
    sock = _dealer(ctx, ex.endpoint, b"flaky")
    sock.send_multipart(encode(Call(id="before", tool="echo", kwargs={"x": 1})))
    assert [r.value for r in _collect([sock], lambda g: len(g[0]) >= 1, 20)[0]] == [1]
    imports = ex.workspace / "imports"
    template = template_of(ex.proc.pid)
    assert template, "no template under the supervisor"
    os.kill(template, signal.SIGKILL)
    sock.send_multipart(encode(Call(id="during", tool="echo", kwargs={"x": 2}, timeout=30)))
    wait_until("the second import (the first that fails)", lambda: len(imports.read_text().split()) >= 2, 20)
    sock.send_multipart(encode(Ping(nonce=7)))
    got = _collect([sock], lambda g: any(isinstance(m, Pong) for m in g[0]), 5)[0]
    assert ex.proc.poll() is None, ex.log()
    got += _collect([sock], lambda g: any(isinstance(m, Result) for m in got + g[0]), 20)[0]
    result = next(m for m in got if isinstance(m, Result))
    assert result.id == "during" and result.ok and result.value == 2, result
    assert len(imports.read_text().split()) == 4, imports.read_text()
    log = ex.log()
    assert "cannot start a new template (attempt 1)" in log and "(attempt 2)" in log, log
    assert "import 2 told to fail" in log and "import 3 told to fail" in log, log


def test_parent_death_while_the_tools_import_stops_the_executor_promptly(
        tmp_path: Path, executors: list[Executor]) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=ENV)
    try:
        ex = _start(executors, tmp_path, [GATE], "--parent-pid", str(parent.pid))
        ex.wait_for("importing")
    finally:
        parent.kill()
        parent.wait(10)
    ex.wait_exit(3.0)  # with the import still blocked: the executor must notice the parent without it
    ex.assert_nothing_left()
    assert not ex.sock.exists(), "the executor of a dead parent left its socket file"


def test_sigterm_after_a_tool_module_started_a_daemon_at_import_leaves_no_process(
        tmp_path: Path, executors: list[Executor]) -> None:
    """A daemon (double fork, new session, SIGTERM ignored) that the tool module started at import
    does not outlive the executor's clean shutdown."""
    ex = _start(executors, tmp_path, [FORKER])
    ex.wait_for("forked")
    with ExecutorClient(ex.endpoint, timeout=30) as client:
        assert client.call(Call(tool="echo", kwargs={"x": 3})).value == 3
    os.kill(ex.proc.pid, signal.SIGTERM)
    assert ex.wait_exit() == 0, ex.log()
    ex.assert_nothing_left()
    assert not ex.sock.exists()


# ------------------------------------------------------------------ 3. tool modules that cannot be imported


def _refused_cleanly(ex: Executor, message: str) -> None:
    code = ex.wait_exit(15)
    log = ex.log()
    assert code == 1, log
    assert "cannot start" in log and message in log, log
    ex.assert_nothing_left()
    assert not ex.sock.exists(), "a refused executor left its socket file"


def test_a_tool_module_that_raises_at_import_is_refused_with_its_error(
        tmp_path: Path, executors: list[Executor]) -> None:
    ex = _start(executors, tmp_path, [BROKEN])
    _refused_cleanly(ex, "marker 7c1f")


def test_a_tool_module_that_kills_its_own_template_at_import_is_refused(
        tmp_path: Path, executors: list[Executor]) -> None:
    """It sends itself SIGSTOP and SIGKILL (as a PID namespace's init it is spared both) and then
    exits: the supervisor reads the channel's end, says so, and exits 1."""
    ex = _start(executors, tmp_path, [SUICIDE])
    _refused_cleanly(ex, "died while importing")
    if pid_namespaces():
        assert (ex.workspace / "survived").exists(), "the template was stopped by its own signals"


def test_a_daemon_a_failing_tool_module_started_at_import_does_not_outlive_the_refusal(
        tmp_path: Path, executors: list[Executor]) -> None:
    (tmp_path / "ws-ex0").mkdir()
    (tmp_path / "ws-ex0" / "fail").write_text("")
    ex = _start(executors, tmp_path, [FORKER])
    _refused_cleanly(ex, "told to fail after starting its daemon")
    assert (ex.workspace / "forked").exists(), "the module did not start its daemon (the attack misfired)"


def test_an_import_that_hangs_past_the_bound_is_refused(tmp_path: Path, executors: list[Executor]) -> None:
    """With the import bound made 1 s (``PATCHED``), a module whose import never ends: the executor
    gives up at the bound, kills the template, exits 1 and removes its socket file."""
    ex = _start(executors, tmp_path, [GATE], import_timeout=1.0)
    ex.wait_for("importing")
    started = time.monotonic()
    _refused_cleanly(ex, "still importing the tools after 1 s")
    assert time.monotonic() - started < 1.0 + EXIT_BOUND


def test_an_import_that_trickles_bytes_to_the_supervisor_is_still_bounded(
        tmp_path: Path, executors: list[Executor]) -> None:
    ex = _start(executors, tmp_path, [TRICKLE], import_timeout=1.0)
    ex.wait_for("trickling")
    started = time.monotonic()
    with contextlib.suppress(AssertionError):
        ex.wait_exit(1.0 + 2.5)
    assert ex.proc.poll() == 1, (f"the executor still waits for its template's first message "
                                 f"{time.monotonic() - started:.1f} s into a 1 s bound")
    _refused_cleanly(ex, "cannot start")


# ------------------------------------------------------------------ 4. a tool module that writes the template's channel


def test_a_tool_module_cannot_turn_the_pid_namespace_off(tmp_path: Path, executors: list[Executor]) -> None:
    """A tool module forges, at import, the report a template sends when it cannot set its PID
    namespace up. Only the template's first message, sent before it reads its ``Configure`` (so
    before any tool code runs), can turn namespaces off: a ``LoadFailed`` after it is the tool
    modules' failure, whatever it says, and the executor refuses to start (never serving workers in
    its own namespace)."""
    if not pid_namespaces():
        pytest.skip("workers share the executor's PID namespace here anyway")
    ex = _start(executors, tmp_path, [FORGE])
    _refused_cleanly(ex, "forged by a tool module")
    assert (ex.workspace / "forged").exists(), "the module did not forge the report (the attack misfired)"
    assert len((ex.workspace / "forged").read_text().split()) == 1, "a second template imported the module"
    assert "PID namespace" not in ex.log().split("cannot start")[0], ex.log()


def test_control_workers_of_an_honest_module_run_in_a_pid_namespace_of_their_own(
        tmp_path: Path, executors: list[Executor]) -> None:
    """The control of the attack above: the same module, imported where it forges nothing (a
    template in a namespace is PID 1; here the first template is made so as usual)."""
    if not pid_namespaces():
        pytest.skip("workers share the executor's PID namespace here")
    ex = _start(executors, tmp_path, [GATE])
    ex.release()
    template = wait_until("the template", lambda: template_of(ex.proc.pid), 20)
    assert os.readlink(f"/proc/{template}/ns/pid") != os.readlink("/proc/self/ns/pid")


def test_a_tool_module_forging_the_namespace_report_at_every_import_is_refused_once(
        tmp_path: Path, executors: list[Executor]) -> None:
    ex = _start(executors, tmp_path, [FORGE_LOOP])
    imports = ex.workspace / "imports"

    def decided() -> bool:
        return ex.proc.poll() is not None or (imports.exists() and len(imports.read_text().split()) >= 4)

    wait_until("the executor to exit or to import the module four times", decided, 20)
    count = len(imports.read_text().split()) if imports.exists() else 0
    assert count <= 2, f"the executor imported the tool module {count} times and goes on"
    _refused_cleanly(ex, "cannot start")


def test_a_tool_modules_first_message_costs_the_supervisor_bounded_work(
        tmp_path: Path, executors: list[Executor]) -> None:
    """A tool module writes, at import, a ``ToolsLoaded`` padded with 8 million nils (8 MiB, under
    the report's 16 MiB cap; a list of 8 million references, 64 MiB, decoded without a bound): the
    supervisor decodes it within the element budget, refuses it, and does not start."""
    ex = _start(executors, tmp_path, [BLOAT])
    _refused_cleanly(ex, "bad message while importing the tools")
    assert "serving" not in ex.log(), ex.log()


# ------------------------------------------------------------------ 5. a linked executor and its broker


def test_a_hostile_broker_talking_first_gets_nothing_before_ready_and_then_correct_answers(
        tmp_path: Path, executors: list[Executor], ctx: zmq.Context[Any]) -> None:
    """A "broker" that binds a DEALER (so it can send before the executor said anything) sends
    heartbeats, a ``bye``, a ``status`` and calls while the tools import. The executor sends it
    nothing until its tools are loaded, then ``ready`` first, and then answers the early calls
    correctly (a broker may send calls; what matters is that none is lost, misrouted or run early)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-su-"))
    try:
        backend = f"ipc://{sock_dir}/backend.sock"
        broker: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        broker.setsockopt(zmq.LINGER, 0)
        broker.bind(backend)
        ex = _start(executors, tmp_path, [GATE], connect=backend)
        ex.wait_for("importing")
        wait_until("the executor's connection", lambda: broker.poll(0, zmq.POLLOUT), 10)
        early = [Heartbeat(executor="broker"), Bye(reason="announce yourself", refused=False), Status(),
                 Call(id="b-1", tool="echo", kwargs={"x": 11}), Heartbeat(executor="broker"),
                 Call(id="b-2", tool="nope"), Call(id="b-3", tool="echo", kwargs={"x": 12})]
        for msg in early:
            broker.send_multipart(encode(msg), zmq.NOBLOCK)
        assert not broker.poll(300), "the executor spoke to its broker before its tools were loaded"
        ex.release()

        def answered(got: dict[int, list[Any]]) -> bool:
            return {"b-1", "b-2", "b-3"} <= {m.id for m in got[0] if isinstance(m, Result)}

        got = _collect([broker], answered, 20)[0]
        assert isinstance(got[0], Ready), f"the executor's first message to its broker is not ready: {got[0]!r}"
        assert {t.name for t in got[0].tools} == {"echo", "length"}
        results = {m.id: m for m in got if isinstance(m, Result)}
        assert results["b-1"].ok and results["b-1"].value == 11, results["b-1"]
        assert results["b-3"].ok and results["b-3"].value == 12, results["b-3"]
        assert not results["b-2"].ok and results["b-2"].error is not None
        assert results["b-2"].error.kind == "unknown_tool"
        assert ex.proc.poll() is None, ex.log()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_broker_never_hears_ready_from_an_executor_whose_tools_fail(
        tmp_path: Path, executors: list[Executor]) -> None:
    """A real ``ciayn-executor broker``: an executor whose tool module raises at import exits 1 without
    joining; one whose import is still under way is not a member either; it joins once released."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-su-"))
    frontend, backend = f"ipc://{sock_dir}/front.sock", f"ipc://{sock_dir}/back.sock"
    log_path = tmp_path / "broker.log"
    with open(log_path, "wb") as out:
        broker = subprocess.Popen([sys.executable, "-m", "executor.cli", "broker", "--frontend", frontend,
                                   "--backend", backend, "--recovery-s", "0"], cwd=ROOT, env=ENV,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        from executor.status import StatusError, fetch

        def members() -> list[str] | None:
            try:
                return [e.executor for e in fetch(frontend, timeout=2.0).executors]
            except StatusError:
                return None

        assert wait_until("the broker", lambda: members() is not None, 20) is not None
        broken = _start(executors, tmp_path, [BROKEN], connect=backend)
        slow = _start(executors, tmp_path, [GATE], connect=backend)
        slow.wait_for("importing")
        _refused_cleanly(broken, "marker 7c1f")
        assert members() == [], "an executor is a member before its tools are loaded"
        assert "joined" not in log_path.read_text(), log_path.read_text()
        slow.release()
        joined = wait_until("the released executor to join", lambda: members() or None, 20)
        assert len(joined) == 1
        assert log_path.read_text().count("joined") == 1, log_path.read_text()
    finally:
        broker.terminate()
        try:
            broker.wait(EXIT_BOUND)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait(EXIT_BOUND)
        shutil.rmtree(sock_dir, ignore_errors=True)
