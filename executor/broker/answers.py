"""The calls the broker accepted and has not answered (by id), and what answers a resent id once its
call is answered: the executor's own at-most-once memory (``executor.calls.AtMostOnce``: the ids
accepted, apart from a result cache bounded in bytes and fair per client). A resent id joins the
call in flight, is answered from that cache, or, once its answer is gone, is told it ran: no id the
broker has seen is ever sent to a second executor. Refusals (unknown tool, a full queue) are not
remembered, so that a corrected call may reuse its id (SPEC.md section 8).
"""

from __future__ import annotations

import time

from executor.broker.records import Job
from executor.broker.sockets import Sockets, frames_of
from executor.calls import RESULT_CACHE_BYTES, AtMostOnce, Seen, join
from executor.metrics import CallStats
from protocol import Call, Result


class Answers:
    """Calls in flight (``jobs``), the at-most-once memory (``calls``) and the figures of answered calls."""

    def __init__(self, sockets: Sockets, broker_id: str, *, cache_bytes: int = RESULT_CACHE_BYTES) -> None:
        self.sockets = sockets
        self.broker_id = broker_id
        self.jobs: dict[str, Job] = {}
        self.calls = AtMostOnce(cache_bytes=cache_bytes)  # the ids accepted, and recent answers
        self.stats = CallStats()

    def seen(self, route: bytes, call: Call, digest: int) -> Seen | None:
        """None for an id never accepted (or forgotten); otherwise what to answer its resend."""
        cid = call.id or ""
        job = self.jobs.get(cid)
        if job is not None:
            return join(cid, job.waiters, job.digest, route, digest)
        return self.calls.answer(cid, digest)

    def admit(self, job: Job, now: float) -> None:
        """``job`` is accepted: its id is recorded as run (a resend never runs it again)."""
        self.jobs[job.call_id] = job
        self.calls.record(job.call_id, job.digest, now)

    def finish(self, job: Job, result: Result, frames: list[bytes] | None = None, *, ran: bool = True) -> None:
        """Answer everyone waiting for ``job``. Unless it surely did not run (``ran=False``: refused, or
        it waited in the queue for its whole timeout; its id may then be sent again, SPEC section 8),
        the answer is kept for a resend of its id."""
        cid = job.call_id
        self.jobs.pop(cid, None)
        if frames is None:
            frames = frames_of(result)
        if job.spec is not None:
            self.stats.observe(job.call.tool, result, time.monotonic() - job.queued_at)
        else:
            self.stats.served += 1
        if ran:
            self.calls.remember(cid, frames, job.client)
        else:
            self.calls.unrecord(cid)
        for route in job.waiters:
            self.sockets.to_client(route, frames)

    def refuse(self, route: bytes, result: Result) -> None:
        """A refusal (unknown tool, bad arguments, a full queue): not remembered, so that a corrected
        call may reuse its id (SPEC section 8)."""
        result.executor = self.broker_id
        self.sockets.to_client(route, result)
