"""At most once, against a real executor (SPEC.md section 8): executed ids are remembered apart from
results, refusals are not remembered, a resend with another body is refused, only a call's own client
may cancel it, and calls a client gives up on are cancelled at the executor. Each test is a finding of
the wire attacker in issue 10."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from controller import ExecutorClient
from controller.client import UNAVAILABLE_AFTER
from executor.calls import CallTable, Job, fingerprint, id_key
from protocol import Call, Cancel, Limits, Ping, Pong, Report, Result, Status, decode, encode
from tests.support.executors import local_of
from tests.support.waiting import wait_for

SLACK = 3.0  # seconds a bound may take on a loaded 2-core machine


def test_unknown_tool_calls_cannot_flush_the_memory_of_a_call_that_ran(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """Before: refusals went into the 4096-entry result cache, so 5,000 unknown-tool calls evicted a
    finished call and its resend ran a second time."""
    client = make_client()
    runs = tmp_path / "runs.log"
    first = Call(id=uuid.uuid4().hex, tool="append_line", kwargs={"path": str(runs)})
    assert client.call(first).value == 1
    flood = dealer(client.endpoint)
    for i in range(5000):
        flood.send_multipart(encode(Call(id=f"flood-{i}", tool="no_such_tool")))
    for _ in range(5000):
        reply = decode(flood.recv_multipart())
        assert isinstance(reply, Result) and reply.error is not None and reply.error.kind == "unknown_tool"
    again = client.call(first)
    assert again.ok and again.value == 1, again
    assert runs.read_text() == "ran\n", "the resent call ran a second time"


def test_a_resend_whose_result_was_evicted_is_refused_not_run_again(
    make_client: Callable[..., ExecutorClient], tmp_path: Path
) -> None:
    """The result cache is bounded in bytes (128 MiB); the executed-id set outlives it."""
    client = make_client()
    runs = tmp_path / "runs.log"
    first = Call(id=uuid.uuid4().hex, tool="append_line", kwargs={"path": str(runs)})
    assert client.call(first).ok
    blob = "x" * (3 * 1024 * 1024)
    for _ in range(48):  # 144 MiB of results from the same client: its oldest result goes first
        assert client.call(Call(tool="echo", args=[blob])).ok
    again = client.call(first)
    assert again.error is not None and again.error.kind == "unavailable", again
    assert "already ran" in again.error.message and "not run again" in again.error.message
    assert runs.read_text() == "ran\n"


def test_a_resend_with_another_body_is_refused_not_answered_with_the_first_result(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client()
    cid = uuid.uuid4().hex
    assert client.call(Call(id=cid, tool="echo", args=["first"])).value == "first"
    other = client.call(Call(id=cid, tool="echo", args=["second"]))
    assert other.error is not None and other.error.kind == "protocol", other
    assert "already used for a different call" in other.error.message
    assert client.call(Call(id=cid, tool="echo", args=["first"])).value == "first"  # a true resend still works


def test_a_refused_call_may_be_corrected_and_resent_under_its_id(make_client: Callable[..., ExecutorClient]) -> None:
    """Before: the bad_arguments refusal was cached, and the corrected resend got it back."""
    client = make_client()
    cid = uuid.uuid4().hex
    wrong = client.call(Call(id=cid, tool="flagged", kwargs={"y": 1}))
    assert wrong.error is not None and wrong.error.kind == "bad_arguments"
    right = client.call(Call(id=cid, tool="flagged", kwargs={"x": 2}))
    assert right.ok, right
    unknown = client.call(Call(id=(cid2 := uuid.uuid4().hex), tool="flaged", kwargs={"x": 2}))
    assert unknown.error is not None and unknown.error.kind == "unknown_tool"
    assert client.call(Call(id=cid2, tool="flagged", kwargs={"x": 3})).ok


def test_only_the_client_that_sent_a_call_can_cancel_it(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    """Before: a cancel was accepted from any client."""
    client = make_client()
    owner = dealer(client.endpoint, routing_id=b"owner-1")
    stranger = dealer(client.endpoint, routing_id=b"stranger")
    cid = uuid.uuid4().hex
    _send_and_sync(owner, Call(id=cid, tool="nap", kwargs={"seconds": 1.5}))
    stranger.send_multipart(encode(Cancel(id=cid)))
    reply = decode(owner.recv_multipart())
    assert isinstance(reply, Result) and reply.ok and reply.value == 1.5, "a stranger's cancel stopped the call"
    cid2 = uuid.uuid4().hex
    _send_and_sync(owner, Call(id=cid2, tool="sleep_forever"))
    owner.send_multipart(encode(Cancel(id=cid2)))
    reply = decode(owner.recv_multipart())
    assert isinstance(reply, Result) and reply.error is not None and reply.error.kind == "cancelled", reply


def _send_and_sync(sock: zmq.Socket[bytes], call: Call) -> None:
    """Send a call, then a ping on the same connection, and wait for the pong: the executor handles a
    connection's messages in order, so the call has been accepted by then."""
    sock.send_multipart(encode(call))
    sock.send_multipart(encode(Ping(nonce=7)))
    assert isinstance(decode(sock.recv_multipart()), Pong)


def _queued(endpoint: str, dealer: Callable[..., zmq.Socket[bytes]]) -> int:
    sock = dealer(endpoint)
    sock.send_multipart(encode(Status()))
    report = decode(sock.recv_multipart())
    assert isinstance(report, Report)
    return report.queued


def test_calls_the_client_gives_up_on_are_cancelled_at_the_executor(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """The executor is frozen past UNAVAILABLE_AFTER: the client answers both calls ``unavailable``
    and cancels them, so once thawed the queued one never runs. Before: no cancel was sent and the
    queued call ran later, unseen."""
    client = make_client(workers=1, log_level="debug")  # each answered call is logged (at debug)
    local = local_of(client)
    assert local.proc is not None
    started = tmp_path / "started.log"
    queued = tmp_path / "queued.log"
    running = client.submit(Call(tool="append_line", kwargs={"path": str(started), "then_sleep": 30}), timeout=60)
    wait_for(started.exists, 10, "the first call started")
    waiting = client.submit(Call(tool="append_line", kwargs={"path": str(queued)}), timeout=60)
    wait_for(lambda: _queued(client.endpoint, dealer) == 1, 10, "the second call is in the executor's queue")
    os.kill(local.proc.pid, signal.SIGSTOP)
    try:
        results = [f.result(timeout=UNAVAILABLE_AFTER + SLACK + 5) for f in (running, waiting)]
    finally:
        os.kill(local.proc.pid, signal.SIGCONT)
    for r in results:
        assert r.error is not None and r.error.kind == "unavailable", r
        assert "may or may not have run" in r.error.message and "cancel" in r.error.message
    wait_for(lambda: local.log_path.read_text().count(": cancelled") >= 2, 15, "both calls cancelled at the executor")
    assert not queued.exists(), "a call the client gave up on ran anyway"
    # The client took the executor for dead and answers at once while it hears nothing: the thawed
    # executor (killing the cancelled call's worker, forking another) may take a moment to be heard.
    wait_for(lambda: client.alive, 10, "the client hears the thawed executor again")
    assert client.call(Call(tool="echo", args=[1]), timeout=10).value == 1


@pytest.mark.parametrize("n", [3000])
def test_a_burst_of_submits_is_all_sent_and_all_answered(make_client: Callable[..., ExecutorClient], n: int) -> None:
    """Before: sends past the DEALER's high-water mark raised zmq.Again, which the client swallowed:
    the calls were never sent and were answered ``timeout`` (or ran and were answered ``timeout``)."""
    client = make_client(workers=2, max_queue=64)
    futures = [client.submit(Call(tool="noop"), timeout=120) for _ in range(n)]
    results = [f.result(timeout=180) for f in futures]
    kinds = {r.error.kind if r.error else "ok" for r in results}
    assert kinds <= {"ok", "unavailable"}, kinds
    assert sum(r.ok for r in results) >= 64


# ------------------------------------------------------------------ the call table's own bounds


def _job(cid: str, tool: str = "noop") -> Job:
    call = Call(id=cid, tool=tool)
    size, digest = fingerprint(call)
    return Job(call=call, call_id=cid, waiters=[b"r"], limits=Limits(), nbytes=size, digest=digest)


def test_the_executed_id_set_is_bounded_by_count_and_age_and_running_calls_stay_joinable() -> None:
    table = CallTable(max_queue=100, max_executed=3, executed_ttl=60.0)
    jobs = [_job(f"id-{i}") for i in range(5)]
    now = time.monotonic()
    for job in jobs:
        assert table.admit(job, now) is None
    assert len(table.executed) == 3
    # id-0 left the executed set, but it is still queued: a resend joins it, never a second copy.
    seen = table.seen(b"other", jobs[0].call, jobs[0].digest)
    assert seen is not None and seen.joined and b"other" in jobs[0].waiters
    for job in jobs:
        assert table.next_queued() is job
        table.done(job)
        table.remember(job.call_id, [b"answer"], b"r")
    late = _job("id-9")
    assert table.admit(late, now + 61) is None  # a minute later: all but the newest have aged out
    assert list(table.executed) == [id_key("id-9")]
    assert table.seen(b"r", _job("id-9", tool="other").call, _job("id-9", tool="other").digest) is not None


def test_the_result_cache_evicts_the_heaviest_client_first() -> None:
    table = CallTable(max_queue=10, cache_bytes=100)
    table.remember("a-1", [b"x" * 30], b"alice")
    for i in range(3):
        table.remember(f"m-{i}", [b"x" * 30], b"mallory")
    assert "a-1" in table.cache and "m-0" not in table.cache and table.cache_bytes <= 100
