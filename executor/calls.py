"""The call table: every call an executor (or a broker) has accepted, from arrival to answer.

It owns the at-most-once rule: a call id runs at most once. A resent id is answered from the cache
of recent results, or joins the call that is still queued or running; it is never run again. It
also owns the queue of calls waiting for a worker. It knows nothing of sockets or workers: the
supervisor feeds it calls and finished results, and takes queued calls out for the worker pool.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from protocol import Call, Limits, Result

RESULT_CACHE_SIZE = 4096  # recent results kept to answer resent call ids...
RESULT_CACHE_BYTES = 128 * 1024 * 1024  # ...and at most this many encoded bytes of them (a result may be MBs)


@dataclass
class Job:
    """One accepted call: who waits for it, its limits, and what happened to it so far."""

    call: Call
    call_id: str
    waiters: list[bytes]
    limits: Limits
    started: float = 0.0
    deadline: float = 0.0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    outcome: Result | None = None  # decided by the supervisor (timeout, cancel, output cap)


class CallTable:
    """Queued and running calls by id, and encoded results of finished ones."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.jobs: dict[str, Job] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.cache: collections.OrderedDict[str, list[bytes]] = collections.OrderedDict()
        self.cache_bytes = 0

    def cached(self, cid: str) -> list[bytes] | None:
        return self.cache.get(cid)

    def running(self, cid: str) -> Job | None:
        return self.jobs.get(cid)

    def queue_full(self) -> bool:
        return len(self.queue) >= self.max_queue

    def admit(self, job: Job) -> None:
        self.jobs[job.call_id] = job
        self.queue.append(job)

    def next_queued(self) -> Job | None:
        return self.queue.popleft() if self.queue else None

    def unqueue(self, job: Job) -> bool:
        """Take a job out of the queue (cancelled before it started); False if it is not queued."""
        if job in self.queue:
            self.queue.remove(job)
            return True
        return False

    def done(self, job: Job) -> None:
        self.jobs.pop(job.call_id, None)

    def remember(self, cid: str, frames: list[bytes]) -> None:
        """Keep a result's frames to answer a resent id. Bounded in entries and in bytes, oldest
        out first."""
        replaced = self.cache.pop(cid, None)
        if replaced is not None:
            self.cache_bytes -= sum(len(f) for f in replaced)
        self.cache[cid] = frames
        self.cache_bytes += sum(len(f) for f in frames)
        while len(self.cache) > RESULT_CACHE_SIZE or self.cache_bytes > RESULT_CACHE_BYTES:
            _, dropped = self.cache.popitem(last=False)
            self.cache_bytes -= sum(len(f) for f in dropped)
