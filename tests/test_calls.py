"""The at-most-once memory both the executor's call table and the broker use (executor.calls)."""

from __future__ import annotations

from executor.calls import ANY_DIGEST, AtMostOnce, fingerprint, join
from protocol import Call


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
