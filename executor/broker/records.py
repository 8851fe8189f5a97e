"""What the broker knows of a call it accepted (``Job``) and of an executor on its backend
(``Member``). A job speaks the executor's call-table vocabulary (``executor.calls.Job``): ``call_id``,
``waiters``, ``digest`` (what a resend of its id must match), ``nbytes`` (its encoded size),
``client`` (whose turn in the queue it takes), ``queued_at`` and ``timeout`` (how long it may wait),
so that both are what the fair queue takes (``executor.fairqueue.Queued``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executor.metrics import CallStats
from protocol import Call, Ready, ToolSpec


@dataclass
class Job:
    """A call the broker accepted and has not answered yet."""

    call: Call
    frames: list[bytes]  # the call, encoded once, forwarded to whichever executor runs it
    digest: int  # what a resend of its id must match (tool, arguments, timeout): ``executor.calls.fingerprint``
    nbytes: int  # encoded size of its tool, arguments and timeout: what the queue's bounds count
    client: bytes  # the route it came from: its fair-queue key
    waiters: list[bytes]
    spec: ToolSpec | None  # None while the broker is recovering and no executor announced the tool
    timeout: float  # how long it may wait in the queue
    queued_at: float
    member: Member | None = None
    sent_at: float = 0.0
    run_timeout: float = 0.0  # the timeout the executor it was sent to applies to it
    deadline: float = 0.0  # when the broker stops waiting for that executor's answer
    granted: float = 0.0  # apply grace given (once), when the executor said it is applying the call
    tried: list[str] = field(default_factory=list)  # executors it was sent to

    @property
    def call_id(self) -> str:
        return self.call.id or ""


@dataclass
class Member:
    """An executor connected to the backend: its identity is its connection (``route``)."""

    route: bytes
    ready: Ready
    last_heard: float
    capacity: int  # calls sent to it at once, at most: its announced capacity, clamped by the broker
    probed_at: float = float("-inf")  # when another connection's claim on its id last asked it to announce itself
    running: dict[str, Job] = field(default_factory=dict)
    stats: CallStats = field(default_factory=CallStats)
    tool_names: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.tool_names = frozenset(t.name for t in self.ready.tools)

    @property
    def id(self) -> str:
        return self.ready.executor

    @property
    def free(self) -> int:
        return self.capacity - len(self.running)

    def take_over(self, previous: Member) -> None:
        """The same executor process on a new connection: its calls in flight and figures are this one's."""
        self.running, self.stats = previous.running, previous.stats
        for job in self.running.values():
            job.member = self
