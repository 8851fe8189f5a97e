"""The template process and the workers it forks: everything here runs tool code or is one fork away
from it; the supervisor (``executor.supervisor``) never does. The template (``template_main``)
applies the environment allowlist, imports the tool modules once, reports their specs, forks a
worker per ``Spawn``, kills whatever a dead worker left (it is a child subreaper) and reports every
exit. A worker (``worker_loop``) holds only /dev/null, its output pipes and its channel, runs one
call (``reuse``: many) under its limits and kills what the call left; a fresh worker then stops
itself until the supervisor kills it, so nothing a call leaves reaches a later call.
Why and how: docs/executor.md#the-template-and-its-workers.
"""

from __future__ import annotations

import _signal
import contextlib
import gc
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from executor import signals
from executor.registry import RegistryError, Tool, describe, find_tools, schema_checks_it
from executor.workers import framing, procfs, quickfork
from executor.workers.cgroups import CgroupSupport, Group
from executor.workers.channel import (
    REPLY_OVERHEAD,
    CallRequest,
    ChannelError,
    Exited,
    LoadFailed,
    Reply,
    Spawn,
    Spawned,
    Started,
    Sweep,
    ToolsLoaded,
    reply_cap,
    template_message,
)
from executor.workers.confinement import Confinement
from executor.workers.limits import WorkerLimits, apply_call_limits, apply_process_limits
from executor.workers.privacy import CAP_SYS_PTRACE, CAP_SYS_RESOURCE, HOST_ADMIN_CAPS, drop_capabilities
from executor.workers.processes import (
    KILL_WAIT,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    SHUTDOWN_WAIT,
    close_fds_except,
    has_children,
    kill_children,
    prctl,
)
from protocol.environment import allowed_environment
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


# --------------------------------------------------------------------------------------------------
# template


def template_main(chan: socket.socket, config: WorkerConfig) -> None:
    """Entry of the template process (never returns)."""
    code = 0
    try:
        close_fds_except(0, 1, 2, chan.fileno())  # the supervisor's pidfd, sockets, pipes: not ours
        kept = allowed_environment(os.environ, config.pass_env)
        os.environ.clear()
        os.environ.update(kept)
        pool = _Workers(CgroupSupport.detect() if config.use_cgroups else None, config)
        if pool.cgroups is not None:
            pool.cgroups.sweep()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        os.setsid()
        if config.confinement is None:
            # As root, what no worker of the default profile may hold goes here, once, before any
            # tool module is imported (its import-time code runs in this process): no tracing the
            # executor's processes, no lifting hard limits, no host administration. A hardened
            # worker needs the template's rights to build its sandbox, and drops them there.
            drop_capabilities(CAP_SYS_PTRACE, CAP_SYS_RESOURCE, *HOST_ADMIN_CAPS.values())
        quickfork.watch_hooks()
        try:
            tools = find_tools(config.targets)
        except RegistryError as e:
            framing.send(chan, LoadFailed(message=str(e)).to_wire())
            os._exit(3)
        if not _describe(chan, tools, pool.cgroups.describe() if pool.cgroups else ""):
            os._exit(3)
        _std_files()
        if not config.reuse:
            rehearse()  # once here too: what it needs is made before any worker is forked
        gc.freeze()  # a worker's garbage collections never walk (and so copy) the template's objects
        _template_loop(chan, tools, pool)
    except BaseException:
        traceback.print_exc()
        code = 1
    # The workers die with us (PDEATHSIG); what they left must not go to init. Quickly: what SIGKILL
    # cannot stop now (frozen, uninterruptible) is the supervisor's, as a subreaper, once we are gone.
    kill_children(wait=SHUTDOWN_WAIT)
    with contextlib.suppress(BaseException):
        pool.remove_all(wait=SHUTDOWN_WAIT)
    os._exit(code)


def _describe(chan: socket.socket, tools: dict[str, Tool], cgroups: str) -> bool:
    """Send the supervisor the tools' specs (``ToolsLoaded``), or why they cannot be served
    (``LoadFailed``); whether they can. The specs are built by reflection with pydantic. Where the
    schema says all every annotation checks (``schema_checks_it``), that happens in a child that
    exits once it has sent them: the template never maps pydantic, so no fork copies it. Otherwise
    here: such tools keep their spec, and their workers check arguments with it (``run_call``)."""
    checked = [name for name, t in tools.items() if not schema_checks_it(t)]
    if checked:
        return _send_specs(chan, tools, cgroups, checked)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _send_specs(chan, tools, cgroups, checked) else 3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _send_specs(chan: socket.socket, tools: dict[str, Tool], cgroups: str, checked: Sequence[str]) -> bool:
    """Describe the tools and send ``ToolsLoaded``, the ``checked`` ones keeping their spec for their
    workers' checks; or send ``LoadFailed``. Whether the tools can be served."""
    try:
        specs = {name: describe(t) for name, t in tools.items()}
        framing.send(chan, ToolsLoaded(specs=[spec.model_dump() for spec in specs.values()], cgroups=cgroups,
                                       checked=list(checked)).to_wire())
    except RegistryError as e:
        framing.send(chan, LoadFailed(message=str(e)).to_wire())
        return False
    except BaseException:
        traceback.print_exc()
        return False
    for name in checked:
        tools[name] = replace(tools[name], spec=specs[name])
    return True


SPARE_GROUPS = 16  # the most groups of dead workers kept for the next workers...
SPARE_KEEP = 1.0  # ...each for at most this many seconds, then removed


class _Workers:
    """The template's live workers and their control groups. A dead worker's groups that are found
    clean (``Group.reusable``) are the next worker's: making and removing them costs more than a
    fork. Those no worker takes within ``SPARE_KEEP`` are removed."""

    def __init__(self, cgroups: CgroupSupport | None, config: WorkerConfig) -> None:
        self.cgroups = cgroups
        self.config = config
        self.groups: dict[int, Group | None] = {}
        self.dying: list[Group] = []
        self.spare: list[tuple[float, Group]] = []  # (when its worker was gone, the groups), oldest first
        self.count = 0

    def new_group(self, worker: int) -> Group | None:
        if self.cgroups is None:
            return None
        limits = self.config.limits
        while self.spare:
            group = self.spare.pop(0)[1]  # the oldest: every kept group goes round before one expires
            try:
                group.limit(limits.memory_mb, limits.processes, again=True)
                return group
            except OSError:
                self.dying.append(group)
        self.count += 1
        try:
            return self.cgroups.create(f"{self.config.name}-{worker}-{self.count}", limits.memory_mb,
                                       limits.processes)
        except OSError as e:
            print(f"ciayn-executor: cannot make control groups for a worker ({e}); rlimits only", file=sys.stderr)
            return None

    def gone(self, pid: int, usual: bool) -> bool:
        """A worker died: kill its group and everything it left; keep the group for the next worker
        if it died as workers do (``usual``: killed, or an exit without error; not a worker that
        could not set itself up, which its group might be the cause of) and the group is clean,
        otherwise remove it. Returns whether the kernel OOM-killed something in it."""
        group = self.groups.pop(pid, None)
        oom = group.oom_killed() if group is not None else False
        if group is not None:
            group.kill_all()
        self.sweep()
        if group is not None:
            if usual and not oom and len(self.spare) < SPARE_GROUPS and group.reusable():
                self.spare.append((time.monotonic(), group))
            else:
                self.dying.append(group)
        self.remove_dead_groups()
        return oom

    def spare_due(self, now: float) -> float | None:
        """Seconds until the oldest spare group is to be removed (None: there is none)."""
        return max(0.0, self.spare[0][0] + SPARE_KEEP - now) if self.spare else None

    def expire_spares(self, now: float) -> None:
        while self.spare and now >= self.spare[0][0] + SPARE_KEEP:
            self.dying.append(self.spare.pop(0)[1])
        self.remove_dead_groups()

    def remove_dead_groups(self) -> None:
        """Remove the groups of dead workers that are empty now; one still holding a process that
        SIGKILL has not stopped yet (frozen, uninterruptible sleep) is tried again later."""
        self.dying = [g for g in self.dying if not g.remove(wait=0.05)]

    def sweep(self) -> None:
        """Kill every child of the template that is not a live worker: orphans of dead workers
        (reparented to us, the subreaper) and processes a tool started with ``CLONE_PARENT``."""
        kill_children(keep=frozenset(self.groups))

    def remove_all(self, wait: float = KILL_WAIT) -> None:
        for group in [*self.groups.values(), *self.dying, *(g for _, g in self.spare)]:
            if group is not None:
                group.kill_all()
                group.remove(wait)
        self.groups.clear()
        self.dying.clear()
        self.spare.clear()


def _template_loop(chan: socket.socket, tools: dict[str, Tool], pool: _Workers) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        ready, _, _ = select.select([chan.fileno(), wake_r], [], [], pool.spare_due(time.monotonic()))
        if pool.spare:
            pool.expire_spares(time.monotonic())
        if wake_r in ready:
            os.read(wake_r, 4096)
            if not _reap(chan, pool):
                return  # the supervisor is gone: so are the workers and all they left
        if chan.fileno() in ready:
            try:
                req = template_message(framing.recv(chan))
            except (EOFError, OSError, framing.FrameError):  # the supervisor closed the channel: shutting down
                return
            except ChannelError as e:
                print(f"ciayn-executor: template: ignoring a malformed request ({e})", file=sys.stderr)
                continue
            if isinstance(req, Spawn):
                group = pool.new_group(req.worker)
                try:
                    pid = _spawn_worker(chan, req.worker, tools, pool.config, group, rehearsal=req.rehearse)
                except (BrokenPipeError, ConnectionResetError):  # the supervisor closed the channel: shutting down
                    if group is not None:
                        pool.dying.append(group)  # removed on the way out, with the worker it was made for
                    return
                pool.groups[pid] = group
            elif isinstance(req, Sweep):
                pool.sweep()


def _reap(chan: socket.socket, pool: _Workers) -> bool:
    """Reap dead children, report dead workers with what the kernel measured of them; False when
    the supervisor can no longer be told (it closed the channel: shutting down)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if pid in pool.groups:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            oom = pool.gone(pid, usual=sig == signal.SIGKILL or code == 0)
            try:
                exited = Exited(pid=pid, signal=sig, code=code, oom=oom, cpu_s=usage.ru_utime + usage.ru_stime,
                                peak_rss_kb=usage.ru_maxrss)
                framing.send(chan, exited.to_wire())
            except OSError:
                return False


def _spawn_worker(chan: socket.socket, worker: int, tools: dict[str, Tool], config: WorkerConfig,
                  group: Group | None, rehearsal: bool = False) -> int:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sandbox = config.confinement  # --profile hardened: the worker is PID 1 of a namespace of its own
    if sandbox is not None:
        sandbox.before_fork()
    template = os.getpid() if sandbox is None else 0  # a hardened worker cannot see (nor signal) us
    pid = quickfork.fork()
    if pid == 0:
        code = 0
        try:
            signal.set_wakeup_fd(-1)
            close_fds_except(0, 1, 2, child_end.fileno(), out_w, err_w)  # the template's channel too
            if group is not None:
                group.join()  # before any tool code: memory, process count and kill cover all it starts
            _worker_setup(out_w, err_w, config)
            if sandbox is not None:
                sandbox.enter()  # namespaces, read-only view, no privileges, Landlock, seccomp
            if rehearsal and not config.reuse:
                rehearse()
            worker_loop(child_end, tools, config, template=template)
        except BaseException:
            code = 70
            with contextlib.suppress(BaseException):
                traceback.print_exc()  # on the worker's stderr: it reaches the call's result or the log
        os._exit(code)
    if sandbox is not None:
        sandbox.after_fork(pid)
    child_end.close()
    os.close(out_w)
    os.close(err_w)
    fds = [parent_end.fileno(), out_r, err_r]
    try:  # the supervisor signals the worker through it: never another process that reuses the pid
        fds.append(os.pidfd_open(pid))
    except OSError:  # Linux < 5.3: it signals by pid
        pass
    try:
        framing.send_with_fds(chan, Spawned(worker=worker, pid=pid).to_wire(), fds)
    finally:
        parent_end.close()
        for fd in fds[1:]:
            os.close(fd)
    return pid


# --------------------------------------------------------------------------------------------------
# worker


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
    if t.spec is not None:  # a tool whose annotations check more than its schema says (``_describe``)
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
