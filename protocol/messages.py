"""Message bodies of the wire protocol (see ``protocol/SPEC.md``).

Every message is a pydantic model with ``extra="forbid"`` and a ``KIND`` class constant that names it on
the wire. The codec (``protocol.codec``) owns turning them into frames and back; nothing else
serialises them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.spec import ToolSpec

ErrorKind = Literal[
    "rejected",  # the call text did not pass the grammar
    "unknown_tool",  # no tool of that name in the executor
    "bad_arguments",  # the arguments do not bind to the tool's signature
    "tool_error",  # the tool raised an exception
    "timeout",  # the call ran past its wall-clock deadline; its worker was killed
    "memory",  # the call hit its memory limit
    "crashed",  # the worker died (signal, os._exit, ...) while running the call
    "output_limit",  # stdout/stderr or the result exceeded its cap
    "unserializable",  # the tool returned a value msgpack cannot carry
    "cancelled",  # the call was cancelled (by the client or by shutdown)
    "unavailable",  # no executor answered, or the executor's queue is full
    "protocol",  # a malformed message
]
ERROR_KINDS: tuple[str, ...] = ErrorKind.__args__  # type: ignore[attr-defined]

SignalKind = Literal["complete", "exit", "note"]


class Body(BaseModel):
    """Base of every message body: strict, closed, immutable-by-convention."""

    model_config = ConfigDict(extra="forbid", strict=True)
    KIND: ClassVar[str] = ""


class Limits(Body):
    """The resource limits of one call, as one value: defaults from the command line, a tool's own
    override, then the call's own timeout. Reported back in every result."""

    timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    cpu_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # RLIMIT_CPU; None: from timeout_s
    memory_mb: int = Field(default=1024, gt=0)
    max_output_kb: int = Field(default=1024, gt=0)  # stdout and stderr, each
    max_result_kb: int = Field(default=4096, gt=0)  # the encoded return value
    open_files: int = Field(default=256, gt=0)
    file_size_mb: int = Field(default=256, gt=0)
    processes: int = Field(default=256, gt=0)  # pids cgroup where available

    def effective_cpu_s(self) -> int:
        if self.cpu_s is not None:
            return max(1, int(self.cpu_s + 0.999))
        return max(1, int(self.timeout_s + 1.999))


class Call(Body):
    """A call descriptor: plain data, never code. ``id`` is set when the call is sent."""

    KIND: ClassVar[str] = "call"
    tool: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None
    timeout: float | None = None  # per-call wall-clock override, seconds


class ErrorInfo(Body):
    kind: ErrorKind
    message: str
    type: str | None = None  # the exception type for tool_error
    traceback: str | None = None
    signal: int | None = None  # for crashed


class Signal(Body):
    kind: SignalKind
    message: str = ""


class WorkerInfo(Body):
    id: int
    pid: int
    incarnation: int
    restarted: bool = False  # the worker was replaced after this call: tool state was lost


class Stats(Body):
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_kb: int = 0


class Result(Body):
    KIND: ClassVar[str] = "result"
    id: str
    ok: bool
    value: Any = None
    value_is_repr: bool = False  # value is repr() of an object msgpack could not carry
    error: ErrorInfo | None = None
    stdout: str = ""
    stderr: str = ""
    signals: list[Signal] = Field(default_factory=list)
    worker: WorkerInfo | None = None
    stats: Stats | None = None
    limits: Limits | None = None
    executor: str | None = None  # executor id that ran (or refused) the call

    @classmethod
    def failure(cls, call_id: str, kind: ErrorKind, message: str, **fields: Any) -> Result:
        """A result carrying only an error, for the places that refuse a call outright."""
        return cls(id=call_id, ok=False, error=ErrorInfo(kind=kind, message=message), **fields)

    @property
    def completed(self) -> Signal | None:
        return next((s for s in self.signals if s.kind == "complete"), None)


class Hello(Body):
    """Client -> executor: who are you, what tools do you hold?"""

    KIND: ClassVar[str] = "hello"
    client: str = ""


class Welcome(Body):
    KIND: ClassVar[str] = "welcome"
    executor: str
    incarnation: int
    tools: list[ToolSpec]
    limits: Limits
    workers: int = 1
    profile: str = "default"


class Ping(Body):
    KIND: ClassVar[str] = "ping"
    nonce: int = 0


class Pong(Body):
    KIND: ClassVar[str] = "pong"
    nonce: int = 0
    executor: str = ""
    incarnation: int = 0
    busy: int = 0
    queued: int = 0


class Cancel(Body):
    KIND: ClassVar[str] = "cancel"
    id: str


# Pool messages: executor <-> broker.


class Ready(Body):
    """Executor -> broker, first on every (re)connection: what it serves and the calls it holds."""

    KIND: ClassVar[str] = "ready"
    executor: str
    incarnation: int
    tools: list[ToolSpec]
    limits: Limits
    capacity: int = Field(default=1, ge=1, le=4096)  # calls it runs at once (its workers)
    profile: str = "default"
    held: list[str] = Field(default_factory=list, max_length=65536)  # ids queued, running or answered lately


class Heartbeat(Body):
    KIND: ClassVar[str] = "heartbeat"
    executor: str = ""


class Bye(Body):
    """Executor -> broker: leaving. Broker -> executor: ``refused`` (it may not join, ``reason`` says
    why), or else "announce yourself again" (the broker does not know it, e.g. after a restart)."""

    KIND: ClassVar[str] = "bye"
    executor: str = ""
    reason: str = ""
    refused: bool = False


# Status: any client -> executor or broker.


class Status(Body):
    KIND: ClassVar[str] = "status"


class ToolStats(Body):
    """Calls of one tool answered so far. ``buckets`` counts calls by wall time, cumulative, one per
    bound of ``LATENCY_BUCKETS`` (the last, +Inf, equals ``calls``)."""

    name: str
    calls: int = 0
    errors: int = 0
    wall_s_sum: float = 0.0
    buckets: list[int] = Field(default_factory=list, max_length=64)


LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 30.0, 60.0, float("inf"))


class ExecutorStatus(Body):
    executor: str
    incarnation: int = 0
    tools: list[str] = Field(default_factory=list)
    capacity: int = 0
    busy: int = 0
    queued: int = 0
    served: int = 0
    worker_restarts: int = 0
    idle_s: float = 0.0  # seconds since the broker last heard from it


class Report(Body):
    """The answer to ``status``: a single executor reports itself in ``executors``; a broker reports
    every executor connected to it and the pool's totals."""

    KIND: ClassVar[str] = "report"
    role: Literal["executor", "broker"]
    id: str
    incarnation: int = 0
    uptime_s: float = 0.0
    capacity: int = 0
    busy: int = 0
    queued: int = 0
    served: int = 0
    worker_restarts: int = 0
    executors: list[ExecutorStatus] = Field(default_factory=list)
    tools: list[ToolStats] = Field(default_factory=list)


MESSAGE_TYPES: tuple[type[Body], ...] = (
    Call,
    Result,
    Hello,
    Welcome,
    Ping,
    Pong,
    Cancel,
    Ready,
    Heartbeat,
    Bye,
    Status,
    Report,
)
Message = Call | Result | Hello | Welcome | Ping | Pong | Cancel | Ready | Heartbeat | Bye | Status | Report
BY_KIND: dict[str, type[Body]] = {m.KIND: m for m in MESSAGE_TYPES}
