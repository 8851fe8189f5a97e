"""The call table (``CallTable``): every call an executor has accepted, from arrival to answer, and
the ids it ran. It owns the at-most-once rule (SPEC.md section 8): an id accepted to run is never run
again, even after its result was evicted; a resend is answered from the cache, joins the call, or is
told it ran, and one whose body differs is refused (``AtMostOnce``, which the broker reuses). A
refusal enters nothing. It owns the queue of calls waiting for a worker, bounded in calls, bytes and
wait; a call's timeout counts from its arrival. It knows nothing of sockets or workers.
Why and how: docs/executor.md#the-call-table.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import time
from dataclasses import dataclass, field

from executor.fairqueue import FairQueue
from protocol import Call, Limits, Result
from protocol.fingerprint import resend_key

RESULT_CACHE_BYTES = 128 * 1024 * 1024  # encoded results kept to answer resent ids
MAX_EXECUTED_IDS = 1_000_000  # ids remembered as run (about 120 bytes each)...
EXECUTED_ID_TTL = 24 * 3600.0  # ...and for at least this long, unless the count bound is reached first
MAX_QUEUE_BYTES = 1024 * 1024 * 1024  # default --max-queue-mb: encoded arguments of queued calls
MAX_QUEUE_WAIT = 600.0  # default --max-queue-wait, seconds
# A queued call is not started with less than this much of its timeout left (a tenth of the timeout
# if that is less): it would be killed before doing anything, answered `timeout` as if it had run.
# It is answered `unavailable` ("did not run") instead, and its id may be sent again.
START_MARGIN = 0.05


@dataclass
class Job:
    """One accepted call: who waits for it, its limits, and what happened to it so far."""

    call: Call
    call_id: str
    waiters: list[bytes]
    limits: Limits
    arrived: float = 0.0
    nbytes: int = 0  # encoded bytes of its tool, arguments and timeout: what the queue's bounds count
    digest: int = 0  # 48 bits of a hash of the same: a resend must match it
    started: float = 0.0
    deadline: float = 0.0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    outcome: Result | None = None  # decided by the supervisor (timeout, cancel, output cap)
    asked_s: float = field(init=False)  # its timeout as asked; ``limits.timeout_s`` is what is left of it

    def __post_init__(self) -> None:
        self.asked_s = self.limits.timeout_s

    # what the queue (``executor.fairqueue.Queued``) sees of a call, named as the broker's job names it
    @property
    def client(self) -> bytes:
        return self.waiters[0]  # who sent it first: its turn in the queue is that client's

    @property
    def queued_at(self) -> float:
        return self.arrived

    @property
    def timeout(self) -> float:
        return self.limits.timeout_s


@dataclass
class Seen:
    """What to do with a call whose id was seen before: send ``frames`` (the cached answer), send
    ``refusal``, or nothing (it ``joined`` the call still queued or running)."""

    frames: list[bytes] | None = None
    refusal: Result | None = None
    joined: bool = False


@dataclass
class _Cached:
    frames: list[bytes]
    owner: bytes
    size: int


def _any_worker(job: Job) -> bool:
    return True  # any of the executor's workers runs any of its tools


def fingerprint(call: Call) -> tuple[int, int]:
    """(``nbytes``, ``digest``): the encoded size and a 48-bit digest of what makes a call that call:
    tool, arguments and timeout, written canonically (``protocol.fingerprint.resend_key``: key order
    and how a number was encoded do not matter, its type does), so that a resend matches however its
    sender wrote it."""
    packed = resend_key(call)
    return len(packed), _keyed(packed) & _DIGEST_MASK


def _digest48(digest: int) -> int:
    return digest & _DIGEST_MASK


# Digests of call bodies and ids are keyed with a secret drawn at start, not Python's hash(): that
# one is keyed by PYTHONHASHSEED, which a process may inherit (a broker started by a tool that sets
# it, such as tox): under a known seed, two calls under one id whose digests collide cost about 2**24
# hashes offline, and the second would be answered with the first's result.
_KEY = os.urandom(16)
_DIGEST_MASK = 0xFFFF_FFFF_FFFF


def _keyed(data: bytes) -> int:
    """64 bits of a BLAKE2b keyed with this process's secret."""
    return int.from_bytes(hashlib.blake2b(data, key=_KEY, digest_size=8).digest(), "big")


def id_key(cid: str) -> int:
    """What the executed-id set holds for ``cid``."""
    return _keyed(cid.encode())


ANY_DIGEST = 1 << 48  # recorded for an id whose call is unknown (a result that reached a restarted broker)


def _reused(cid: str) -> Result:
    return Result.failure(cid, "protocol", "this id was already used for a different call (another tool, other "
                          "arguments or another timeout); call ids must be unique: use a fresh one")


def join(cid: str, waiters: list[bytes], digest: int, route: bytes, resent_digest: int) -> Seen:
    """A resend of a call still queued or running: ``route`` joins its ``waiters``, unless the resend
    is another call under the same id."""
    if digest != _digest48(resent_digest):
        return Seen(refusal=_reused(cid))
    if route not in waiters:
        waiters.append(route)
    return Seen(joined=True)


class AtMostOnce:
    """The ids accepted to run and the encoded answers of finished calls: what answers a resent id
    once its call is no longer in flight. Both bounded: ids by count and age, answers in bytes, fair
    per client (SPEC.md section 8)."""

    def __init__(self, *, cache_bytes: int = RESULT_CACHE_BYTES, max_executed: int = MAX_EXECUTED_IDS,
                 executed_ttl: float = EXECUTED_ID_TTL) -> None:
        self.cache_limit = cache_bytes
        self.max_executed = max_executed
        self.executed_ttl = executed_ttl
        self.executed: dict[int, int] = {}  # id_key(id) -> digest48 << 32 | accepted at (s); oldest first
        self.cache: dict[str, _Cached] = {}  # id -> answer; oldest first
        self.cache_bytes = 0
        self.owner_bytes: collections.Counter[bytes] = collections.Counter()
        self.by_owner: dict[bytes, collections.OrderedDict[str, None]] = {}

    def answer(self, cid: str, digest: int) -> Seen | None:
        """None for an id never accepted (or forgotten); otherwise what to answer its resend: the
        cached answer, or a refusal (another call under that id; or it ran and its answer is gone)."""
        ran = self.executed.get(id_key(cid))
        if ran is None:
            return None
        if ran >> 32 not in (_digest48(digest), ANY_DIGEST):
            return Seen(refusal=_reused(cid))
        cached = self.cache.get(cid)
        if cached is not None:
            return Seen(frames=cached.frames)
        return Seen(refusal=Result.failure(
            cid, "unavailable", "this call already ran and its result is no longer held here (the result cache "
            "is bounded); it was not run again"))

    def record(self, cid: str, digest: int, now: float) -> None:
        """Remember ``cid`` as run: keyed by ``id_key`` (64 bits keyed with this process's secret, which
        no client can aim at), valued by 48 bits of the call's digest (or ``ANY_DIGEST``) and the second it was
        accepted, about 120 bytes an id. The oldest go past the count or age bound (a call still
        queued or running is known from its owner's table of calls in flight anyway)."""
        key = id_key(cid)
        self.executed.pop(key, None)
        self.executed[key] = digest << 32 | int(now) & 0xFFFFFFFF
        while self.executed:
            oldest = next(iter(self.executed))
            if len(self.executed) <= self.max_executed and int(now) - (self.executed[oldest] & 0xFFFFFFFF) < \
                    self.executed_ttl:
                break
            del self.executed[oldest]

    def unrecord(self, cid: str) -> None:
        """Forget ``cid``: its call did not run after all (it expired queued), so the id may be sent again."""
        self.executed.pop(id_key(cid), None)

    def remember(self, cid: str, frames: list[bytes], owner: bytes) -> None:
        """Keep a finished call's answer to give a resent id. Bounded in bytes; when full, the oldest
        answer of the client holding the most bytes goes first, so no client can flush another's."""
        self._forget(cid)
        size = sum(len(f) for f in frames)
        if size > self.cache_limit:
            return
        self.cache[cid] = _Cached(frames, owner, size)
        self.cache_bytes += size
        self.owner_bytes[owner] += size
        self.by_owner.setdefault(owner, collections.OrderedDict())[cid] = None
        while self.cache_bytes > self.cache_limit:
            heaviest = max(self.owner_bytes, key=self.owner_bytes.__getitem__)
            self._forget(next(iter(self.by_owner[heaviest])))

    def _forget(self, cid: str) -> None:
        entry = self.cache.pop(cid, None)
        if entry is None:
            return
        self.cache_bytes -= entry.size
        self.owner_bytes[entry.owner] -= entry.size
        ids = self.by_owner[entry.owner]
        del ids[cid]
        if not ids:
            del self.by_owner[entry.owner]
            del self.owner_bytes[entry.owner]


class CallTable:
    """Queued and running calls by id, and the at-most-once memory (``AtMostOnce``) of those that ran."""

    def __init__(self, max_queue: int, *, max_queue_bytes: int = MAX_QUEUE_BYTES,
                 max_wait: float = MAX_QUEUE_WAIT, cache_bytes: int = RESULT_CACHE_BYTES,
                 max_executed: int = MAX_EXECUTED_IDS, executed_ttl: float = EXECUTED_ID_TTL) -> None:
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.max_wait = max_wait
        self.ran = AtMostOnce(cache_bytes=cache_bytes, max_executed=max_executed, executed_ttl=executed_ttl)
        self.jobs: dict[str, Job] = {}
        self.queue: FairQueue[Job] = FairQueue()  # one line per client, served in turn
        self.expired: list[tuple[Job, Result]] = []  # left the queue unrun; the supervisor answers them
        self.next_expiry = math.inf  # no queued call runs out of its wait before this (a lower bound)

    @property
    def executed(self) -> dict[int, int]:
        return self.ran.executed

    @property
    def cache(self) -> dict[str, _Cached]:
        """Answers of finished calls by id, oldest first."""
        return self.ran.cache

    @property
    def cache_bytes(self) -> int:
        return self.ran.cache_bytes

    # ---------------------------------------------------------------- arrival

    def seen(self, route: bytes, call: Call, digest: int) -> Seen | None:
        """None for an id never accepted (or forgotten after it was refused or expired unrun);
        otherwise what to answer a resend."""
        cid = call.id or ""
        job = self.jobs.get(cid)
        if job is not None:
            return join(cid, job.waiters, job.digest, route, digest)
        return self.ran.answer(cid, digest)

    def admit(self, job: Job, now: float) -> Result | None:
        """Queue an accepted call and record its id as run; or the ``unavailable`` refusal when the
        queue is full in calls or bytes (nothing is recorded then)."""
        if len(self.queue) >= self.max_queue:
            return Result.failure(job.call_id, "unavailable",
                                  f"the executor's queue is full ({self.max_queue} calls); it did not run")
        if self.queue.bytes + job.nbytes > self.max_queue_bytes:
            return Result.failure(
                job.call_id, "unavailable",
                f"the executor's queue is full ({self.queue.bytes // 1024**2} MiB queued, "
                f"{job.nbytes // 1024**2} MiB more would pass its {self.max_queue_bytes // 1024**2} MiB); "
                "it did not run")
        job.arrived = now
        self.jobs[job.call_id] = job
        self.queue.push(job)
        self.next_expiry = min(self.next_expiry, job.arrived + self._may_wait(job))
        self.ran.record(job.call_id, job.digest, now)
        return None

    def running(self, cid: str) -> Job | None:
        return self.jobs.get(cid)

    # ---------------------------------------------------------------- the queue

    def queue_wait_bound(self, job: Job) -> float:
        """How long ``job`` may wait for a worker: its timeout, or ``max_wait`` if shorter."""
        return min(job.limits.timeout_s, self.max_wait)

    def _may_wait(self, job: Job) -> float:
        """How long ``job`` may wait and still be started: ``queue_wait_bound`` less the start
        margin when the bound is its timeout (a call with no time left would only be killed)."""
        timeout = job.limits.timeout_s
        if timeout > self.max_wait:
            return self.max_wait
        return timeout - min(START_MARGIN, timeout / 10)

    def next_queued(self) -> Job | None:
        """The next call for a worker, with its timeout cut to what is left of it; calls that ran out
        of it while queued are set aside in ``expired`` instead."""
        now = time.monotonic()
        while (taken := self.queue.take(_any_worker)) is not None:
            job = taken[0]
            waited = now - job.arrived
            if waited >= self._may_wait(job):
                self._expire(job, waited)
                continue
            if waited > 0.001:
                job.limits = job.limits.model_copy(update={"timeout_s": job.limits.timeout_s - waited})
            return job
        return None

    def expire(self, now: float) -> float:
        """Set aside the queued calls that waited too long; return the seconds until the next one
        would (inf if none is queued)."""
        if now < self.next_expiry:  # the loop asks on every turn: no scan of the queue while none can be due
            return self.next_expiry - now
        due = math.inf
        for job in list(self.queue):
            left = job.arrived + self._may_wait(job) - now
            if left <= 0:
                self.queue.remove(job)
                self._expire(job, now - job.arrived)
            else:
                due = min(due, left)
        self.next_expiry = now + due
        return due

    def _expire(self, job: Job, waited: float) -> None:
        bound = "its timeout" if job.limits.timeout_s <= self.max_wait else "the executor's --max-queue-wait"
        self.expired.append((job, Result.failure(
            job.call_id, "unavailable",
            f"the call waited {waited:.1f} s in the executor's queue ({bound}, {self.queue_wait_bound(job):g} s, "
            f"ran out before a worker was free); it did not run")))
        self.ran.unrecord(job.call_id)  # it never ran: the same id may be sent again

    def take_expired(self) -> list[tuple[Job, Result]]:
        expired, self.expired = self.expired, []
        for job, _ in expired:
            self.jobs.pop(job.call_id, None)
        return expired

    def requeue(self, job: Job) -> None:
        """Put a call back at the head of the queue: its worker died before it started the tool, so
        it did not run. The time it already spent counts against its timeout."""
        now = time.monotonic()
        if job.started:
            left = job.limits.timeout_s - (now - job.started)
            job.limits = job.limits.model_copy(update={"timeout_s": max(left, 0.001)})
        job.arrived, job.outcome = now, None
        job.stdout.clear()
        job.stderr.clear()
        self.queue.push(job, first=True)
        self.next_expiry = min(self.next_expiry, job.arrived + self._may_wait(job))

    def unqueue(self, job: Job) -> bool:
        """Take a job out of the queue (cancelled before it started); False if it is not queued."""
        return self.queue.remove(job)

    # ---------------------------------------------------------------- answers

    def done(self, job: Job) -> None:
        self.jobs.pop(job.call_id, None)

    def remember(self, cid: str, frames: list[bytes], owner: bytes) -> None:
        """Keep a finished call's answer for a resent id (``AtMostOnce.remember``)."""
        self.ran.remember(cid, frames, owner)
