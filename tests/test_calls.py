"""The at-most-once memory both the executor's call table and the broker use (executor.calls)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.calls import ANY_DIGEST, START_MARGIN, AtMostOnce, CallTable, Job, fingerprint, join
from protocol import Call, Limits


def _digest(call: Call) -> int:
    return fingerprint(call)[1]


def test_a_resend_is_answered_from_the_cache_then_told_it_ran_never_forgotten_as_new() -> None:
    ran = AtMostOnce(cache_bytes=100)
    first, second = Call(id="a", tool="t", args=[1]), Call(id="b", tool="t", args=[2])
    for call in (first, second):
        ran.record(call.id or "", _digest(call), now=0.0)
    ran.remember("a", [b"x" * 60], b"client")
    seen = ran.answer("a", _digest(first))
    assert seen is not None and seen.frames == [b"x" * 60]
    ran.remember("b", [b"y" * 60], b"client")  # over 100 bytes: the client's oldest answer goes
    gone = ran.answer("a", _digest(first))
    assert gone is not None and gone.frames is None and gone.refusal is not None
    assert gone.refusal.error is not None and gone.refusal.error.kind == "unavailable"
    assert "already ran" in gone.refusal.error.message and "not run again" in gone.refusal.error.message
    assert ran.answer("never-sent", 0) is None


def test_another_call_under_a_used_id_is_refused_unless_the_first_call_is_unknown() -> None:
    ran = AtMostOnce()
    call = Call(id="a", tool="t", args=[1])
    other = Call(id="a", tool="t", args=[2])
    ran.record("a", _digest(call), now=0.0)
    refused = ran.answer("a", _digest(other))
    assert refused is not None and refused.refusal is not None and refused.refusal.error is not None
    assert refused.refusal.error.kind == "protocol" and "already used for a different call" in \
        refused.refusal.error.message
    ran.record("r", ANY_DIGEST, now=0.0)  # a result that reached a restarted broker: its call is unknown
    ran.remember("r", [b"answer"], b"")
    seen = ran.answer("r", _digest(other))
    assert seen is not None and seen.frames == [b"answer"]


def test_an_id_that_did_not_run_after_all_is_forgotten() -> None:
    ran = AtMostOnce()
    ran.record("a", 7, now=0.0)
    ran.unrecord("a")
    assert ran.answer("a", 7) is None


def test_a_resend_of_a_call_in_flight_joins_it_once_and_another_call_under_its_id_is_refused() -> None:
    waiters = [b"first"]
    for route in (b"second", b"second", b"first"):
        assert join("a", waiters, 5, route, 5).joined
    assert waiters == [b"first", b"second"]
    refused = join("a", waiters, 5, b"third", 6)
    assert not refused.joined and refused.refusal is not None and waiters == [b"first", b"second"]



def test_queued_calls_expire_at_their_own_bound_though_the_queue_is_not_scanned_on_every_turn() -> None:
    """The supervisor's loop asks ``expire`` on every turn, which does not scan the queue until a call
    can be due; each call still runs out at its own bound (its timeout or ``max_wait``), one queued
    after a scan or put back by ``requeue`` too."""
    table = CallTable(16, max_wait=5.0)
    t0 = time.monotonic()

    def admit(cid: str, timeout: float, now: float) -> Job:
        job = Job(call=Call(id=cid, tool="noop"), call_id=cid, waiters=[b"c"], limits=Limits(timeout_s=timeout))
        assert table.admit(job, now) is None
        return job

    def expired() -> list[str]:
        return [job.call_id for job, _ in table.take_expired()]

    admit("slow", 60.0, t0)  # bound: max_wait, due at t0 + 5
    admit("quick", 1.0, t0 + 0.5)  # bound: its timeout, due at t0 + 1.5 less the start margin
    assert table.expire(t0 + 0.6) == pytest.approx(0.9 - START_MARGIN) and not expired()
    assert table.expire(t0 + 1.5) == pytest.approx(3.5)
    [(job, answer)] = table.take_expired()
    assert job.call_id == "quick" and answer.error is not None and answer.error.kind == "unavailable"
    admit("late", 0.2, t0 + 2.0)  # queued after the scan: due before "slow"
    assert table.expire(t0 + 2.3) == pytest.approx(2.7) and expired() == ["late"]
    again = admit("again", 0.5, t0 + 2.5)
    table.queue.remove(again)  # given to a worker (as next_queued does)...
    table.requeue(again)  # its worker died before it started: back at the head, arrived anew
    assert table.expire(again.arrived + 0.6) > 0 and expired() == ["again"]
    assert [job.call_id for job in table.queue] == ["slow"]
    assert table.expire(t0 + 5.0) == math.inf and expired() == ["slow"]


def test_a_queued_call_with_almost_none_of_its_timeout_left_is_not_started_but_answered_did_not_run() -> None:
    """A worker that frees just before a queued call's timeout runs out must not be given it: the
    call would be killed at once and answered ``timeout`` as if it had run. Within the start margin
    (50 ms, or a tenth of a short timeout) it is answered ``unavailable`` and its id forgotten."""
    table = CallTable(16)
    now = time.monotonic()
    for cid, timeout, waited in (("late", 2.0, 2.0 - START_MARGIN / 2), ("short", 0.1, 0.095),
                                 ("in-time", 2.0, 2.0 - 2 * START_MARGIN)):
        job = Job(call=Call(id=cid, tool="noop"), call_id=cid, waiters=[b"c"], limits=Limits(timeout_s=timeout))
        assert table.admit(job, now - waited) is None
    started = table.next_queued()
    assert started is not None and started.call_id == "in-time"
    assert started.limits.timeout_s == pytest.approx(2 * START_MARGIN, abs=0.01)
    expired = {job.call_id: answer for job, answer in table.take_expired()}
    assert sorted(expired) == ["late", "short"]
    for answer in expired.values():
        assert answer.error is not None and answer.error.kind == "unavailable"
        assert "did not run" in answer.error.message
    assert table.ran.answer("late", 0) is None, "an id that did not run must be free to send again"


def test_digests_are_keyed_per_process_not_by_pythonhashseed() -> None:
    """Two executors (or brokers) started under the same known PYTHONHASHSEED digest one call
    differently: no one can look for two calls under one id whose digests collide offline. Before,
    the digest was 48 bits of hash(), the same in every process under one seed."""
    probe = ("from executor.calls import fingerprint; from protocol import Call; "
             "print(fingerprint(Call(id='x', tool='t', kwargs={'a': 1}))[1])")
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(Path(__file__).parent.parent)}
    digests = {subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                              timeout=60).stdout for _ in range(2)}
    assert len(digests) == 2, digests
