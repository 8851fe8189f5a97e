"""``ExecutorClient`` and ``LocalExecutor`` against real executors: many threads at once, an executor
that is killed, frozen or restarted under the client, and the local executor's start and stop.

Timing constants come from ``controller.client``; every wait is a poll against a deadline."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from controller import ExecutorClient, ExecutorStartError, ExecutorUnavailable, LocalExecutor
from controller.client import DEADLINE_GRACE, SILENCE_BEFORE_RECONNECT, UNAVAILABLE_AFTER
from executor.status import fetch
from protocol import Call, Result
from tests.support.executors import local_of
from tests.support.processes import alive
from tests.support.waiting import wait_for

FAULTY = str(Path(__file__).parent / "tools" / "faulty.py")
SLACK = 2.0  # extra seconds a bound may take on a loaded 2-core machine


def tree(pid: int) -> list[int]:
    return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]


def served(client: ExecutorClient) -> dict[str, tuple[int, int]]:
    """Calls the executor answered so far, by tool: (calls, errors), from its ``status`` report."""
    return {t.name: (t.calls, t.errors) for t in fetch(client.endpoint).tools}


@pytest.fixture
def frozen() -> Iterator[list[int]]:
    """Pids a test stops with SIGSTOP; each is continued at the end even if the test failed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------- many threads


def test_calls_from_8_threads_each_get_their_own_result(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[FAULTY], workers=2)
    per_thread = 40  # half of them in flight at once: 160, well inside the default queue bound
    mismatches: list[str] = []
    done = threading.Barrier(9)

    def run(t: int) -> None:
        try:
            futures = []
            for i in range(per_thread):
                payload = {"thread": t, "i": i, "blob": "x" * (i * 37 % 500)}
                call = Call(id=f"t{t}-{i}-{uuid.uuid4().hex[:6]}", tool="echo", args=[payload])
                if i % 2:  # half blocking calls, half futures collected later
                    futures.append((call, payload, client.submit(call)))
                    continue
                r = client.call(call)
                if not (r.ok and r.id == call.id and r.value == payload):
                    mismatches.append(f"{call.id}: {r}")
            for call, payload, future in futures:
                r = future.result(timeout=30)
                if not (r.ok and r.id == call.id and r.value == payload):
                    mismatches.append(f"{call.id}: {r}")
        except Exception as e:  # a thread's failure must fail the test, not vanish
            mismatches.append(repr(e))
        finally:
            done.wait()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    done.wait(timeout=60)
    for th in threads:
        th.join(5)
    assert mismatches == []
    assert client.call(Call(tool="echo", args=["after"])).value == "after"


# -------------------------------------------------------------------------- executor trouble


def test_a_call_in_flight_when_the_executor_is_killed_resolves_without_hanging(
    make_client: Callable[..., ExecutorClient], tmp_path: Path
) -> None:
    client = make_client(tools=[FAULTY])
    proc = local_of(client).proc
    assert proc is not None
    pids = tree(proc.pid)
    marker = tmp_path / "started"
    future = client.submit(Call(tool="append_line", kwargs={"path": str(marker), "then_sleep": 60}), timeout=60)
    wait_for(marker.exists, 5, "the call started")
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)
    result = future.result(timeout=UNAVAILABLE_AFTER + SLACK + 2)
    assert time.monotonic() - started < UNAVAILABLE_AFTER + SLACK
    assert result.error is not None and result.error.kind in ("unavailable", "crashed"), result
    wait_for(lambda: not any(alive(p) for p in pids), 5, "template and worker died with the supervisor")


def test_a_dead_executor_is_noticed_by_heartbeat_with_no_call_in_flight(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client(tools=[FAULTY])
    wait_for(lambda: client.alive, 5, "the client sees the executor alive")
    os.killpg(local_of(client).proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    took = wait_for(lambda: not client.alive, SILENCE_BEFORE_RECONNECT + SLACK, "the client notices the death")
    assert took >= SILENCE_BEFORE_RECONNECT - 1.0, "alive went False before any heartbeat could have been missed"


def test_a_call_times_out_on_the_client_when_the_executor_never_answers(
    make_client: Callable[..., ExecutorClient], frozen: list[int]
) -> None:
    client = make_client(tools=[FAULTY])
    assert client.call(Call(tool="noop")).ok
    pid = local_of(client).proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    frozen.append(pid)
    started = time.monotonic()
    result = client.call(Call(tool="noop"), timeout=1.0)
    took = time.monotonic() - started
    assert result.error is not None and result.error.kind == "timeout", result
    assert 1.0 + DEADLINE_GRACE - 0.1 <= took < 1.0 + DEADLINE_GRACE + SLACK
    os.kill(pid, signal.SIGCONT)
    wait_for(lambda: client.call(Call(tool="echo", args=[5]), timeout=2).value == 5, 15,
             "the client works again once the executor does")


def test_a_resent_call_is_not_run_twice(
    make_client: Callable[..., ExecutorClient], frozen: list[int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The executor is frozen mid-call for longer than the client waits before it reconnects and
    resends the call under its id; once thawed, it still runs the call (the worker is not frozen), the
    resend joins it, and the side effect shows the tool ran once."""
    caplog.set_level(logging.INFO, logger="ciayn.client")
    client = make_client(tools=[FAULTY])
    local = local_of(client)
    log = tmp_path / "runs.log"
    future = client.submit(Call(tool="append_line", kwargs={"path": str(log), "then_sleep": 6.0}))
    wait_for(log.exists, 5, "the call started")
    pid = local.proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)  # the supervisor only: the worker goes on with the call meanwhile
    frozen.append(pid)
    wait_for(lambda: any("reconnected" in r.getMessage() for r in caplog.records),
             SILENCE_BEFORE_RECONNECT + SLACK + 1, "the client reconnected and resent")
    os.kill(pid, signal.SIGCONT)
    result = future.result(timeout=20)
    assert result.ok and result.value == 1, result
    assert client.call(Call(tool="noop")).ok  # one worker, FIFO: a second run would have come first
    assert log.read_text() == "ran\n", "the resent call ran again"
    assert "duplicate id" in local.log_path.read_text(), "the executor never saw the resend"


@pytest.mark.parametrize("late", [False, True], ids=["restarted-at-once", "restarted-after-client-reconnected"])
def test_the_client_recovers_when_the_executor_restarts_on_the_same_endpoint(
    late: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second executor on the same ipc path after the first was SIGKILLed mid-call: the client
    follows it (new incarnation, calls succeed), re-runs the idempotent call that was in flight and
    answers the other one ``unavailable`` without ever sending it to the new executor, also when the
    new one comes up only after the client has already reconnected (and would resend)."""
    caplog.set_level(logging.INFO, logger="ciayn.client")
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-test-"))
    endpoint = f"ipc://{sock_dir}/exec.sock"
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "executor.cli", "serve", "--tools", FAULTY, "--bind", endpoint,
               "--workers", "2"]  # two workers: both calls run at once
        with open(sock_dir / f"executor{len(procs)}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=log, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        first = start()
        with ExecutorClient(endpoint, connect_timeout=30) as client:
            assert client.tools()
            assert client.welcome is not None
            old = client.welcome.incarnation
            plain_log, safe_log = tmp_path / "plain.log", tmp_path / "safe.log"
            plain_id = uuid.uuid4().hex
            plain_call = Call(id=plain_id, tool="append_line",
                              kwargs={"path": str(plain_log), "then_sleep": 30})
            plain = client.submit(plain_call)
            safe = client.submit(Call(tool="idempotent_append", kwargs={"path": str(safe_log), "then_sleep": 0.2}))
            wait_for(lambda: plain_log.exists() and safe_log.exists(), 5, "both calls started")
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(5)
            if late:
                wait_for(lambda: any("reconnected" in r.getMessage() for r in caplog.records),
                         SILENCE_BEFORE_RECONNECT + SLACK + 1, "the client reconnected")
            second = start()

            wait_for(lambda: client.welcome is not None and client.welcome.incarnation != old, 30,
                     "the client saw the new incarnation")
            r = safe.result(timeout=30)
            assert r.ok and r.value == 2, f"an idempotent call in flight is run again by the new executor: {r}"
            r = plain.result(timeout=30)
            assert r.error is not None and r.error.kind == "unavailable" and "restarted" in r.error.message, r
            for i in range(5):
                assert client.call(Call(tool="echo", args=[i])).value == i
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0
        assert plain_id not in (sock_dir / "executor1.log").read_text(), (
            "a call that is not idempotent was sent to the new executor")
        assert plain_log.read_text() == "ran\n"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------ the API


def test_call_text_rejects_bad_text_without_sending_it(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[FAULTY])
    assert client.call(Call(tool="noop")).ok
    before = served(client)
    for text, kind in [
        ("rm -rf /", "rejected"),
        ("__import__('os').system('true')", "rejected"),
        ("echo(open('x'))", "rejected"),
        ("no_such_tool()", "unknown_tool"),
        ("fail(1, 2, 3)", "bad_arguments"),
    ]:
        r = client.call_text(text)
        assert not r.ok and r.error is not None and r.error.kind == kind, (text, r)
        assert r.error.message
    good = client.call_text("echo('fine')")
    assert good.ok and good.value == "fine"
    after = served(client)
    assert sum(c for c, _ in after.values()) == sum(c for c, _ in before.values()) + 1, (before, after)
    assert after["echo"][0] == before.get("echo", (0, 0))[0] + 1 and after["echo"][1] == 0, \
        f"only the valid call may reach the executor: {before} -> {after}"


@pytest.mark.parametrize(
    "args",
    [[{1, 2}], [2**70], [{"nested": [object()]}]],
    ids=["set", "int over 64 bits", "object"],
)
def test_a_call_that_cannot_cross_the_wire_is_answered_at_once(
    args: list[object], make_client: Callable[..., ExecutorClient]
) -> None:
    """Not after its timeout, and not as ``timeout``: it was never sent."""
    client = make_client(tools=[FAULTY])
    started = time.monotonic()
    r = client.call(Call(tool="echo", args=args))
    assert time.monotonic() - started < 1.0
    assert r.error is not None and r.error.kind == "protocol", r
    assert "args[0]" in r.error.message and "not sent" in r.error.message
    assert client.call(Call(tool="echo", args=[1])).value == 1


def test_close_answers_calls_in_flight_and_later_calls(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[FAULTY])
    future = client.submit(Call(tool="sleep_forever"), timeout=30)
    client.close()
    r = future.result(timeout=5)
    assert r.error is not None and r.error.kind == "cancelled"
    r = client.call(Call(tool="noop"))
    assert r.error is not None and r.error.kind == "unavailable"


def test_close_answers_a_call_another_thread_waits_on(make_client: Callable[..., ExecutorClient]) -> None:
    """That thread runs the client's loop itself (nobody else does): closing must reach it there."""
    client = make_client(tools=[FAULTY])
    results: list[Result] = []
    waiting = threading.Thread(target=lambda: results.append(client.call(Call(tool="sleep_forever"), timeout=30)))
    waiting.start()
    wait_for(lambda: fetch(client.endpoint).busy == 1, 10, "the call to run")
    client.close()
    waiting.join(5)
    assert not waiting.is_alive(), "the call was never answered"
    assert results[0].error is not None and results[0].error.kind == "cancelled", results[0]


def test_tools_raises_when_no_executor_answers(tmp_path: Path) -> None:
    with ExecutorClient(f"ipc://{tmp_path}/nobody.sock", connect_timeout=0.3) as client:
        with pytest.raises(ExecutorUnavailable, match="is `ciayn-executor serve` running"):
            client.tools()
        r = client.call_text("noop()")
        assert r.error is not None and r.error.kind == "unavailable"


def test_a_call_to_an_endpoint_nothing_ever_answered_says_so_by_its_deadline(tmp_path: Path) -> None:
    """Before an executor's first word the client does not give calls up after UNAVAILABLE_AFTER of
    silence (the executor may be loading its tools), but each call's own deadline holds, and the
    answer then says that nothing ever answered there, not that the tool timed out."""
    with ExecutorClient(f"ipc://{tmp_path}/nobody.sock") as client:
        started = time.monotonic()
        r = client.call(Call(tool="noop", timeout=1))
        took = time.monotonic() - started
    assert r.error is not None and r.error.kind == "unavailable", r
    assert "nothing has answered at" in r.error.message and "may or may not have run" in r.error.message, r
    assert 1 <= took < 1 + DEADLINE_GRACE + SLACK, took


def test_local_executor_start_failure_raises_with_the_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad_tools.py"
    bad.write_text("raise RuntimeError('tool module exploded')\n")
    private = Path(tempfile.mkdtemp(prefix="ciayn-t-"))  # short: an ipc path is at most 107 bytes
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    local = LocalExecutor(tools=[str(bad)])
    with pytest.raises(ExecutorStartError) as info:
        local.start()
    message = str(info.value)
    assert "exited with code 1" in message
    assert "executor log" in message and "RuntimeError: tool module exploded" in message
    assert local.proc is not None and local.proc.returncode is not None
    assert list(private.iterdir()) == [], "the failed start left its temp dir behind"
    private.rmdir()


def test_local_executor_uses_a_private_dir_and_cleans_up_on_exit() -> None:
    local = LocalExecutor(tools=[FAULTY], workers=2)
    with local as client:
        assert local.dir is not None and local.proc is not None
        directory = local.dir
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert local.endpoint == f"ipc://{directory}/executor.sock"
        assert (directory / "executor.sock").exists()
        assert client.call(Call(tool="noop")).ok
        proc = local.proc  # supervisor, template, two workers (the one used is replaced shortly after the call)
        wait_for(lambda: len(tree(proc.pid)) >= 4, 5, "supervisor, template and two workers")
        pids = tree(local.proc.pid)
    assert not directory.exists()
    assert local.proc.returncode == 0, "the executor was not stopped cleanly (SIGTERM)"
    wait_for(lambda: not any(alive(p) for p in pids), 5, "every executor process ended")



def test_a_malformed_endpoint_is_refused_at_once_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot use executor endpoint 'tcp://bad endpoint'"):
        ExecutorClient("tcp://bad endpoint")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        ExecutorClient("ipc:///tmp/nowhere.sock", timeout=float("nan"))


def test_the_clients_timeout_applies_to_calls_that_give_none(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(timeout=30)
    with ExecutorClient(client.endpoint, timeout=1) as short:
        started = time.monotonic()
        result = short.call(Call(tool="sleep_forever"))
        assert result.error is not None and result.error.kind == "timeout", result
        assert "its 1 s time limit" in result.error.message  # the executor enforced the client's timeout
        assert time.monotonic() - started < 5


def test_a_calls_timeout_counts_from_its_arrival_also_while_it_waits_in_the_queue(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """Three 1.5 s calls with a 2 s timeout on one worker: the first runs; the second starts with what
    is left of its timeout; the third is still queued when its timeout runs out and is answered
    ``unavailable`` (it did not run). The executor answers all three within the timeout, before the
    client's own bound (timeout plus DEADLINE_GRACE), which nothing the executor reports extends."""
    client = make_client(timeout=2, workers=1)
    started = time.monotonic()
    naps = [client.submit(Call(tool="nap", kwargs={"seconds": 1.5})) for _ in range(3)]
    results = [f.result(timeout=30) for f in naps]
    assert time.monotonic() - started < 2.0 + DEADLINE_GRACE
    assert results[0].ok, results[0]
    assert results[1].error is not None and results[1].error.kind == "timeout", results[1]
    assert results[1].limits is not None and results[1].limits.timeout_s < 1.0
    message = results[1].error.message  # its own timeout, and how much of it the queue took
    assert "its 2 s time limit" in message and "spent waiting in the queue" in message, message
    assert results[2].error is not None and results[2].error.kind == "unavailable", results[2]
    assert "queue" in results[2].error.message and "did not run" in results[2].error.message
    assert not any("no answer from the executor" in (r.error.message if r.error else "") for r in results)
