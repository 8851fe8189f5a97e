"""Calls waiting, one queue per client, served in turn: the fairness rule of the executor's call
table (``executor.calls``) and of the broker (``executor.broker.routing``).

Each time a worker frees, ``take`` offers the next client in turn its oldest call that some free
worker or executor can run (looking at most ``scan_depth`` calls deep, so a call for a busy tool
does not hold up the client's others); the client that was served goes to the back of the line. A
client whose queue was empty goes to the front when it queues again: it has not been served lately.
So a client flooding calls delays another's by at most one call per free worker. It counts the
encoded bytes waiting, in all and per client, for its owner's bounds.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the queue reads of a call: ``executor.calls.Job`` and ``executor.broker.records.Job`` both are."""

    @property
    def client(self) -> bytes: ...  # whose call it is: the fairness key

    @property
    def queued_at(self) -> float: ...

    @property
    def timeout(self) -> float: ...  # how long it may wait here

    @property
    def nbytes(self) -> int: ...  # its encoded size


J = TypeVar("J", bound=Queued)
E = TypeVar("E")

SCAN_DEPTH = 64


class FairQueue(Generic[J]):
    def __init__(self, scan_depth: int = SCAN_DEPTH) -> None:
        self.scan_depth = scan_depth
        self.queues: collections.OrderedDict[bytes, collections.deque[J]] = collections.OrderedDict()
        self.size = 0
        self.bytes = 0
        self.client_bytes: collections.Counter[bytes] = collections.Counter()

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[J]:
        for q in self.queues.values():
            yield from q

    def of(self, client: bytes) -> int:
        """How many calls ``client`` has waiting."""
        q = self.queues.get(client)
        return len(q) if q is not None else 0

    def bytes_of(self, client: bytes) -> int:
        """How many encoded bytes of calls ``client`` has waiting."""
        return self.client_bytes.get(client, 0)

    def _count(self, job: J, sign: int) -> None:
        self.size += sign
        self.bytes += sign * job.nbytes
        self.client_bytes[job.client] += sign * job.nbytes
        if self.client_bytes[job.client] <= 0:
            del self.client_bytes[job.client]

    def push(self, job: J, *, first: bool = False) -> None:
        """Queue ``job`` behind its client's other calls (``first``: ahead of them, e.g. a call to run
        again because its executor died)."""
        q = self.queues.get(job.client)
        if q is None:  # a client with nothing waiting goes first: it has not been served lately
            q = self.queues[job.client] = collections.deque()
            self.queues.move_to_end(job.client, last=False)
        if first:
            q.appendleft(job)
        else:
            q.append(job)
        self._count(job, 1)

    def take(self, runner: Callable[[J], E | None]) -> tuple[J, E] | None:
        """The next call in turn that ``runner`` finds an executor for, with that executor; None if
        no waiting call can run now."""
        for client in list(self.queues):
            q = self.queues[client]
            for i, job in enumerate(q):
                if i >= self.scan_depth:
                    break
                where = runner(job)
                if where is None:
                    continue
                del q[i]
                self._count(job, -1)
                if q:
                    self.queues.move_to_end(client)
                else:
                    del self.queues[client]
                return job, where
        return None

    def remove(self, job: J) -> bool:
        """Take one call out (cancelled, or answered another way); False if it was not waiting."""
        q = self.queues.get(job.client)
        if q is None:
            return False
        try:
            q.remove(job)
        except ValueError:
            return False
        self._count(job, -1)
        if not q:
            del self.queues[job.client]
        return True

    def expire(self, now: float) -> list[J]:
        """Take out and return the calls that have waited their whole timeout (one pass per client)."""
        expired: list[J] = []
        for client in list(self.queues):
            q = self.queues[client]
            if not any(now - j.queued_at > j.timeout for j in q):
                continue
            kept: collections.deque[J] = collections.deque()
            for j in q:
                (expired if now - j.queued_at > j.timeout else kept).append(j)
            if kept:
                self.queues[client] = kept  # keeps its place in the line
            else:
                del self.queues[client]
        for j in expired:
            self._count(j, -1)
        return expired
