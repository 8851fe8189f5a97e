"""Message bodies of the wire protocol (see ``protocol/SPEC.md``, whose field tables are generated from
these models by ``protocol.schema``).

Every message is a strict pydantic model with a ``KIND`` class constant that names it on the wire. Each
field's ``description`` is its meaning in the SPEC. Unknown fields are ignored (``extra="ignore"``,
and the codec validates nested types defined elsewhere, such as ``ToolSpec``, the same way), so peers
of adjacent releases interoperate within ``ciayn/1``. The codec (``protocol.codec``) owns turning
messages into frames and back; nothing else serialises them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.spec import MAX_NAME_CHARS, MAX_TOOLS, ToolSpec
from protocol.values import INT_MAX

ErrorKind = Literal[
    "rejected",  # the call text did not pass the grammar
    "unknown_tool",  # no tool of that name in the executor
    "bad_arguments",  # the arguments do not bind to the tool's signature, or the call's timeout is invalid
    "tool_error",  # the tool raised an exception
    "timeout",  # the call ran past its wall-clock deadline; its worker was killed
    "memory",  # the call hit its memory limit
    "crashed",  # the worker died (signal, os._exit, ...) while running the call
    "output_limit",  # stdout/stderr or the result exceeded its cap
    "unserializable",  # the tool returned a value msgpack cannot carry
    "cancelled",  # the call was cancelled (by the client or by shutdown)
    "unavailable",  # no executor answered, the queue is full or waited too long, or a result is gone
    "protocol",  # a malformed message, or a message this receiver does not accept
]
ERROR_KINDS: tuple[str, ...] = ErrorKind.__args__  # type: ignore[attr-defined]

SignalKind = Literal["complete", "exit", "note"]

ID_PATTERN = r"^[!-~]{1,128}$"  # a call id: 1-128 printable ASCII characters, no space
RESULT_ID_PATTERN = r"^[!-~]{0,128}$"  # the same, or "" for an error about no readable call
MAX_ID_CHARS = 128
MAX_TIMEOUT_S = 86400.0  # the longest timeout a call may ask for (24 h)
MAX_CAPACITY = 4096  # the most workers a `ready` may announce...
BROKER_CAPACITY = 256  # ...and what a broker sends one executor at once by default (--max-executor-capacity)


class Body(BaseModel):
    """Base of every message body: strict types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    KIND: ClassVar[str] = ""


def _id_required(schema: dict[str, Any]) -> None:
    """``Call.id`` is None in Python until the call is sent (a parsed call has none yet) but a
    required str on the wire: the schema says so, and the codec refuses a call without one."""
    prop = schema["properties"]["id"]
    schema["properties"]["id"] = {"type": "string", "pattern": ID_PATTERN, "description": prop["description"]}
    schema["required"] = sorted({*schema.get("required", []), "id"})


class Limits(Body):
    """The resource limits of one call, as one value: defaults from the command line, a tool's own
    override, then the call's own timeout, cut to the executor's ceiling (``max_timeout_s``). Reported
    back in every result."""

    timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False,
                             description="wall-clock limit of a call, seconds; the worker is killed at it")
    cpu_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                description="CPU seconds (RLIMIT_CPU); null: timeout_s + 1, rounded up")
    memory_mb: int = Field(default=1024, gt=0, description="memory of the worker and what it starts, MiB")
    max_output_kb: int = Field(default=1024, gt=0, description="cap on stdout and on stderr, each, KiB")
    max_result_kb: int = Field(default=4096, gt=0, description="cap on the encoded return value, KiB")
    open_files: int = Field(default=256, gt=0, description="open file descriptors (RLIMIT_NOFILE)")
    file_size_mb: int = Field(default=256, gt=0, description="largest file the tool may write, MiB")
    processes: int = Field(default=256, gt=0, description="processes, where a pids cgroup enforces it")

    def effective_cpu_s(self) -> int:
        if self.cpu_s is not None:
            return max(1, int(self.cpu_s + 0.999))
        return max(1, int(self.timeout_s + 1.999))


def requested_timeout(default: float, spec: ToolSpec | None, call: Call | None) -> float:
    """The timeout a call asks for (SPEC.md section 7): its own, else its tool's, else ``default``.
    A timeout that is not a positive finite number (inf, nan, 0) overrides nothing: every call has a
    deadline."""
    timeout = default
    if spec is not None and spec.timeout is not None and _usable(spec.timeout):
        timeout = spec.timeout
    if call is not None and call.timeout is not None and _usable(call.timeout):
        timeout = call.timeout
    return float(timeout)


def effective_limits(defaults: Limits, spec: ToolSpec | None, call: Call | None,
                     max_timeout: float = MAX_TIMEOUT_S) -> Limits:
    """Command-line defaults, overridden by the tool's timeout, overridden by the call's timeout; the
    timeout at most ``max_timeout`` (``--max-timeout``: a ceiling, not a default), whoever asked."""
    timeout = min(requested_timeout(defaults.timeout_s, spec, call), max_timeout)
    if timeout == defaults.timeout_s:
        return defaults
    return defaults.model_copy(update={"timeout_s": timeout})


def _usable(timeout: float) -> bool:
    return math.isfinite(timeout) and timeout > 0


class Call(Body):
    """A call descriptor: plain data, never code. ``id`` is set when the call is sent."""

    model_config = ConfigDict(json_schema_extra=_id_required)
    KIND: ClassVar[str] = "call"
    id: str | None = Field(default=None, pattern=ID_PATTERN,
                           description="required, and sent first; unique across all clients of the executor "
                           "(e.g. a uuid4)")
    tool: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="the tool's name")
    args: list[Any] = Field(default_factory=list, description="positional arguments (values)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments (values)")
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                  description="wall-clock limit for this call, seconds; an invalid value "
                                  "is answered bad_arguments")
    max_timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                      description="a ceiling on this call's timeout, seconds, whoever set it (a "
                                      "broker puts its --max-timeout here); not part of what makes the call that "
                                      "call: a resend may carry another (SPEC.md section 8)")


MAX_ERROR_MESSAGE_CHARS = 16384
MAX_TRACEBACK_CHARS = 65536
MAX_SIGNAL_MESSAGE_CHARS = 16384


def _cut_text(value: Any, limit: int) -> Any:
    """Cut a longer text to ``limit`` characters, with a note saying how much was cut: an error or a
    signal text goes into a model's context, and one from a hostile executor or broker must not fill
    it (ours are far shorter). Never refuses: an answer is not lost for its length."""
    if isinstance(value, str) and len(value) > limit:
        kept = limit - 64  # room for the note
        return f"{value[:kept]} [... {len(value) - kept} more characters cut]"
    return value


class ErrorInfo(Body):
    """Why a call failed (or a message was refused)."""

    kind: ErrorKind = Field(description="one of the error kinds")
    message: str = Field(description="what happened, for the reader who acts on it; a longer one is cut to "
                         f"{MAX_ERROR_MESSAGE_CHARS} characters with a note")
    type: str | None = Field(default=None, description="the exception's type, for tool_error; a longer one is cut "
                             f"to {MAX_NAME_CHARS} characters with a note")
    traceback: str | None = Field(default=None, description="the tool's traceback, for tool_error; a longer one "
                                  f"is cut to {MAX_TRACEBACK_CHARS} characters with a note")
    signal: int | None = Field(default=None, description="the signal that killed the worker, for crashed")

    @field_validator("message", mode="before")
    @classmethod
    def _cut_message(cls, value: Any) -> Any:
        return _cut_text(value, MAX_ERROR_MESSAGE_CHARS)

    @field_validator("traceback", mode="before")
    @classmethod
    def _cut_traceback(cls, value: Any) -> Any:
        return _cut_text(value, MAX_TRACEBACK_CHARS)

    @field_validator("type", mode="before")
    @classmethod
    def _cut_type(cls, value: Any) -> Any:
        return _cut_text(value, MAX_NAME_CHARS)


class Signal(Body):
    """Something a tool reported to the controller through ``executor.signals``."""

    kind: SignalKind = Field(description="complete: the agent's task is done; exit: stop; note: remark")
    message: str = Field(default="", description="the tool's text; a longer one is cut to "
                         f"{MAX_SIGNAL_MESSAGE_CHARS} characters with a note")

    @field_validator("message", mode="before")
    @classmethod
    def _cut_message(cls, value: Any) -> Any:
        return _cut_text(value, MAX_SIGNAL_MESSAGE_CHARS)


class WorkerInfo(Body):
    """The worker that ran (or was running) the call."""

    id: int = Field(description="the worker's slot number in the executor")
    pid: int = Field(description="its process id as the executor's host sees it "
                                 "(a tool in a PID namespace sees another)")
    incarnation: int = Field(description="how many processes that slot has had")
    restarted: bool = Field(default=False, description="the call cost its worker: it was killed or died and "
                            "is replaced, so any state a tool kept in it is lost")
    layers: list[Annotated[str, Field(max_length=MAX_NAME_CHARS)]] = Field(
        default_factory=list, max_length=64, description="the isolation layers the worker ran under, in the "
        "order applied (`--profile hardened`: pid-ns, cgroups, mount-ns, ..., seccomp); empty under the "
        "default profile")


class Stats(Body):
    """What the call cost."""

    wall_s: float = Field(default=0.0, description="wall-clock seconds from dispatch to answer")
    cpu_s: float = Field(default=0.0, description="CPU seconds the tool used")
    peak_rss_kb: int = Field(default=0, description="peak resident memory of the worker, KiB")


class Result(Body):
    """The one answer to a call (or to a malformed message)."""

    KIND: ClassVar[str] = "result"
    id: str = Field(pattern=RESULT_ID_PATTERN,
                    description="the call's id; \"\" when the message it answers had no readable id")
    ok: bool = Field(description="true: value holds the return value; false: error says why")
    value: Any = Field(default=None, description="the tool's return value (a value)")
    value_is_repr: bool = Field(default=False, description="value is the repr() string of a return value "
                                "that cannot cross the wire (e.g. a set, or over the element budget)")
    error: ErrorInfo | None = Field(default=None, description="set exactly when ok is false")
    stdout: str = Field(default="", description="what the tool printed, up to limits.max_output_kb")
    stderr: str = Field(default="", description="what the tool wrote to stderr, up to limits.max_output_kb")
    signals: list[Signal] = Field(default_factory=list, description="signals the tool sent, in order")
    worker: WorkerInfo | None = Field(default=None, description="the worker, when one ran the call")
    stats: Stats | None = Field(default=None, description="what the call cost, when it ran")
    limits: Limits | None = Field(default=None, description="the limits the call ran under")
    executor: str | None = Field(default=None, max_length=MAX_NAME_CHARS,
                                 description="id of the executor that ran or refused the call")

    @classmethod
    def failure(cls, call_id: str, kind: ErrorKind, message: str, **fields: Any) -> Result:
        """A result carrying only an error, for the places that refuse a call outright."""
        return cls(id=call_id, ok=False, error=ErrorInfo(kind=kind, message=message), **fields)

    @property
    def completed(self) -> Signal | None:
        return next((s for s in self.signals if s.kind == "complete"), None)


class Hello(Body):
    """Client -> executor: who are you, what tools do you hold? Answered with ``welcome``."""

    KIND: ClassVar[str] = "hello"
    client: str = Field(default="", max_length=MAX_NAME_CHARS, description="the client's name, for logs")


class Welcome(Body):
    """Executor -> client: the answer to ``hello``."""

    KIND: ClassVar[str] = "welcome"
    executor: str = Field(max_length=MAX_NAME_CHARS, description="the executor's id")
    incarnation: int = Field(description="changes when the executor restarts (calls in flight may be lost)")
    tools: list[ToolSpec] = Field(max_length=MAX_TOOLS, description="the tools it serves")
    limits: Limits = Field(description="the default limits of a call")
    workers: int = Field(default=1, description="calls it runs at once")
    profile: str = Field(default="default", max_length=MAX_NAME_CHARS, description="its isolation profile")
    apply_grace_s: float = Field(default=0.0, ge=0, le=MAX_TIMEOUT_S,
                                 description="how much longer than its timeout a call may take to answer because its "
                                 "writes are being applied (hardened --workspace-rw); a client adds it to its deadline")
    max_timeout_s: float = Field(default=MAX_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                 description="the longest any call runs here, seconds (--max-timeout): a call's, its "
                                 "tool's or the default timeout over it is cut to it")


class Ping(Body):
    """Client -> executor: are you there? Answered with ``pong`` at any time, even while busy."""

    KIND: ClassVar[str] = "ping"
    nonce: int = Field(default=0, ge=0, le=INT_MAX, description="echoed in the pong")


class Pong(Body):
    """Executor -> client: the answer to ``ping``."""

    KIND: ClassVar[str] = "pong"
    nonce: int = Field(default=0, ge=0, le=INT_MAX, description="the ping's nonce (0 when it was unreadable)")
    executor: str = Field(default="", max_length=MAX_NAME_CHARS, description="the executor's id")
    incarnation: int = Field(default=0, description="as in welcome")
    busy: int = Field(default=0, description="calls running")
    queued: int = Field(default=0, description="calls waiting for a worker")
    error: ErrorInfo | None = Field(default=None, description="set (kind protocol) when the ping was malformed")


class Cancel(Body):
    """Client -> executor: stop a call. No reply of its own: the call is answered ``cancelled``."""

    KIND: ClassVar[str] = "cancel"
    id: str = Field(pattern=ID_PATTERN, description="the id of a call this client sent")


# Pool messages: executor <-> broker.


class Ready(Body):
    """Executor -> broker, first on every (re)connection: what it serves and the calls it holds."""

    KIND: ClassVar[str] = "ready"
    executor: str = Field(max_length=MAX_NAME_CHARS, description="the executor's id")
    incarnation: int = Field(description="as in welcome")
    tools: list[ToolSpec] = Field(max_length=MAX_TOOLS, description="the tools it serves")
    limits: Limits = Field(description="the default limits of a call")
    capacity: int = Field(default=1, ge=1, le=MAX_CAPACITY, description="calls it runs at once (its workers); a "
                          "broker sends it at most its own --max-executor-capacity")
    profile: str = Field(default="default", max_length=MAX_NAME_CHARS, description="its isolation profile")
    apply_grace_s: float = Field(default=0.0, ge=0, le=MAX_TIMEOUT_S,
                                 description="how much longer than its timeout a call may take to answer because its "
                                 "writes are being applied (hardened --workspace-rw); a broker grants at most its own "
                                 "--apply-grace, and only to a call the executor says it is applying (heartbeat)")
    max_timeout_s: float = Field(default=MAX_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                 description="the longest any call runs on it, seconds (its --max-timeout); a broker "
                                 "applies at most its own --max-timeout too")
    held: list[str] = Field(default_factory=list, max_length=65536,
                            description="ids of calls queued, running or answered lately")


class Heartbeat(Body):
    """Both ways between executor and broker: still here. From an executor, also which calls it is
    applying the workspace writes of, so that the broker waits for them (SPEC.md section 12)."""

    KIND: ClassVar[str] = "heartbeat"
    executor: str = Field(default="", max_length=MAX_NAME_CHARS, description="the executor's id")
    applying: list[str] = Field(default_factory=list, max_length=MAX_CAPACITY,
                                description="executor -> broker: ids of calls that answered within their time and "
                                "whose workspace writes it is applying now (hardened --workspace-rw); sent at once "
                                "when a call starts applying, then with every heartbeat until it is answered")


class Bye(Body):
    """Executor -> broker: leaving. Broker -> executor: ``refused`` (it may not join now, ``reason``
    says why; it announces itself again later), or else "announce yourself again" (the broker does not
    know it, e.g. after a restart, or another connection announced its id)."""

    KIND: ClassVar[str] = "bye"
    executor: str = Field(default="", max_length=MAX_NAME_CHARS, description="the executor's id")
    reason: str = Field(default="", max_length=4096, description="why, for logs")
    refused: bool = Field(default=False, description="broker -> executor: it may not join now (it retries with "
                          "backoff, section 12)")


# Status: any client -> executor or broker.


class Status(Body):
    """Client -> executor or broker: report yourself. Answered with ``report``."""

    KIND: ClassVar[str] = "status"


class ToolStats(Body):
    """Calls of one tool answered so far. ``buckets`` counts calls by wall time, cumulative, one per
    bound of ``LATENCY_BUCKETS`` (the last, +Inf, equals ``calls``)."""

    name: str = Field(max_length=MAX_NAME_CHARS, description="the tool's name")
    calls: int = Field(default=0, description="calls answered")
    errors: int = Field(default=0, description="of which not ok")
    wall_s_sum: float = Field(default=0.0, description="their wall-clock seconds, summed")
    buckets: list[int] = Field(default_factory=list, max_length=64,
                               description="calls by wall time, cumulative, one per LATENCY_BUCKETS bound")


LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 30.0, 60.0, float("inf"))


class ExecutorStatus(Body):
    """One executor, as a broker's ``report`` lists it."""

    executor: str = Field(description="the executor's id")
    incarnation: int = Field(default=0, description="as in welcome")
    tools: list[Annotated[str, Field(max_length=MAX_NAME_CHARS)]] = Field(
        default_factory=list, description="names of the tools it serves, each of at most 256 characters")
    capacity: int = Field(default=0, description="calls it runs at once")
    busy: int = Field(default=0, description="calls running")
    queued: int = Field(default=0, description="calls waiting")
    served: int = Field(default=0, description="calls answered")
    worker_restarts: int = Field(default=0, description="workers replaced after a call cost them")
    idle_s: float = Field(default=0.0, description="seconds since the broker last heard from it")
    max_timeout_s: float = Field(default=MAX_TIMEOUT_S, description="the longest any call runs on it, seconds "
                                 "(its --max-timeout)")


class Report(Body):
    """The answer to ``status``: a single executor reports itself in ``executors``; a broker reports
    every executor connected to it and the pool's totals."""

    KIND: ClassVar[str] = "report"
    role: Literal["executor", "broker"] = Field(description="what answered")
    id: str = Field(description="its id")
    incarnation: int = Field(default=0, description="as in welcome")
    uptime_s: float = Field(default=0.0, description="seconds since it started")
    capacity: int = Field(default=0, description="calls it (or the pool) runs at once")
    busy: int = Field(default=0, description="calls running")
    queued: int = Field(default=0, description="calls waiting")
    served: int = Field(default=0, description="calls answered")
    worker_restarts: int = Field(default=0, description="workers replaced after a call cost them")
    max_timeout_s: float = Field(default=MAX_TIMEOUT_S, description="the longest any call runs there, seconds "
                                 "(--max-timeout; for a broker, its own)")
    executors: list[ExecutorStatus] = Field(default_factory=list, description="the executors behind it")
    tools: list[ToolStats] = Field(default_factory=list, description="per-tool figures")


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
