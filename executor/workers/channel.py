"""Typed messages on the executor's internal channels (supervisor <-> template, supervisor <-> worker).

Both ends are our own code, but a worker shares its process with tool code, which can write
anything on the channel; so every message read by the supervisor is rebuilt here from plain msgpack
data with its types checked (``from_wire``), and anything else is a ``ChannelError``. On the wire a
message is a msgpack map with an ``op`` key (see ``executor.workers.framing`` for the length-prefixed frames).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

REPLY_OVERHEAD = 64 * 1024  # room for the error, signals and stats around a result of max_result_kb


def reply_cap(max_result_kb: int) -> int:
    """The largest reply frame a worker may send for a call whose result may take ``max_result_kb``;
    the supervisor (or a hardened call's keeper) cuts off a worker that announces a larger one
    before reading it."""
    return max_result_kb * 1024 + REPLY_OVERHEAD


class ChannelError(ValueError):
    """A message that is not one of ours, or whose fields have the wrong types."""


def _field(obj: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in obj:
        if default is ...:
            raise ChannelError(f"the message has no {name!r}")
        return default
    value = obj[name]
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ChannelError(f"{name!r} is a bool")
    if not isinstance(value, kinds):
        raise ChannelError(f"{name!r} is a {type(value).__name__}")
    return value


class _Message:
    """Base of the channel messages (each a dataclass): ``to_wire`` is the map sent on the channel."""

    OP: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        # Shallow on purpose: asdict() would deep-copy a call's arguments and its result on every hop.
        wire = {"op": self.OP}
        for name in _field_names(type(self)):
            wire[name] = getattr(self, name)
        return wire


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A message class's field names, looked up once (``dataclasses.fields`` walks every field's
    descriptor each time: work, and pages touched, on every message of every call)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


# ------------------------------------------------------------------ supervisor <-> template


@dataclass(frozen=True)
class Spawn(_Message):
    """Supervisor -> template: fork worker number ``worker``; a fresh worker that will wait for its
    call first ``rehearse``s the call path (``executor.workers.worker.rehearse``)."""

    OP: ClassVar[str] = "spawn"
    worker: int
    rehearse: bool = False


@dataclass(frozen=True)
class Configure(_Message):
    """Supervisor -> a template started afresh (``executor.workers.template``), first and once: what it needs
    to make workers (``WorkerConfig.to_wire``), the workers' confinement (``Confinement.to_wire``, or None),
    the log level, and the supervisor's ``sys.path``, which the first template inherited (the new one
    starts with ``-P``: never with its working directory, the workspace, on its path)."""

    OP: ClassVar[str] = "configure"
    worker: dict[str, Any]
    confinement: dict[str, Any] | None = None
    log_level: str = "INFO"
    sys_path: list[str] = field(default_factory=list)

    @classmethod
    def from_wire(cls, obj: Any) -> Configure:
        if not isinstance(obj, dict) or obj.get("op") != cls.OP:
            raise ChannelError("not a configure message")
        return cls(worker=_field(obj, "worker", dict), confinement=_field(obj, "confinement", (dict, type(None)), None),
                   log_level=_field(obj, "log_level", str, "INFO"),
                   sys_path=[str(p) for p in _field(obj, "sys_path", list, [])])


@dataclass(frozen=True)
class Sweep(_Message):
    """Supervisor -> template: kill every child that is not a live worker (reused workers' calls end
    without a worker exit, so processes a call started with ``CLONE_PARENT`` are swept this way)."""

    OP: ClassVar[str] = "sweep"


@dataclass(frozen=True)
class Isolated(_Message):
    """Template -> supervisor, first, before it reads its ``Configure`` (so before any tool code can
    write on the channel): its PID namespace is set up, or it runs without one (``pid_ns`` says why;
    "" when it is PID 1 of a namespace of its own). A template that could not set its namespace up
    sends ``LoadFailed`` with ``pidns.FAILED`` instead. Only this first message can turn namespaces
    off: a tool module, imported later, cannot forge it."""

    OP: ClassVar[str] = "isolated"
    pid_ns: str = ""


@dataclass(frozen=True)
class ToolsLoaded(_Message):
    """Template -> supervisor, once, after ``Configure``: the tool specs (ToolSpec dumps), the
    cgroup layers in use, and the tools whose workers check their arguments against the annotations
    themselves (``checked``: the supervisor's check of the schema would say less)."""

    OP: ClassVar[str] = "tools"
    specs: list[dict[str, Any]]
    cgroups: str = ""
    checked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoadFailed(_Message):
    """Template -> supervisor, instead of ``ToolsLoaded``: the tool modules cannot be imported."""

    OP: ClassVar[str] = "error"
    message: str


@dataclass(frozen=True)
class Spawned(_Message):
    """Template -> supervisor, with descriptors attached: channel, stdout, stderr and (Linux 5.3+) the
    worker's pidfd."""

    OP: ClassVar[str] = "spawned"
    worker: int
    pid: int


@dataclass(frozen=True)
class Exited(_Message):
    """Template -> supervisor: a worker died, with what the kernel measured of it (``wait4``)."""

    OP: ClassVar[str] = "exited"
    pid: int
    signal: int = 0
    code: int | None = None
    oom: bool = False
    cpu_s: float = 0.0
    peak_rss_kb: int = 0


TemplateMessage = Spawn | Sweep | Isolated | ToolsLoaded | LoadFailed | Spawned | Exited


def template_message(obj: Any) -> TemplateMessage:
    """Rebuild a message of the template channel (either direction)."""
    if not isinstance(obj, dict):
        raise ChannelError("the message is not a map")
    op = obj.get("op")
    if op == Spawn.OP:
        return Spawn(worker=_field(obj, "worker", int), rehearse=_field(obj, "rehearse", bool, False))
    if op == Sweep.OP:
        return Sweep()
    if op == Isolated.OP:
        return Isolated(pid_ns=_field(obj, "pid_ns", str, ""))
    if op == ToolsLoaded.OP:
        checked = _field(obj, "checked", list, [])
        if not all(isinstance(name, str) for name in checked):
            raise ChannelError("'checked' holds something that is not a name")
        return ToolsLoaded(specs=_field(obj, "specs", list), cgroups=_field(obj, "cgroups", str, ""), checked=checked)
    if op == LoadFailed.OP:
        return LoadFailed(message=_field(obj, "message", str))
    if op == Spawned.OP:
        return Spawned(worker=_field(obj, "worker", int), pid=_field(obj, "pid", int))
    if op == Exited.OP:
        return Exited(
            pid=_field(obj, "pid", int),
            signal=_field(obj, "signal", int, 0),
            code=_field(obj, "code", (int, type(None)), None),
            oom=_field(obj, "oom", bool, False),
            cpu_s=float(_field(obj, "cpu_s", (int, float), 0.0)),
            peak_rss_kb=_field(obj, "peak_rss_kb", int, 0),
        )
    raise ChannelError(f"unknown op {op!r}")


# ------------------------------------------------------------------ supervisor <-> worker


@dataclass(frozen=True)
class CallRequest(_Message):
    """Supervisor -> worker: run one call. ``seq`` numbers the request; the reply must carry it.
    ``cpu_s`` is the call's CPU allowance when its own timeout makes it differ from the configured
    one (``WorkerLimits.cpu_s``): the one limit a call changes."""

    OP: ClassVar[str] = "call"
    seq: int
    tool: str
    args: list[Any]
    kwargs: dict[str, Any]
    cpu_s: int | None = None

    @classmethod
    def from_wire(cls, obj: Any) -> CallRequest:
        if not isinstance(obj, dict) or obj.get("op") != cls.OP:
            raise ChannelError("not a call request")
        return cls(seq=_field(obj, "seq", int), tool=_field(obj, "tool", str), args=_field(obj, "args", list),
                   kwargs=_field(obj, "kwargs", dict), cpu_s=_field(obj, "cpu_s", (int, type(None)), None))


@dataclass(frozen=True)
class _Notice(_Message):
    """A worker's (or keeper's) word about call ``seq`` before its reply."""

    seq: int

    @classmethod
    def from_wire(cls, obj: Any) -> Self | None:
        """The notice, or None if ``obj`` is something else (another notice, a reply)."""
        if isinstance(obj, dict) and obj.get("op") == cls.OP:
            return cls(seq=_field(obj, "seq", int))
        return None


@dataclass(frozen=True)
class Started(_Notice):
    """Worker -> supervisor, before the tool runs: from here on the call may have had effects. A
    worker that dies before saying so never ran the tool, so its call can be given to another."""

    OP: ClassVar[str] = "started"


@dataclass(frozen=True)
class Applying(_Notice):
    """Keeper -> supervisor (hardened ``--workspace-rw``): the call answered within its time and its
    writes are being applied to the workspace; the reply follows once they are (``executor.sandbox.keeper``).
    The supervisor then gives the call ``APPLY_GRACE`` more, once, so a deadline never kills the keeper
    halfway through an apply."""

    OP: ClassVar[str] = "applying"


@dataclass
class Reply(_Message):
    """Worker -> supervisor: how the call went. ``error`` is an ``ErrorInfo`` dump; ``signals`` are
    ``Signal`` dumps; the figures are the call's own (wall and CPU seconds, peak RSS in KB)."""

    OP: ClassVar[str] = "reply"
    seq: int
    ok: bool
    value: Any = None
    value_is_repr: bool = False
    error: dict[str, Any] | None = None
    signals: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_kb: int = 0
    leftovers: int = 0  # processes the call left behind, killed after it

    @classmethod
    def from_wire(cls, obj: Any) -> Reply:
        """Rebuild a reply read from a worker, checking every field (tool code shares the worker's
        process and may have written it)."""
        if not isinstance(obj, dict) or obj.get("op") != cls.OP:
            raise ChannelError("not a reply")
        ok = _field(obj, "ok", bool)
        error = _field(obj, "error", (dict, type(None)), None)
        if not ok and error is None:
            raise ChannelError("a failed reply without an error")
        signals = _field(obj, "signals", list, [])
        if not all(isinstance(s, dict) for s in signals):
            raise ChannelError("'signals' holds something that is not a map")
        return cls(
            seq=_field(obj, "seq", int),
            ok=ok,
            value=obj.get("value"),
            value_is_repr=_field(obj, "value_is_repr", bool, False),
            error=error,
            signals=signals,
            wall_s=float(_field(obj, "wall_s", (int, float), 0.0)),
            cpu_s=float(_field(obj, "cpu_s", (int, float), 0.0)),
            peak_rss_kb=_field(obj, "peak_rss_kb", int, 0),
            leftovers=_field(obj, "leftovers", int, 0),
        )

    @classmethod
    def failure(cls, seq: int, kind: str, message: str, **error: Any) -> Reply:
        return cls(seq=seq, ok=False, error={"kind": kind, "message": message, **error})


_classes = _Message.__subclasses__()
while _classes:  # every message class, here at import (in the template, before any fork)
    _cls = _classes.pop()
    _field_names(_cls)
    _classes.extend(_cls.__subclasses__())
