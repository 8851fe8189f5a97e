"""A worker: the process the template (``executor.workers.template``) forks for calls, which runs
tool code. It holds only /dev/null, its output pipes and its channel, runs one call (``reuse``:
many) under its limits and kills what the call left; a fresh worker then stops itself until the
supervisor kills it, so nothing a call leaves reaches a later call. ``WorkerConfig`` is what the
supervisor tells the template about its workers.
Why and how: docs/executor.md#how-a-worker-starts-and-ends.
"""

from __future__ import annotations

import _signal
import contextlib
import os
import resource
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgpack

from executor import signals
from executor.registry import Tool
from executor.workers import framing, procfs
from executor.workers.cgroups import Group
from executor.workers.channel import (
    REPLY_OVERHEAD,
    CallRequest,
    Reply,
    Started,
    reply_cap,
)
from executor.workers.confinement import Confinement
from executor.workers.limits import WorkerLimits, apply_call_limits, apply_process_limits
from executor.workers.processes import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    close_fds_except,
    has_children,
    kill_children,
    prctl,
)
from protocol.errors import BindError
from protocol.values import ValueRefused, check_value

MAX_TRACEBACK_CHARS = 4000
MAX_MESSAGE_CHARS = 4000
MAX_TYPE_CHARS = 200
MAX_SIGNALS = 64
MAX_SIGNAL_CHARS = 4000
MAX_REPR_CHARS = 100_000


@dataclass(frozen=True)
class WorkerConfig:
    """What the template needs to make workers: the supervisor sends it in the template's
    ``Configure`` (``to_wire``), before the template reads a tool module."""

    targets: list[str]
    limits: WorkerLimits
    name: str = "x"  # the executor's id: names the per-worker control groups
    use_cgroups: bool = True
    reuse: bool = False  # --reuse-workers: a worker runs many calls (trusted tools only)
    pass_env: list[str] = field(default_factory=list)
    confinement: Confinement | None = None  # --profile hardened (travels in ``Configure``, not ``to_wire``)

    def to_wire(self) -> dict[str, Any]:
        return {"targets": list(self.targets), "limits": self.limits.to_wire(), "name": self.name,
                "use_cgroups": self.use_cgroups, "reuse": self.reuse, "pass_env": list(self.pass_env)}

    @classmethod
    def from_wire(cls, obj: dict[str, Any], confinement: Confinement | None = None) -> WorkerConfig:
        return cls(targets=[str(t) for t in obj["targets"]], limits=WorkerLimits.from_wire(obj["limits"]),
                   name=str(obj["name"]), use_cgroups=bool(obj["use_cgroups"]), reuse=bool(obj["reuse"]),
                   pass_env=[str(n) for n in obj["pass_env"]], confinement=confinement)



# A worker's signal dispositions: SIGINT ignored, and SIGXFSZ, so a write past the file limit raises
# EFBIG instead. Set with the bare ``_signal.signal``: ``signal.signal`` makes an enum member of the
# old handler, which cost each fresh worker ~40 copy-on-write faults (0.2 ms here).
_WORKER_SIGNALS = ((signal.SIGCHLD, _signal.SIG_DFL), (signal.SIGTERM, _signal.SIG_DFL),
                   (signal.SIGPIPE, _signal.SIG_DFL), (signal.SIGINT, _signal.SIG_IGN),
                   (signal.SIGXFSZ, _signal.SIG_IGN))
_STDIO: list[Any] = []  # the worker's sys.stdin, stdout, stderr, made once by the template


def _std_files() -> list[Any]:
    """Text files over descriptors 0, 1 and 2, which a worker points at /dev/null and its output
    pipes: made in the template before any fork (never written there, so nothing is buffered), each
    fresh worker is spared building them (~60 copy-on-write faults)."""
    if not _STDIO:
        _STDIO.extend([open(0, closefd=False),  # noqa: SIM115 - they live as long as the process
                       open(1, "w", buffering=1, closefd=False, errors="backslashreplace"),  # noqa: SIM115
                       open(2, "w", buffering=1, closefd=False, errors="backslashreplace")])  # noqa: SIM115
    return _STDIO


def _worker_setup(out_w: int, err_w: int, config: WorkerConfig) -> None:
    for sig, handler in _WORKER_SIGNALS:
        _signal.signal(sig, handler)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    sys.stdin, sys.stdout, sys.stderr = _std_files()
    apply_process_limits(config.limits, hard=not config.reuse)


def prepare_workers(config: WorkerConfig) -> None:
    """What the template makes once, before it forks any worker, so that no worker makes it: the
    standard text files and, for fresh workers, a rehearsed call path (``rehearse``)."""
    _std_files()
    if not config.reuse:
        rehearse()


def worker_main(chan: socket.socket, out_w: int, err_w: int, tools: dict[str, Tool], config: WorkerConfig,
                group: Group | None, *, template: int, rehearsal: bool) -> NoReturn:
    """A worker right after its fork: set it up (nothing of the template's but ``chan`` and its
    output pipes, its control groups joined before any tool code, its signals, limits and standard
    files, ``config.confinement``'s sandbox entered), then serve calls; never returns."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        close_fds_except(0, 1, 2, chan.fileno(), out_w, err_w)  # the template's channel too
        if group is not None:
            group.join()  # before any tool code: memory, process count and kill cover all it starts
        _worker_setup(out_w, err_w, config)
        if config.confinement is not None:
            config.confinement.enter()  # namespaces, read-only view, no privileges, Landlock, seccomp
        if rehearsal and not config.reuse:
            rehearse()
        worker_loop(chan, tools, config, template=template)
    except BaseException:
        code = 70
        with contextlib.suppress(BaseException):
            traceback.print_exc()  # on the worker's stderr: it reaches the call's result or the log
    os._exit(code)


def worker_loop(chan: socket.socket, tools: dict[str, Tool], config: WorkerConfig, template: int = 0) -> None:
    """Serve calls from the channel: one, or (``config.reuse``) until the channel closes.

    A call is not started while ``template`` (the process that forked us) is dying: a tool that
    SIGKILLs the template and returns is answered before the template's death reaches the
    supervisor, and the client's next call can come here, to a worker forked ahead that dies with the
    template (PDEATHSIG). Started, that call would be lost with us (``crashed``); not started, our
    exit sends it back to the queue for the next template's workers."""
    while True:
        try:
            req = CallRequest.from_wire(framing.recv(chan))
        except EOFError:
            return
        if template and (os.getppid() != template or procfs.dying(template)):
            return
        try:
            chan.sendall(_started(req.seq))
        except OSError:
            return
        reply, replace = run_call(req, tools, config.limits, hard=not config.reuse)
        data = _pack_reply(reply, reply_cap(config.limits.max_result_kb))
        try:
            chan.sendall(data)
        except OSError:
            return
        if not config.reuse:
            # A fresh worker is done: it stops at once (every thread a tool left stops with it, nothing
            # runs on) and the supervisor kills it once the executor is quiet, so that tearing this
            # process down does not take the CPU the answer needs on its way. PID 1 of a namespace of
            # its own (a hardened worker) cannot stop itself: it exits now.
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if replace:
            return  # a reused worker that must be replaced exits at once


def _started(seq: int) -> bytes:
    return framing.pack(Started(seq=seq).to_wire())


def _pack_reply(reply: Reply, cap: int) -> bytes:
    """The reply's frame, cut to fit ``cap``: an error's type, message and traceback and the signals
    are shortened (with a note) rather than dropped."""
    wire = reply.to_wire()
    try:
        data = framing.pack(wire)
    except ValueError:  # UnicodeEncodeError: a message holds a surrogate escape (a non-UTF-8 file name)
        wire = _utf8_safe(wire)
        data = framing.pack(wire)
    if len(data) <= cap:
        return data
    error = wire.get("error")
    if isinstance(error, dict):
        for key, limit in (("traceback", 1000), ("message", 1000), ("type", MAX_TYPE_CHARS)):
            if isinstance(error.get(key), str):
                error[key] = _cut(error[key], limit)
    wire["signals"] = _capped_signals(wire["signals"], 8, 1000)
    data = framing.pack(wire)
    if len(data) > cap:  # still too large: only the value can be (it passed its own check)
        wire.update(value=None, ok=False, error={"kind": "output_limit",
                                                 "message": f"the reply is over the {cap}-byte limit"})
        data = framing.pack(wire)
    return data


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [cut: {len(text)} characters in all]"


def _utf8_safe(obj: Any) -> Any:
    """``obj`` with every string made encodable as UTF-8 (undecodable bytes shown as \\x.. escapes)."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {k: _utf8_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_utf8_safe(v) for v in obj]
    return obj


def _reset_peak_rss() -> None:
    """Make ru_maxrss measure this call: writing 5 to /proc/self/clear_refs resets the peak RSS
    (the worker never exec'd, so its rusage peak is the address space's high-water mark). The file
    is not kept open: a descriptor would be inherited by whatever the tool starts."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return  # not available here: the peak is the worker's lifetime peak
    try:
        os.write(fd, b"5")
    except OSError:
        pass
    finally:
        os.close(fd)


def _cpu() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _rehearsal() -> None:
    """The tool of a fresh worker's rehearsal: does nothing."""


_REHEARSAL: dict[str, Tool] = {}  # made by the template, once, before it forks workers
_REHEARSAL_LIMITS = WorkerLimits(cpu_s=1, memory_mb=1, processes=1, open_files=1, file_size_mb=1, max_result_kb=1)


def rehearse() -> None:
    """Take a no-op call through a fresh worker's call path (channel, request, start, run, reply)
    while it waits for its real call. A forked worker shares the template's pages until it first
    writes them, and Python writes (reference counts) to every object it touches: the first call
    down this path took about 170 copy-on-write faults, 0.7 ms of a no-op call on a 2-core VM. Here
    they are taken ahead, off the call's time. Nothing of it is sent and no limit is set."""
    if not _REHEARSAL:
        _REHEARSAL["_rehearsal"] = Tool(name="_rehearsal", fn=_rehearsal, module=__name__)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        framing.send(ours, CallRequest(seq=0, tool="_rehearsal", args=[], kwargs={}).to_wire())
        req = CallRequest.from_wire(framing.recv(theirs))
        theirs.sendall(_started(req.seq))
        reply, _ = run_call(req, _REHEARSAL, _REHEARSAL_LIMITS, apply_limits=False)
        theirs.sendall(_pack_reply(reply, REPLY_OVERHEAD))
    finally:
        ours.close()
        theirs.close()
    signals.drain()


def run_call(req: CallRequest, tools: dict[str, Tool], limits: WorkerLimits, hard: bool = True,
             apply_limits: bool = True) -> tuple[Reply, bool]:
    """Run one call under ``limits`` (its CPU allowance ``req.cpu_s`` where it has its own); return
    the reply for the supervisor and whether this worker must be replaced. ``hard``: the limits are
    set as hard limits too (a fresh worker: the tool cannot lift them). ``apply_limits`` is off only
    for a rehearsal. The supervisor checked the tool and bound its arguments (names and types)."""
    t = tools.get(req.tool)
    signals.drain()
    replace = False
    if t is None:  # the supervisor checks first; this is a second line
        return Reply.failure(req.seq, "unknown_tool", f"no tool named {req.tool!r}"), False
    if t.spec is not None:  # a tool whose annotations check more than its schema says (``template._describe``)
        try:
            t.spec.bind(req.args, req.kwargs)
        except BindError as e:
            return Reply.failure(req.seq, "bad_arguments", str(e)), False
    if apply_limits:
        apply_call_limits(limits, req.cpu_s or limits.cpu_s, hard=hard)
        _reset_peak_rss()
    wall0, cpu0 = time.perf_counter(), _cpu()
    try:
        value = t.fn(*req.args, **req.kwargs)
        reply = _encode_value(req.seq, value, limits)
    except MemoryError:
        reply = Reply.failure(req.seq, "memory", f"the tool ran out of memory (limit {limits.memory_mb} MB)",
                              type="MemoryError")
        replace = True
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: a tool cannot stop its worker
        reply = Reply(seq=req.seq, ok=False, error=_tool_error(e))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
    reply.wall_s = time.perf_counter() - wall0
    reply.leftovers = kill_children() if has_children() else 0
    reply.cpu_s = _cpu() - cpu0
    reply.peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reply.signals = _capped_signals([{"kind": s.kind, "message": s.message} for s in signals.drain()],
                                    MAX_SIGNALS, MAX_SIGNAL_CHARS)
    return reply, replace


def _capped_signals(sigs: list[dict[str, Any]], count: int, chars: int) -> list[dict[str, Any]]:
    """At most ``count`` signals, each message cut to ``chars``. The last ``complete`` and ``exit``
    signals are always kept (they end the agent's task); the notes come first to last until the
    room is gone, and a final note says how many were left out."""
    if len(sigs) <= count:
        return [{**s, "message": _cut(s["message"], chars)} for s in sigs]
    ends = {s["kind"]: i for i, s in enumerate(sigs) if s["kind"] in ("complete", "exit")}
    room = max(0, count - len(ends) - 1)
    keep = sorted({*[i for i, s in enumerate(sigs) if s["kind"] == "note"][:room], *ends.values()})
    out = [{**sigs[i], "message": _cut(sigs[i]["message"], chars)} for i in keep]
    out.append({"kind": "note", "message": f"[{len(sigs) - len(keep)} more signals of this call were cut: "
                f"at most {count} are sent]"})
    return out


def _tool_error(e: BaseException) -> dict[str, Any]:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None))
    if len(tb) > MAX_TRACEBACK_CHARS:
        tb = "...\n" + tb[-MAX_TRACEBACK_CHARS:]
    if isinstance(e, SystemExit):
        message = f"the tool called sys.exit({e.code!r})"
    elif isinstance(e, KeyboardInterrupt):
        message = "the tool raised KeyboardInterrupt"
    else:
        message = _safe_str(e)
    return {"kind": "tool_error", "type": _cut(_safe_type_name(e), MAX_TYPE_CHARS), "message": message,
            "traceback": tb}


def _safe_type_name(e: BaseException) -> str:
    try:
        name = type(e).__name__
    except Exception:
        name = "?"
    return name if isinstance(name, str) else "?"


def _safe_str(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:
        text = f"<{_safe_type_name(e)[:MAX_TYPE_CHARS]} whose str() failed>"
    return _cut(text, MAX_MESSAGE_CHARS) if isinstance(text, str) else "?"


def _encode_value(seq: int, value: Any, limits: WorkerLimits) -> Reply:
    cap = limits.max_result_kb * 1024
    if isinstance(value, str | bytes) and len(value) > cap:  # before packing a copy of something huge
        return Reply.failure(seq, "output_limit", f"the result is {len(value)} characters, over the {cap}-byte limit")
    try:
        check_value(value)
        size = len(msgpack.packb(value, use_bin_type=True))
        if size > cap:
            return Reply.failure(seq, "output_limit", f"the result is {size} bytes, over the {cap}-byte limit")
        return Reply(seq=seq, ok=True, value=value)
    except (ValueRefused, TypeError, OverflowError, ValueError, RecursionError) as refused:
        try:
            text = repr(value)
        except BaseException as e:
            return Reply.failure(seq, "unserializable", f"the result cannot be sent ({refused}) and its repr() "
                                 f"failed: {type(e).__name__}: {_safe_str(e)}")
        if len(text) > min(cap, MAX_REPR_CHARS):
            text = text[: min(cap, MAX_REPR_CHARS)] + "... [repr truncated]"
        return Reply(seq=seq, ok=True, value=text, value_is_repr=True)
