"""The calls in flight: one entry per call id, each answered exactly once (at most once on the executor).

A call is in the table from the moment the client's loop takes it until its future is set: by the
executor's answer, its deadline (``timeout``, cancelled on the executor if it was sent), silence
(``unavailable``), a restart of the executor (``unavailable``, unless the tool is idempotent and the
new incarnation takes it over) or closing the client (``cancelled``). A call the executor may hold is
cancelled there whenever the client answers it itself, so that it never runs later unseen. A caller
reusing an id in flight is answered from the same call, never sent twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from controller.client.link import DEADLINE_GRACE
from protocol import Call, Result


@dataclass
class Pending:
    call: Call
    future: Future[Result]
    deadline: float
    sent_incarnation: int | None
    sent: bool = False  # handed to the socket at least once: the executor may have it


class InFlight:
    """The pending-call table of one client; used by whoever runs its loop only. ``cancel(call_id)`` queues a
    cancel for the executor."""

    def __init__(self, cancel: Callable[[str], None]) -> None:
        self._calls: dict[str, Pending] = {}
        self._cancel = cancel

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._calls

    def __iter__(self) -> Iterator[tuple[str, Pending]]:
        """``(call id, entry)`` of every call in flight, in the order they came."""
        return iter(list(self._calls.items()))

    def get(self, call_id: str | None) -> Pending | None:
        return self._calls.get(call_id) if call_id is not None else None

    def join(self, call_id: str, future: Future[Result]) -> bool:
        """If a call of that id is in flight (a caller reused an id), ``future`` gets its result and
        True is returned: the newcomer must not be sent."""
        p = self._calls.get(call_id)
        if p is not None:
            p.future.add_done_callback(_forward_to(future))
        return p is not None

    def add(self, call: Call, future: Future[Result], deadline: float, incarnation: int | None) -> None:
        """Take a call (``call.id`` set, not in flight)."""
        self._calls[call.id or ""] = Pending(call, future, deadline, incarnation)

    def resolve(self, call_id: str, result: Result) -> None:
        p = self._calls.pop(call_id, None)
        if p is not None and not p.future.done():
            p.future.set_result(result)

    def next_deadline(self, grace: float) -> float:
        """The soonest moment a call in flight is due to be answered ``timeout`` (inf if none)."""
        return min((p.deadline + grace for p in self._calls.values()), default=float("inf"))

    def give_up(self, call_id: str, why: str) -> None:
        """Answer one call ``unavailable``, cancelling it on the executor if that may hold it."""
        if self._calls[call_id].sent:
            self._cancel(call_id)
            message = f"{why}; the call may or may not have run (a cancel was sent)"
        else:
            message = f"{why}; the call was never sent"
        self.resolve(call_id, Result.failure(call_id, "unavailable", message))

    def give_up_all(self, why: str) -> None:
        for cid, _ in self:
            self.give_up(cid, why)

    def expire(self, now: float, grace: float, never_heard: str | None) -> None:
        """Answer the calls past their deadline plus ``grace``: ``timeout`` (cancelled on the executor),
        or ``unavailable`` with ``never_heard`` as the reason when nothing ever answered."""
        for cid, p in self:
            if now < p.deadline + grace:
                continue
            if never_heard is not None:
                self.give_up(cid, never_heard)
                continue
            self._cancel(cid)
            self.resolve(cid, Result.failure(
                cid, "timeout",
                f"no answer from the executor within the call's timeout plus {DEADLINE_GRACE:g} s; "
                + ("it was cancelled there" if p.sent else "it was never sent")))

    def adopt(self, incarnation: int) -> None:
        """The first incarnation heard of holds the calls sent before it was known."""
        for p in self._calls.values():
            p.sent_incarnation = incarnation

    def after_restart(self, incarnation: int, idempotent: Callable[[str], bool]) -> list[tuple[str, Pending]]:
        """The executor restarted as ``incarnation``: calls sent to an earlier one may or may not have
        run. Those of idempotent tools are handed to the new one and returned, to be resent; the
        others are answered ``unavailable``."""
        resend = []
        for cid, p in self:
            if p.sent_incarnation == incarnation:
                continue
            if idempotent(p.call.tool):
                p.sent_incarnation = incarnation
                resend.append((cid, p))
            else:
                self.resolve(cid, Result.failure(
                    cid, "unavailable",
                    "the executor restarted while the call was in flight; it may or may not have run, and "
                    "the tool is not idempotent, so it was not resent"))
        return resend

    def close(self) -> None:
        for cid, _ in self:
            self.resolve(cid, Result.failure(cid, "cancelled", "the client was closed"))


def _forward_to(target: Future[Result]) -> Callable[[Future[Result]], None]:
    def forward(source: Future[Result]) -> None:
        if not target.done():
            target.set_result(source.result())

    return forward
