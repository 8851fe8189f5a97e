"""The template process and the workers it forks. Everything here runs tool code or is one fork away
from it; the supervisor (``executor.supervisor``) never does.

The **template** is forked by the supervisor before it opens any ZeroMQ socket. It imports the tool
modules once, reports the tool specs, and then forks a **worker** whenever the supervisor asks, so a
replacement worker is ready in milliseconds with the tools already imported. The template is a
child subreaper: when a worker dies, whatever it left behind is reparented to the template, which
kills it. It reports every worker's exit status to the supervisor.

A **worker** is itself a child subreaper in its own session. It reads calls from its channel, runs
each under the call's limits with stdout/stderr going to pipes the supervisor reads, and after each
call kills every process the call left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

import msgpack

from executor import framing, signals
from executor.cgroups import CgroupSupport, Group
from executor.limits import apply_call_limits, apply_process_limits
from executor.registry import RegistryError, Tool, load_tools
from protocol import BindError, Limits, ValueRefused, check_value

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MAX_TRACEBACK_CHARS = 4000
MAX_REPR_CHARS = 100_000
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    _libc.prctl(option, value, 0, 0, 0)


def _child_pids() -> list[int]:
    """Direct children of this process, from /proc (cheap: no full /proc scan)."""
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children") as f:
                    pids.extend(int(p) for p in f.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return pids


def _has_children() -> bool:
    """Whether any child (running or a zombie) exists: one waitpid, no /proc reads. As a subreaper,
    the worker inherits every orphan of the call, so "no child" means nothing was left behind."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True  # running children (pid 0), or one zombie just reaped: look closer


def kill_children(keep: frozenset[int] = frozenset(), rounds: int = 200) -> int:
    """SIGKILL and reap every child except ``keep``, repeating while new ones appear (a subreaper
    inherits the grandchildren of the ones it kills). Returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        victims = [p for p in _child_pids() if p not in keep]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for pid in victims:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return killed


# --------------------------------------------------------------------------------------------------
# template


def template_main(chan: socket.socket, targets: list[str], limits: Limits, name: str = "x",
                  use_cgroups: bool = True) -> None:
    """Entry of the template process (never returns). ``name`` (the executor's id) names the
    per-worker control groups, made when the machine offers them and ``use_cgroups`` is set."""
    code = 0
    pool = _Workers(CgroupSupport.detect() if use_cgroups else None, name, limits)
    if pool.cgroups is not None:
        pool.cgroups.sweep()
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        os.setsid()
        try:
            tools = load_tools(targets)
        except RegistryError as e:
            framing.send(chan, {"op": "error", "message": str(e)})
            os._exit(3)
        framing.send(chan, {"op": "tools", "specs": [t.spec.model_dump() for t in tools.values()],
                            "cgroups": pool.cgroups.describe() if pool.cgroups else ""})
        _template_loop(chan, tools, limits, pool)
    except BaseException:
        traceback.print_exc()
        code = 1
    kill_children()  # the workers die with us (PDEATHSIG); what they left must not go to init
    pool.remove_all()
    os._exit(code)


class _Workers:
    """The template's live workers and their control groups."""

    def __init__(self, cgroups: CgroupSupport | None, name: str, limits: Limits) -> None:
        self.cgroups = cgroups
        self.name = name
        self.limits = limits
        self.groups: dict[int, Group | None] = {}
        self.count = 0

    def new_group(self, slot: int) -> Group | None:
        if self.cgroups is None:
            return None
        self.count += 1
        try:
            return self.cgroups.create(f"{self.name}-{slot}-{self.count}", self.limits.memory_mb,
                                       self.limits.processes)
        except OSError as e:
            print(f"ciayn-executor: cannot make control groups for a worker ({e}); rlimits only", file=sys.stderr)
            return None

    def gone(self, pid: int) -> bool:
        """A worker died: kill its group and everything it left, remove the group. Returns whether
        the kernel OOM-killed something in it."""
        group = self.groups.pop(pid, None)
        oom = group.oom_killed() if group is not None else False
        if group is not None:
            group.kill_all()
        kill_children(keep=frozenset(self.groups))  # as subreaper, the dead worker's orphans are ours
        if group is not None:
            group.remove()
        return oom

    def remove_all(self) -> None:
        for group in self.groups.values():
            if group is not None:
                group.kill_all()
                group.remove()
        self.groups.clear()


def _template_loop(chan: socket.socket, tools: dict[str, Tool], limits: Limits, pool: _Workers) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        ready, _, _ = select.select([chan.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            if not _reap(chan, pool):
                return  # the supervisor is gone: so are the workers and all they left
        if chan.fileno() in ready:
            try:
                req = framing.recv(chan)
            except (EOFError, OSError):  # the supervisor closed (or reset) the channel: shutting down
                return
            if req.get("op") == "spawn":
                group = pool.new_group(req["slot"])
                pid = _spawn_worker(chan, req, tools, limits, group, wake_r, wake_w)
                pool.groups[pid] = group


def _reap(chan: socket.socket, pool: _Workers) -> bool:
    """Reap dead children, report dead workers; False when the supervisor can no longer be told
    (it closed the channel: shutting down)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if pid in pool.groups:
            oom = pool.gone(pid)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            try:
                framing.send(chan, {"op": "exited", "pid": pid, "signal": sig, "code": code, "oom": oom})
            except OSError:
                return False


def _spawn_worker(
    chan: socket.socket, req: dict[str, Any], tools: dict[str, Tool], limits: Limits, group: Group | None,
    *close: int,
) -> int:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            chan.close()
            parent_end.close()
            for fd in (out_r, err_r, *close):
                os.close(fd)
            signal.set_wakeup_fd(-1)
            if group is not None:
                group.join()  # before any tool code: memory, process count and kill cover all it starts
            _worker_setup(out_w, err_w, limits)
            worker_loop(child_end, tools, limits)
        except BaseException:
            code = 70
            with contextlib.suppress(BaseException):
                traceback.print_exc()  # on the worker's stderr: it reaches the call's result or the log
        os._exit(code)
    child_end.close()
    os.close(out_w)
    os.close(err_w)
    framing.send_with_fds(chan, {"op": "spawned", "slot": req["slot"], "pid": pid}, [parent_end.fileno(), out_r, err_r])
    parent_end.close()
    os.close(out_r)
    os.close(err_r)
    return pid


# --------------------------------------------------------------------------------------------------
# worker


def _worker_setup(out_w: int, err_w: int, limits: Limits) -> None:
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit raises EFBIG instead
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the worker
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    apply_process_limits(limits)


def worker_loop(chan: socket.socket, tools: dict[str, Tool], defaults: Limits) -> None:
    while True:
        try:
            req = framing.recv(chan)
        except EOFError:
            return
        reply, replace = run_call(req, tools, defaults)
        reply["seq"] = req.get("seq")
        try:
            data = framing.pack(reply)
        except ValueError:  # UnicodeEncodeError: a message holds a surrogate escape (a non-UTF-8 file name)
            data = framing.pack(_utf8_safe(reply))
        try:
            chan.sendall(data)
        except OSError:
            return
        if replace:
            return


def _utf8_safe(obj: Any) -> Any:
    """``obj`` with every string made encodable as UTF-8 (undecodable bytes shown as \\x.. escapes)."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {k: _utf8_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_utf8_safe(v) for v in obj]
    return obj


_clear_refs_fd: int | None = None


def _reset_peak_rss() -> None:
    """Make ru_maxrss measure this call: writing 5 to /proc/self/clear_refs resets the peak RSS
    (the worker never exec'd, so its rusage peak is the address space's high-water mark)."""
    global _clear_refs_fd
    if _clear_refs_fd is None:
        try:
            _clear_refs_fd = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            _clear_refs_fd = -1  # not available here: the peak is the worker's lifetime peak
    if _clear_refs_fd >= 0:
        with contextlib.suppress(OSError):
            os.write(_clear_refs_fd, b"5")


def _cpu() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run_call(req: dict[str, Any], tools: dict[str, Tool], defaults: Limits) -> tuple[dict[str, Any], bool]:
    """Run one call; return the reply for the supervisor and whether this worker must be replaced."""
    t = tools.get(req["tool"])
    limits = Limits.model_validate(req["limits"]) if req.get("limits") else defaults
    signals.drain()
    replace = False
    reply: dict[str, Any]
    if t is None:  # the supervisor checks first; this is a second line
        return {"ok": False, "error": {"kind": "unknown_tool", "message": f"no tool named {req['tool']!r}"}}, False
    try:
        t.spec.bind(req["args"], req["kwargs"])
    except BindError as e:
        return {"ok": False, "error": {"kind": "bad_arguments", "message": str(e)}}, False
    apply_call_limits(limits)
    _reset_peak_rss()
    wall0, cpu0 = time.perf_counter(), _cpu()
    try:
        value = t.fn(*req["args"], **req["kwargs"])
        reply = _encode_value(value, limits)
    except MemoryError:
        reply = {"ok": False, "error": {"kind": "memory", "type": "MemoryError",
                                        "message": f"the tool ran out of memory (limit {limits.memory_mb} MB)"}}
        replace = True
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: a tool cannot stop its worker
        reply = {"ok": False, "error": _tool_error(e)}
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
    reply["wall_s"] = time.perf_counter() - wall0
    leftovers = kill_children() if _has_children() else 0
    reply["cpu_s"] = _cpu() - cpu0
    reply["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reply["signals"] = [s.model_dump() for s in signals.drain()]
    if leftovers:
        reply["leftovers"] = leftovers
    return reply, replace


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
    return {"kind": "tool_error", "type": type(e).__name__, "message": message, "traceback": tb}


def _safe_str(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:
        text = f"<{type(e).__name__} whose str() failed>"
    return text[:MAX_TRACEBACK_CHARS]


def _encode_value(value: Any, limits: Limits) -> dict[str, Any]:
    cap = limits.max_result_kb * 1024
    if isinstance(value, str | bytes) and len(value) > cap:  # before packing a copy of something huge
        return {"ok": False, "error": {"kind": "output_limit",
                                       "message": f"the result is {len(value)} characters, over the {cap}-byte limit"}}
    try:
        check_value(value)
        size = len(msgpack.packb(value, use_bin_type=True))
        if size > cap:
            return {"ok": False, "error": {"kind": "output_limit",
                                           "message": f"the result is {size} bytes, over the {cap}-byte limit"}}
        return {"ok": True, "value": value}
    except (ValueRefused, TypeError, OverflowError, ValueError, RecursionError) as refused:
        try:
            text = repr(value)
        except BaseException as e:
            return {"ok": False, "error": {"kind": "unserializable",
                                           "message": f"the result cannot be sent ({refused}) and its repr() "
                                           f"failed: {type(e).__name__}: {_safe_str(e)}"}}
        if len(text) > min(cap, MAX_REPR_CHARS):
            text = text[: min(cap, MAX_REPR_CHARS)] + "... [repr truncated]"
        return {"ok": True, "value": text, "value_is_repr": True}
