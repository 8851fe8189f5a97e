"""The fault suite: a real executor on a real ipc socket survives every way a tool can misbehave.

For each misbehaving tool in ``tests/tools/faulty.py`` it checks the error kind (or the value, where
the tool succeeds), that the executor still answers a ping, that the next call succeeds (on a fresh
worker where the faulting one had to be replaced), and that nothing the tool started is left: the
executor's process tree is exactly supervisor, template and worker afterwards. The whole sequence
runs three times in a row in one executor, so recovery is shown to be repeatable, not a one-off.

The rest of the file drives the wire directly (a raw DEALER with ``protocol.encode``/``decode``):
at-most-once for repeated call ids, pings while every worker is stuck, malformed frames, cancel,
the queue bound, and the per-call plumbing (state, output capture, signals, timeouts).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import psutil
import pytest

from controller import ExecutorClient, LocalExecutor
from protocol import (
    MAX_FRAME_BYTES,
    VERSION,
    Call,
    Cancel,
    Ping,
    Result,
    Signal,
    encode,
)
from tests.support.faults import FAULTS, FAULTY, GRACE, HANG_TIMEOUT, OUTPUT_KB, ROUNDS, Fault
from tests.support.faults import start as _start
from tests.support.faults import survives as _survives
from tests.support.processes import alive as _alive
from tests.support.processes import assert_tree_is_supervisor_template_and
from tests.support.wire import Wire

# ------------------------------------------------------------------------------------------ helpers


def call_id() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def executor() -> Iterator[LocalExecutor]:
    """One executor (default options: a fresh worker per call) for the wire tests of the module."""
    local = _start()
    yield local
    local.stop()


@pytest.fixture(scope="module", params=["fresh", "reuse"])
def fault_executor(request: pytest.FixtureRequest) -> Iterator[LocalExecutor]:
    """One executor per worker mode for the fault table, one call at a time: with fresh workers
    (the default) every call runs in a new process; with ``--reuse-workers`` "the next call" lands on
    the worker the faulting call used, unless it had to be replaced."""
    local = _start(reuse_workers=request.param == "reuse")
    yield local
    local.stop()


@pytest.fixture
def client(executor: LocalExecutor) -> ExecutorClient:
    assert executor.client is not None
    return executor.client


@pytest.fixture
def wire(executor: LocalExecutor) -> Iterator[Wire]:
    w = Wire(executor.endpoint)
    yield w
    w.close()


# ---------------------------------------------------------------------------------------- the cast
# (the table itself, ``FAULTS``, lives in tests/support/faults.py: test_hardened.py runs it too)


@pytest.mark.parametrize(
    ("round_", "fault"),
    [(r, f) for r in range(ROUNDS) for f in FAULTS],
    ids=[f"round{r}-{f.tool}" for r in range(ROUNDS) for f in FAULTS],
)
def test_executor_survives_misbehaving_tool(round_: int, fault: Fault, fault_executor: LocalExecutor) -> None:
    executor = fault_executor
    assert executor.client is not None
    client = executor.client
    wire = Wire(executor.endpoint)
    try:
        _survives(fault, executor, client, wire)
    finally:
        wire.close()


# --------------------------------------------------------------------------------- at most once


def test_a_repeated_call_id_is_answered_from_cache_and_runs_once(wire: Wire, tmp_path: Path) -> None:
    log = tmp_path / "side-effect.log"
    sock = wire.socket()
    cid = call_id()
    call = Call(id=cid, tool="append_line", kwargs={"path": str(log)})
    first = wire.ask(sock, call)
    assert isinstance(first, Result) and first.ok and first.id == cid
    again = wire.ask(sock, call)
    assert isinstance(again, Result) and again.id == cid and again.value == first.value
    assert log.read_text().splitlines() == ["ran"], "the duplicate must not run the tool again"
    fresh = wire.ask(sock, Call(id=call_id(), tool="append_line", kwargs={"path": str(log)}))
    assert isinstance(fresh, Result) and fresh.ok
    assert log.read_text().splitlines() == ["ran", "ran"]


def test_a_duplicate_sent_while_the_call_runs_joins_it(wire: Wire, tmp_path: Path) -> None:
    log = tmp_path / "side-effect.log"
    cid = call_id()
    call = Call(id=cid, tool="append_line", kwargs={"path": str(log), "then_sleep": 0.5})
    first, resend = wire.socket(), wire.socket()  # a resend comes from a new socket (Lazy Pirate)
    wire.send(first, call)
    deadline = time.monotonic() + 5
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.exists(), "the call did not start"
    wire.send(resend, call)
    a, b = wire.receive(first), wire.receive(resend)
    assert isinstance(a, Result) and isinstance(b, Result)
    assert a.ok and a.id == b.id == cid and a.value == b.value == 1
    assert log.read_text() == "ran\n", "the call ran more than once"


# ------------------------------------------------------------------------------- the supervisor


def test_pings_are_answered_while_every_worker_is_stuck(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[FAULTY], workers=2, timeout=30)
    wire = Wire(client.local.endpoint)  # type: ignore[attr-defined]
    try:
        stuck = [client.submit(Call(tool="sleep_forever")) for _ in range(2)]
        deadline = time.monotonic() + 5
        while wire.ping().busy < 2:
            assert time.monotonic() < deadline, "the two calls never both started"
        for _ in range(5):
            started = time.monotonic()
            pong = wire.ping(within=0.5)
            assert time.monotonic() - started < 0.5
            assert pong.busy == 2 and pong.queued == 0
        assert not any(f.done() for f in stuck)
    finally:
        wire.close()


MALFORMED = {
    "wrong version": [b"ciayn/0", b"ping", encode(Ping())[2]],
    "unknown kind": [VERSION, b"launch", encode(Ping())[2]],
    "garbage body": [VERSION, b"call", b"\xc1\xff\x00garbage"],
    "body not a map": [VERSION, b"call", b"\x93\x01\x02\x03"],
    "two frames": [VERSION, b"ping"],
    "four frames": [*encode(Ping()), b"extra"],
    "call without id": [VERSION, b"call", msgpack.packb({"tool": "noop"})],
    "call with wrong field": [VERSION, b"call", b"\x82\xa2id\xa1x\xa4tool\x07"],
    "result sent to executor": encode(Result(id="x", ok=True)),
    "oversized body": [VERSION, b"call", b"\x00" * (MAX_FRAME_BYTES + 1)],
}


@pytest.mark.parametrize("frames", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_frames_get_protocol_errors_and_the_executor_keeps_serving(
    frames: list[bytes], wire: Wire
) -> None:
    sock = wire.socket()
    reply = wire.ask(sock, frames)
    assert isinstance(reply, Result), f"no protocol error reply (got {reply!r})"
    assert not reply.ok and reply.error is not None and reply.error.kind == "protocol"
    assert reply.error.message
    cid = call_id()
    ok = wire.ask(sock, Call(id=cid, tool="echo", args=["still here"]))
    assert isinstance(ok, Result) and ok.ok and ok.id == cid and ok.value == "still here"


def test_a_frame_over_the_socket_size_limit_drops_only_that_connection(wire: Wire) -> None:
    wire.send(wire.socket(), [VERSION, b"call", b"\x00" * (MAX_FRAME_BYTES + 64 * 1024)])
    wire.ping()
    sock = wire.socket()
    ok = wire.ask(sock, Call(id=call_id(), tool="echo", args=[1]))
    assert isinstance(ok, Result) and ok.ok and ok.value == 1


def test_cancel_of_a_running_call_answers_cancelled_and_replaces_the_worker(
    client: ExecutorClient, wire: Wire
) -> None:
    before = client.call(Call(tool="whoami"))
    cid = call_id()
    future = client.submit(Call(id=cid, tool="sleep_forever"), timeout=20)
    deadline = time.monotonic() + 5
    while wire.ping().busy < 1:
        assert time.monotonic() < deadline, "the call never started"
    started = time.monotonic()
    client.cancel(cid)
    result = future.result(timeout=5)
    assert time.monotonic() - started < 1.0
    assert result.id == cid and not result.ok and result.error is not None
    assert result.error.kind == "cancelled"
    assert result.worker is not None and result.worker.restarted
    after = client.call(Call(tool="whoami"))
    assert after.ok and after.value != before.value, "the cancelled call's worker was not replaced"


def test_cancel_of_a_queued_call_answers_cancelled_without_running_it(
    client: ExecutorClient, wire: Wire, tmp_path: Path
) -> None:
    log = tmp_path / "queued.log"
    running = client.submit(Call(tool="nap", kwargs={"seconds": 0.5}))
    queued = Call(id=call_id(), tool="append_line", kwargs={"path": str(log)})
    future = client.submit(queued)
    deadline = time.monotonic() + 5
    while wire.ping().queued < 1:
        assert time.monotonic() < deadline, "the second call was never queued"
    client.cancel(queued.id or "")
    result = future.result(timeout=5)
    assert result.error is not None and result.error.kind == "cancelled"
    assert running.result(timeout=5).ok
    assert not log.exists(), "a cancelled queued call must not run"


def test_a_call_beyond_the_queue_bound_is_unavailable(
    make_client: Callable[..., ExecutorClient], tmp_path: Path
) -> None:
    client = make_client(tools=[FAULTY], workers=1, max_queue=1)
    started = tmp_path / "started"
    running = client.submit(Call(tool="append_line", kwargs={"path": str(started), "then_sleep": 0.5}))
    deadline = time.monotonic() + 10
    while not started.exists():  # the one worker is busy from here on
        assert time.monotonic() < deadline, "the first call never started"
        time.sleep(0.005)
    queued = client.submit(Call(tool="nap", kwargs={"seconds": 0.0}))
    refused = client.submit(Call(tool="noop")).result(timeout=5)
    assert refused.error is not None and refused.error.kind == "unavailable", refused
    assert "queue is full" in refused.error.message
    assert not running.done(), "the refusal must come at once, not after the queue drained"
    assert running.result(timeout=5).ok and queued.result(timeout=5).ok


# -------------------------------------------------------------------------- per-call plumbing


def test_each_call_starts_from_the_templates_module_state(client: ExecutorClient) -> None:
    """A fresh worker per call: what one call changes in its process is gone for the next."""
    assert [client.call(Call(tool="counter")).value for _ in range(4)] == [1, 1, 1, 1]
    pids = {client.call(Call(tool="whoami")).value["pid"] for _ in range(3)}  # type: ignore[index]
    assert len(pids) == 3


def test_with_reused_workers_module_state_persists_until_the_worker_is_replaced(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client(tools=[FAULTY], reuse_workers=True)
    first = client.call(Call(tool="counter")).value
    assert [client.call(Call(tool="counter")).value for _ in range(3)] == [first + 1, first + 2, first + 3]
    crash = client.call(Call(tool="segfault"))
    assert crash.worker is not None and crash.worker.restarted
    assert [client.call(Call(tool="counter")).value for _ in range(2)] == [1, 2]


def test_stdout_and_stderr_are_captured_per_call(client: ExecutorClient) -> None:
    a = client.call(Call(tool="shout", args=["first"]))
    b = client.call(Call(tool="shout", args=["second"]))
    assert (a.stdout, a.stderr, a.value) == ("first\n", "err:first\n", "first")
    assert (b.stdout, b.stderr) == ("second\n", "err:second\n")
    quiet = client.call(Call(tool="noop"))
    assert (quiet.stdout, quiet.stderr) == ("", "")


def test_output_over_the_cap_is_an_output_limit_even_when_the_tool_returns_at_once(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """The tool has finished writing (and replied) before the supervisor reads the last chunk:
    still ``output_limit``, and ``restarted`` tells the truth about the (reused) worker."""
    client = make_client(tools=[FAULTY], max_output_kb=OUTPUT_KB, reuse_workers=True)
    for _ in range(5):
        before = client.call(Call(tool="whoami"))
        r = client.call(Call(tool="print_then_return", kwargs={"kb": OUTPUT_KB + 8}))
        assert r.error is not None and r.error.kind == "output_limit", r
        assert len(r.stdout) == OUTPUT_KB * 1024
        after = client.call(Call(tool="whoami"))
        assert r.worker is not None
        assert r.worker.restarted is (after.value != before.value)


def test_a_worker_that_closes_its_channel_is_killed_not_leaked(
    executor: LocalExecutor, client: ExecutorClient
) -> None:
    r = client.call(Call(tool="close_channel_then_sleep"), timeout=20)
    assert r.error is not None and r.error.kind == "crashed", r
    assert r.worker is not None and r.worker.restarted
    assert r.stats is not None and r.stats.wall_s < 5
    after = client.call(Call(tool="whoami"))
    assert after.ok
    assert not _alive(r.worker.pid)
    assert_tree_is_supervisor_template_and(executor, None)


def test_signals_raised_by_a_tool_travel_back(client: ExecutorClient) -> None:
    r = client.call(Call(tool="finish", args=["all done"]))
    assert r.ok and r.signals == [Signal(kind="complete", message="all done")]
    assert r.completed is not None and r.completed.message == "all done"
    assert client.call(Call(tool="noop")).signals == [], "signals belong to the call that raised them"


def test_a_tools_own_timeout_applies_and_a_calls_own_timeout_overrides_it(client: ExecutorClient) -> None:
    started = time.monotonic()
    own = client.call(Call(tool="slow_with_own_timeout"))
    assert own.error is not None and own.error.kind == "timeout"
    # counted from its arrival: a call that waited for a worker gets what is left (SPEC, Timeouts)
    assert own.limits is not None and 0.3 < own.limits.timeout_s <= 0.5, own.limits
    assert 0.5 - 0.05 <= time.monotonic() - started < 0.5 + GRACE

    started = time.monotonic()
    override = client.call(Call(tool="slow_with_own_timeout", timeout=1.2))
    assert override.error is not None and override.error.kind == "timeout"
    assert override.limits is not None and 1.0 < override.limits.timeout_s <= 1.2, override.limits
    assert 1.2 - 0.05 <= time.monotonic() - started < 1.2 + GRACE

    longer = client.call(Call(tool="nap", kwargs={"seconds": 0.3}, timeout=0.1))
    assert longer.error is not None and longer.error.kind == "timeout", "a call may also shorten the limit"


def test_a_cancel_for_an_unknown_id_is_ignored(wire: Wire) -> None:
    sock = wire.socket()
    wire.send(sock, Cancel(id="never-sent"))
    assert wire.receive(sock, within=0.2) is None
    wire.ping()


def test_the_cpu_limit_stops_a_busy_tool_before_its_wall_clock_limit(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client(tools=[FAULTY], timeout=10, cpu_s=1)
    started = time.monotonic()
    r = client.call(Call(tool="busy_loop"))
    took = time.monotonic() - started
    assert r.error is not None and r.error.kind == "timeout", r
    assert "CPU" in r.error.message
    assert took < 10, "the CPU limit, not the wall clock, must stop it"
    # What the kernel measured of the worker: about its 1 s allowance. Not at least 1 s exactly: the
    # kernel checks RLIMIT_CPU against its tick-sampled CPU clock (250 Hz here), while wait4 reports the
    # scheduler's precise runtime, which came out 0.956 s in one CI run with the busy loop sharing a core.
    assert r.stats is not None and 0.8 <= r.stats.cpu_s < 3.0, r.stats
    assert r.worker is not None and r.worker.restarted
    assert client.call(Call(tool="counter")).value == 1


def test_the_result_cache_is_bounded_in_bytes_not_only_in_entries(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """Every result is kept a while to answer resent ids; results of megabytes must not pile up in
    the supervisor (4096 entries of 3 MB would be 12 GB)."""
    client = make_client(tools=[FAULTY])
    supervisor = psutil.Process(client.local.proc.pid)  # type: ignore[attr-defined]
    call = Call(tool="huge_string", kwargs={"mb": 3})
    for _ in range(3):
        assert client.call(call).ok
    base = supervisor.memory_info().rss
    for _ in range(200):
        assert client.call(call).ok
    growth_mb = (supervisor.memory_info().rss - base) / 2**20
    assert growth_mb < 300, f"the supervisor grew by {growth_mb:.0f} MB over 600 MB of results"


SCRIBBLES = {
    "not msgpack": b"\xc1\xc1\xc1",
    "not a map": msgpack.packb(5),
    "error not a map": msgpack.packb({"ok": False, "error": "oops"}),
    "unknown error kind": msgpack.packb({"ok": False, "error": {"kind": "meltdown", "message": "x"}}),
    "no ok field": msgpack.packb({"value": 1}),
    "stats of the wrong type": msgpack.packb({"ok": True, "value": 1, "wall_s": "fast"}),
}


@pytest.mark.parametrize("body", list(SCRIBBLES.values()), ids=list(SCRIBBLES))
def test_a_tool_writing_on_the_workers_channel_costs_only_its_worker(
    body: bytes, client: ExecutorClient, wire: Wire
) -> None:
    before = client.call(Call(tool="whoami"))
    r = client.call(Call(tool="scribble_on_channel", args=[body]), timeout=HANG_TIMEOUT)
    assert r.error is not None and r.error.kind == "crashed" and "malformed" in r.error.message, r
    assert r.worker is not None and r.worker.restarted
    wire.ping()
    after = client.call(Call(tool="whoami"))
    assert after.ok and after.value != before.value


@pytest.mark.parametrize("where", ["error", "signal", "stdout", "value"])
def test_text_that_is_not_utf8_comes_back_escaped_without_costing_the_worker(
    where: str, client: ExecutorClient
) -> None:
    """Tools meet surrogate-escaped text whenever a file name is not UTF-8; wherever it ends up in a
    result, the result arrives with it escaped (and the worker survives)."""
    r = client.call(Call(tool="undecodable", args=[where]))
    assert r.worker is not None and not r.worker.restarted, r.error
    shown = {
        "error": r.error.message if r.error else "",
        "signal": r.signals[0].message if r.signals else "",
        "stdout": r.stdout,
        "value": r.value if r.value_is_repr else "",
    }[where]
    assert "name-\\udcff" in shown, r
    if where == "error":
        assert r.error is not None and r.error.kind == "tool_error" and r.error.type == "FileNotFoundError"
    assert client.call(Call(tool="whoami")).ok


@pytest.mark.parametrize("with_seq", [False, True], ids=["forged-blind", "forged-with-seq"])
def test_a_forged_reply_never_answers_another_call(make_client: Callable[..., ExecutorClient], with_seq: bool) -> None:
    client = make_client(timeout=5)
    for _ in range(3):
        forged = client.submit(Call(tool="forge_reply", kwargs={"with_seq": with_seq}))
        other = client.submit(Call(tool="echo", args=["secret"]))
        first, second = forged.result(timeout=30), other.result(timeout=30)
        # The forging call gets its forgery, its real result, or `crashed`; the other call gets its
        # own value or `crashed` (its worker was replaced), never the forging call's result.
        assert first.value in ("forged", "real result of forge") or first.error is not None
        assert second.value == "secret" or (second.error is not None and second.error.kind == "crashed"), second
        assert client.call(Call(tool="echo", args=["after"])).value == "after"


def test_a_fresh_worker_exits_soon_after_its_answer_and_is_replaced(
    make_client: Callable[..., ExecutorClient], executor_pids: Callable[[ExecutorClient], list[int]]
) -> None:
    """A fresh worker exits once it has answered, well before it would be killed for lingering
    (RETIRE_GRACE), and its replacement is forked ahead, whether calls come apart or back to back."""
    from executor.slot import RETIRE_GRACE

    client = make_client(workers=2)
    used = []
    for pause in (0.0, 0.0, 0.0, 0.05, 0.05):
        time.sleep(pause)
        r = client.call(Call(tool="noop"))
        assert r.ok and r.worker is not None, r
        used.append(r.worker.pid)
    assert len(set(used)) == len(used), "a fresh worker ran a second call"
    t0 = time.monotonic()
    while any(_alive(p) for p in used) and time.monotonic() - t0 < RETIRE_GRACE:
        time.sleep(0.01)
    gone_after = time.monotonic() - t0
    assert not any(_alive(p) for p in used), "a worker that answered did not exit"
    assert gone_after < RETIRE_GRACE / 2, f"workers took {gone_after:.2f} s to exit: were they killed for lingering?"
    t0 = time.monotonic()  # supervisor, template and the two workers forked ahead (once exited ones are reaped)
    while len(executor_pids(client)) != 4 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert len(executor_pids(client)) == 4, executor_pids(client)
