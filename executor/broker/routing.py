"""Which member runs a call, and how long the broker waits for it. Calls wait in one fair queue
(``executor.fairqueue``: one line per client, served in turn), bounded in calls and encoded bytes, in
all and per client. A free worker takes the next call in turn whose tool it has, on the least loaded
executor, never one that already tried the call, and none at all during the recovery window after a
start. A resent id goes back to the executor that announced it holds it (``Locations``), or to the
one the journal says an earlier run sent it to. Each call's deadline is the broker's: a call not
answered by its timeout (at most ``--max-timeout``) plus ``RESULT_GRACE`` is answered ``timeout``
here; an executor that says it is applying a call's writes gets, once, its apply grace, at most the
broker's. The calls of an executor that is gone run once more elsewhere if their tool is idempotent,
and are answered otherwise.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Literal

from executor.broker.answers import Answers
from executor.broker.journal import Journal
from executor.broker.members import Members
from executor.broker.records import Job, Member
from executor.broker.sockets import Sockets, frames_of
from executor.calls import MAX_QUEUE_BYTES
from executor.fairqueue import FairQueue
from protocol import Call, Cancel, Result, ToolSpec
from protocol.messages import MAX_TIMEOUT_S, requested_timeout
from protocol.timing import APPLY_GRACE, RECOVERY_WINDOW, RESULT_GRACE

log = logging.getLogger("ciayn-broker")

LOCATION_TTL = 120.0  # how long an announced held id routes a resent call to its executor
MAX_LOCATIONS = 262_144
CLIENT_SHARE = 4  # one client may fill at most 1/CLIENT_SHARE of the queue's bytes


class Locations:
    """Which executor announced (in its ``ready``) that it holds which call id, for ``LOCATION_TTL``.
    When the table is full, the oldest entry of the executor holding the most goes: one executor
    announcing floods of ids evicts its own entries, never where another executor's calls are (a
    resend would then run elsewhere too)."""

    def __init__(self, limit: int = MAX_LOCATIONS) -> None:
        self.limit = limit
        self.where: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self.held_by: dict[str, collections.OrderedDict[str, None]] = {}  # executor -> its ids in ``where``

    def add(self, cid: str, executor: str, expiry: float) -> None:
        self.pop(cid)
        self.where[cid] = (executor, expiry)
        self.held_by.setdefault(executor, collections.OrderedDict())[cid] = None
        while len(self.where) > self.limit:
            most = max(self.held_by.values(), key=len)
            self.pop(next(iter(most)))

    def of(self, cid: str) -> str | None:
        """The executor that holds ``cid``, if one announced it."""
        where = self.where.get(cid)
        return where[0] if where is not None else None

    def pop(self, cid: str) -> str | None:
        """Forget where ``cid`` is; return the executor that held it, if one did."""
        where = self.where.pop(cid, None)
        if where is None:
            return None
        ids = self.held_by[where[0]]
        del ids[cid]
        if not ids:
            del self.held_by[where[0]]
        return where[0]

    def expire(self, now: float) -> None:
        while self.where and next(iter(self.where.values()))[1] < now:
            self.pop(next(iter(self.where)))


class Router:
    """The queue of calls waiting for an executor, and every call's way to one and back."""

    def __init__(self, members: Members, answers: Answers, sockets: Sockets, *, max_queue: int = 65536,
                 max_queue_per_client: int = 16384, max_queue_bytes: int = MAX_QUEUE_BYTES,
                 recovery_s: float = RECOVERY_WINDOW, apply_grace: float = APPLY_GRACE,
                 max_timeout: float = MAX_TIMEOUT_S) -> None:
        self.members = members
        self.answers = answers
        self.sockets = sockets
        self.max_queue = max_queue
        self.max_queue_per_client = max_queue_per_client
        self.max_queue_bytes = max_queue_bytes
        self.apply_grace = apply_grace  # the most a call's answer may come after its deadline for its writes
        self.max_timeout = max_timeout  # a ceiling on every call's timeout in the pool (--max-timeout)
        self.recovering = recovery_s > 0  # while true no call is sent anywhere new (docs/pool.md)
        self.waiting: FairQueue[Job] = FairQueue()
        self.locations = Locations()
        self.journal: Journal | None = None

    # ---------------------------------------------------------------- arrival

    def queue_full(self, client: bytes, nbytes: int) -> str:
        """Why a call of ``nbytes`` from ``client`` does not fit in the queue ("" if it does): bounded in
        calls and in encoded bytes, in all and per client (so that one client's flood leaves room for
        the others' calls)."""
        q, mib = self.waiting, 1024**2
        if len(q) >= self.max_queue:
            return f"{len(q)} calls waiting"
        if q.of(client) >= self.max_queue_per_client:
            return f"this client has {q.of(client)} calls waiting, its most"
        if q.bytes + nbytes > self.max_queue_bytes:
            return (f"{q.bytes / mib:.1f} MiB waiting, {nbytes / mib:.1f} MiB more would pass its "
                    f"{self.max_queue_bytes // mib} MiB")
        share = self.max_queue_bytes // CLIENT_SHARE
        if q.bytes_of(client) and q.bytes_of(client) + nbytes > share:  # one call always fits
            return (f"this client has {q.bytes_of(client) / mib:.1f} MiB waiting, {nbytes / mib:.1f} MiB more "
                    f"would pass its share, {share / mib:g} MiB")
        return ""

    def accept(self, route: bytes, call: Call, nbytes: int, digest: int) -> Result | None:
        """A new call from ``route`` (``executor.calls.fingerprint`` gave ``nbytes`` and ``digest``):
        accepted, recorded as run and placed; or the refusal to answer (an unknown tool, a full queue).
        Its arguments are bound by the executor, which answers ``bad_arguments``."""
        cid = call.id or ""
        spec = self.members.specs.get(call.tool)
        if spec is None and self.members.by_route and not self.recovering:
            names = ", ".join(sorted(self.members.specs))
            return Result.failure(cid, "unknown_tool", f"no tool named {call.tool!r} in the pool; available: {names}")
        if full := self.queue_full(route, nbytes):
            return Result.failure(cid, "unavailable", f"the broker's queue is full ({full}); the call did not run")
        now = time.monotonic()
        job = Job(call=call, frames=frames_of(call), digest=digest, nbytes=nbytes, client=route, waiters=[route],
                  spec=spec, timeout=self.timeout(call, spec), queued_at=now)
        self.answers.admit(job, now)
        self.place(job)
        return None

    def place(self, job: Job) -> None:
        """A call just accepted: to the executor that holds its id (it answers from its cache or joins
        the call), else where an earlier run sent it (``earlier_run``), else into the queue."""
        held_by = self.locations.pop(job.call_id)
        member = self.members.by_id(held_by) if held_by is not None else None
        if member is not None:
            self.send(job, member)
        elif self.recovering or not self.place_earlier(job):
            self.waiting.push(job)

    def earlier_run(self, job: Job) -> Member | Result | None:
        """For a call an earlier run of the broker sent to an executor (the journal says so): that
        executor, if it is back (it knows the id); else, unless the tool is idempotent, the answer that
        it may have run. None: a call like any other."""
        executor = self.journal.previous.get(job.call_id) if self.journal is not None else None
        if executor is None:
            return None
        member = self.members.by_id(executor)
        if member is not None:
            return member
        if job.spec is not None and job.spec.idempotent:
            return None
        return Result.failure(job.call_id, "unavailable", f"before the broker restarted it sent this call to "
                              f"executor {executor}, which has not come back: the call may have run, so it was not "
                              "run again")

    def place_earlier(self, job: Job) -> bool:
        """Act on ``earlier_run``; True if the call was sent or answered."""
        outcome = self.earlier_run(job)
        if isinstance(outcome, Member):
            self.send(job, outcome)
        elif isinstance(outcome, Result):
            self.answers.finish(job, outcome)
        return outcome is not None

    def end_recovery(self) -> None:
        """The recovery window is over: calls wait for any executor, and those an earlier run sent
        (the journal) are placed."""
        self.recovering = False
        log.info("recovery window over: %d executors, %d tools", len(self.members.by_route), len(self.members.specs))
        self.adopt_specs(final=True)
        for job in list(self.waiting):
            if self.earlier_run(job) is not None:
                self.waiting.remove(job)
                self.place_earlier(job)
        self.dispatch()

    def adopt_specs(self, final: bool) -> None:
        """Queued calls whose tool no executor had announced (while recovering, or while the pool was
        empty) are checked once it is known; when ``final``, an unknown tool is ``unknown_tool``."""
        for job in [j for j in self.waiting if j.spec is None]:
            spec = self.members.specs.get(job.call.tool)
            if spec is not None:
                job.spec = spec
                job.timeout = self.timeout(job.call, spec)
            elif final and self.members.by_route:
                names = ", ".join(sorted(self.members.specs))
                self.waiting.remove(job)
                self.answers.finish(job, Result.failure(
                    job.call_id, "unknown_tool", f"no tool named {job.call.tool!r} in the pool; available: {names}"),
                    ran=False)

    def cancel(self, job: Job) -> None:
        """A client cancels ``job``: answered at once if it is still queued, else its executor is told."""
        if job.member is None:
            self.waiting.remove(job)
            self.answers.finish(job, Result.failure(job.call_id, "cancelled", "the call was cancelled before it ran"))
        else:
            self.sockets.to_executor(job.member.route, Cancel(id=job.call_id))

    # ---------------------------------------------------------------- timeouts

    def timeout(self, call: Call, spec: ToolSpec | None) -> float:
        """How long a call may wait in the queue: the timeout it asks for, at most the ceiling."""
        return min(requested_timeout(self.members.default_timeout(), spec, call), self.ceiling(call))

    def ceiling(self, call: Call) -> float:
        """The broker's --max-timeout, or the call's own ``max_timeout`` if that is less."""
        return min(self.max_timeout, call.max_timeout or MAX_TIMEOUT_S)

    def timeout_on(self, job: Job, member: Member) -> float:
        """The timeout ``member`` applies to ``job``: the call's, else the tool's, else its default
        (``protocol.messages.requested_timeout``), at most its own ceiling and the broker's,
        whatever it announced (``frames_for`` tells it the broker's)."""
        asked = requested_timeout(member.ready.limits.timeout_s, job.spec, job.call)
        return min(asked, member.ready.max_timeout_s, self.ceiling(job.call))

    def frames_for(self, job: Job, member: Member) -> list[bytes]:
        """The call as ``member`` is sent it: as the client sent it, unless the timeout it would run
        under on its own is over the broker's ceiling; then with that ceiling as its ``max_timeout``,
        which is not part of what makes the call that call (section 8): a resend of its id still
        matches, also one sent on by a broker restarted with another ceiling."""
        own = min(requested_timeout(member.ready.limits.timeout_s, job.spec, job.call), member.ready.max_timeout_s)
        if own <= self.ceiling(job.call):
            return job.frames
        return frames_of(job.call.model_copy(update={"max_timeout": self.ceiling(job.call)}))

    # ---------------------------------------------------------------- sending

    def dispatch(self) -> None:
        """Free workers take waiting calls, clients in turn (``executor.fairqueue``)."""
        while self.waiting and any(m.free > 0 for m in self.members.by_route.values()):
            taken = self.waiting.take(self.pick)
            if taken is None:
                return
            self.send(*taken)

    def pick(self, job: Job) -> Member | None:
        """The least loaded executor with the tool, a free worker, and that did not try this call."""
        if job.spec is None or self.recovering:
            return None
        best: Member | None = None
        for m in self.members.by_route.values():
            if m.free <= 0 or m.id in job.tried or job.spec.name not in m.tool_names:
                continue
            if best is None or len(m.running) * best.capacity < len(best.running) * m.capacity:
                best = m
        return best

    def send(self, job: Job, member: Member) -> None:
        job.member = member
        job.sent_at = time.monotonic()
        job.run_timeout = self.timeout_on(job, member)
        job.deadline, job.granted = job.sent_at + job.run_timeout + RESULT_GRACE, 0.0
        if member.id not in job.tried:
            job.tried.append(member.id)
        member.running[job.call_id] = job
        if self.journal is not None:
            self.journal.record(job.call_id, member.id)
        self.sockets.to_executor(member.route, self.frames_for(job, member))

    def answered(self, member: Member, result: Result) -> None:
        """``member`` answered a call: the answer goes to its waiters, unless it was not running it."""
        job = self.answers.jobs.get(result.id)
        if job is None or job.member is not member:
            log.debug("executor %s answered call %s, which it was not running; ignored", member.id, result.id)
            return
        del member.running[result.id]
        wall = result.stats.wall_s if result.stats else time.monotonic() - job.sent_at
        member.stats.observe(job.call.tool, result, wall)
        self.answers.finish(job, result)

    def joined(self, member: Member, moved: list[Job], now: float) -> None:
        """``member`` just joined: the calls it took over from its old connection are sent to it again
        (it joins the running call or answers from its cache), the ids it holds route their resends
        to it, and queued calls it holds (resent by clients while we recovered) go to it."""
        for job in moved:
            self.sockets.to_executor(member.route, self.frames_for(job, member))
        for cid in member.ready.held:
            self.locations.add(cid, member.id, now + LOCATION_TTL)
        for job in [j for j in self.waiting if self.locations.of(j.call_id) == member.id]:
            self.waiting.remove(job)
            self.locations.pop(job.call_id)
            self.send(job, member)
        self.adopt_specs(final=not self.recovering)
        if member.ready.limits.timeout_s > self.max_timeout:
            log.info("executor %r: its default timeout of %g s is cut to the broker's --max-timeout, %g s",
                     member.id, member.ready.limits.timeout_s, self.max_timeout)

    def lost(self, member: Member, kind: Literal["crashed", "unavailable"], why: str) -> None:
        """``member`` is gone: its idempotent calls go back to the queue to run elsewhere (once), the
        others are answered ``kind``, saying they may have run."""
        for cid, job in member.running.items():
            job.member = None
            if job.spec is not None and job.spec.idempotent and len(job.tried) < 2:
                self.waiting.push(job, first=True)
                log.info("call %s %s: idempotent, re-run on another executor", cid, job.call.tool)
                continue
            self.answers.finish(job, Result.failure(cid, kind, f"executor {member.id} {why} while running the "
                                                    "call; the call may have run"))
        member.running = {}

    # ---------------------------------------------------------------- deadlines

    def expire_queued(self, now: float) -> None:
        """A call that waited in the queue for its whole timeout is answered: it did not run."""
        for job in self.waiting.expire(now):
            why = (f"no executor with the tool {job.call.tool!r} had a free worker"
                   if self.members.by_route else "no executor is connected to the broker")
            self.answers.finish(job, Result.failure(job.call_id, "unavailable",
                                                    f"{why} for {job.timeout:g} s; the call did not run"), ran=False)

    def expire_running(self, now: float) -> None:
        """A call its executor has not answered by its deadline is answered here, whatever the
        executor announced: ``timeout``, and the executor is asked to cancel it."""
        for member in list(self.members.by_route.values()):
            for cid, job in list(member.running.items()):
                if now < job.deadline:
                    continue
                del member.running[cid]
                self.sockets.to_executor(member.route, Cancel(id=cid))
                applied = (f" and the {job.granted:g} s it was given to apply the call's workspace writes"
                           if job.granted else "")
                log.warning("call %s %s: executor %r did not answer in time; answered timeout", cid,
                            job.call.tool[:64], member.id)
                self.answers.finish(job, Result.failure(
                    cid, "timeout", f"executor {member.id!r} did not answer within the call's timeout "
                    f"({job.run_timeout:g} s) plus {RESULT_GRACE:g} s{applied}; the broker stopped waiting and "
                    "asked it to cancel the call, which may have run (partly or wholly)"))

    def grant_apply(self, member: Member, ids: list[str], now: float) -> None:
        """The executor says these calls answered in time and their workspace writes are being
        applied: wait for each, once, its apply grace, at most the broker's own ``apply_grace``."""
        grace = min(member.ready.apply_grace_s, self.apply_grace)
        if grace <= 0:
            return
        for cid in ids:
            job = member.running.get(cid)
            if job is not None and not job.granted:
                job.granted = grace
                job.deadline = max(job.deadline, now + grace + RESULT_GRACE)
