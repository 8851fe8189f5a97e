"""The selfcheck's escape attempts: tools (this module is the ``--tools`` of the executor under
test) that run inside a real hardened worker.

Each tries one thing and returns what happened as data ("denied: ERRNO" or "ALLOWED: what it got",
or what it saw); none judges itself. The judge, on the host, is ``executor.sandbox.selfcheck``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

from executor.registry import tool
from executor.sandbox.kernel import NR, libc
from executor.sandbox.seccomp import DENIED_SYSCALLS


def _attempt(fn: Callable[..., object], *args: Any) -> str:
    """Run one attempt: 'denied: ERRNO' when it raised, else 'ALLOWED: what it got'."""
    try:
        got = fn(*args)
    except OSError as e:
        return f"denied: {errno.errorcode.get(e.errno or 0, e.errno)}"
    except (ValueError, PermissionError) as e:
        return f"denied: {type(e).__name__}: {e}"
    return f"ALLOWED: {got!r}"[:300]


def _raw(result: int, what: str) -> str:
    if result < 0:
        raise OSError(ctypes.get_errno(), what)
    return f"{what} returned {result}"


@tool
def ptrace_attach(pids: list[int]) -> list[str]:
    """PTRACE_ATTACH to each pid (the supervisor, the template, a sibling worker)."""
    def attach(pid: int) -> str:
        return _raw(libc.ptrace(16, pid, None, None), f"ptrace({pid})")
    return [_attempt(attach, p) for p in pids]


@tool
def read_proc_mem(pids: list[int]) -> list[str]:
    """Read the first readable mapping of each pid through /proc/PID/mem."""
    def read(pid: int) -> str:
        with open(f"/proc/{pid}/maps") as maps:
            start = int(maps.readline().split("-")[0], 16)
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(start)
            return f"{len(mem.read(64))} bytes of pid {pid}"
    return [_attempt(read, p) for p in pids]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@tool
def process_vm_readv(pids: list[int]) -> list[str]:
    """process_vm_readv 16 bytes at a likely-mapped address of each pid."""
    def read(pid: int) -> str:
        buf = ctypes.create_string_buffer(16)
        local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), 16)
        remote = _IoVec(0x400000, 16)
        return _raw(libc.syscall(310, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0),
                    f"process_vm_readv({pid})")
    return [_attempt(read, p) for p in pids]


@tool
def signal_pids(pids: list[int]) -> list[str]:
    """kill(pid, 0) (the permission check of any signal) on each pid."""
    def probe(pid: int) -> str:
        os.kill(pid, 0)
        return f"pid {pid} can be signalled"
    return [_attempt(probe, p) for p in pids]


@tool
def leave_cgroup() -> list[str]:
    """Write its pid into the root group's cgroup.procs of each hierarchy (v1 and v2)."""
    def move(path: str) -> str:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        return f"moved via {path}"
    paths = ["/sys/fs/cgroup/memory/cgroup.procs", "/sys/fs/cgroup/pids/cgroup.procs",
             "/sys/fs/cgroup/unified/cgroup.procs", "/sys/fs/cgroup/cgroup.procs"]
    return [_attempt(move, p) for p in paths]


@tool
def freeze_self() -> str:
    """Freeze its own v1 freezer group (after which SIGKILL would not end it)."""
    def freeze() -> str:
        with open("/proc/self/cgroup") as f:
            own = next(line.split(":", 2)[2] for line in f if ":freezer:" in line)
        with open(f"/sys/fs/cgroup/freezer{own.strip()}/freezer.state", "w") as f:
            f.write("FROZEN")
        return "frozen"
    return _attempt(freeze)


@tool
def write_dev_shm(name: str, mb: int) -> str:
    """Write ``mb`` MiB into /dev/shm/NAME and leave it there."""
    def write() -> str:
        with open(f"/dev/shm/{name}", "wb") as f:
            for _ in range(mb):
                f.write(b"\0" * (1 << 20))
        return f"wrote {mb} MiB"
    return _attempt(write)


@tool
def fill_workspace(directory: str, mb: int) -> str:
    """Write ``mb`` MiB into ``directory`` as 1 MiB files, then as many 4 KiB ones, until refused."""
    written = 0

    def fill() -> str:
        nonlocal written
        for size, count in ((1 << 20, mb), (4096, mb * 256)):
            for i in range(count):
                with open(os.path.join(directory, f"fill-{size}-{i}"), "wb") as f:
                    f.write(b"\0" * size)
                written += size
        return f"wrote {written >> 20} MiB"
    return _attempt(fill)


@tool
def write_file(path: str) -> str:
    """Create and write a file at ``path``."""
    def write() -> str:
        with open(path, "w") as f:
            f.write("escaped")
        return f"wrote {path}"
    return _attempt(write)


@tool
def read_file(paths: list[str]) -> list[str]:
    """Read each path (a file, or list a directory)."""
    def read(path: str) -> str:
        if os.path.isdir(path):
            return f"listed {path}: {os.listdir(path)[:5]}"
        with open(path, "rb") as f:
            return f"read {len(f.read(4096))} bytes of {path}"
    return [_attempt(lambda p=p: read(p)) for p in paths]


@tool
def raise_rlimits() -> list[str]:
    """Raise each hard limit by one, and raise each soft limit up to its hard limit; report what worked."""
    out = []
    for name in ("RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_NPROC",
                 "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_MEMLOCK"):
        which = getattr(resource, name)
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY and (got := _attempt(_raise_hard, which, hard)).startswith("ALLOWED"):
            out.append(got)
        slack = 1 if name == "RLIMIT_CPU" else 0  # SIGXCPU at the soft limit, SIGKILL a second later
        if (hard == resource.RLIM_INFINITY and soft != hard) or hard - soft > slack:
            out.append(f"ALLOWED: {name} soft {soft} can rise to hard {hard}")
    return out or ["denied: every hard limit is fixed and equals its soft limit"]


def _raise_hard(which: int, hard: int) -> str:
    resource.setrlimit(which, (hard + 1, hard + 1))
    return f"raised hard limit {which} to {hard + 1}"


@tool
def find_secret(digest: str) -> list[str]:
    """Look for an environment value the executor was not told to pass (given only its SHA-256, so
    the search itself never puts it in memory): os.environ, /proc/self/environ, and every readable
    mapping of its own memory (a forked worker holds whatever its template ever held)."""
    import hashlib
    import re

    pattern = re.compile(rb"sk-[0-9a-f]{32}")

    def hit(data: bytes) -> bool:
        return any(hashlib.sha256(m.group()).hexdigest() == digest for m in pattern.finditer(data))

    found = []
    if any(hit(v.encode(errors="replace")) for v in os.environ.values()):
        found.append("os.environ")
    with contextlib.suppress(OSError), open("/proc/self/environ", "rb") as f:
        if hit(f.read()):
            found.append("/proc/self/environ")
    with open("/proc/self/maps") as maps:
        regions = maps.read().splitlines()
    for line in regions:  # anonymous memory, heap and stack: where a process keeps what it was given
        fields = line.split()
        name = fields[5] if len(fields) > 5 else ""
        if not fields[1].startswith("r") or name not in ("", "[heap]", "[stack]"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if hit(ctypes.string_at(lo, hi - lo)):
            found.append(f"memory {fields[0]} {name or '[anon]'}")
    return found


@tool
def tcp_connect(host: str, port: int) -> str:
    """TCP connect to host:port."""
    def connect() -> str:
        with socket.create_connection((host, port), timeout=2):
            return f"connected to {host}:{port}"
    return _attempt(connect)


@tool
def tcp_self() -> str:
    """Listen on a loopback port and connect to it."""
    def loop() -> str:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            with socket.create_connection(server.getsockname(), timeout=2):
                return "connected to itself"
    return _attempt(loop)


@tool
def udp_send(host: str, port: int, payload: str) -> str:
    """Send one UDP datagram to host:port."""
    def send() -> str:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return f"sent {s.sendto(payload.encode(), (host, port))} bytes"
    return _attempt(send)


@tool
def dns_lookup(name: str) -> str:
    """Resolve a host name."""
    try:
        return f"ALLOWED: {socket.getaddrinfo(name, 443)[0][4]}"
    except OSError as e:
        return f"denied: {type(e).__name__}: {e}"


@tool
def write_proc_sys() -> str:
    """Open a host-wide sysctl for writing and write back its own value."""
    def write() -> str:
        path = "/proc/sys/vm/overcommit_memory"
        with open(path) as f:
            value = f.read()
        with open(path, "w") as f:
            f.write(value)
        return f"wrote {path}"
    return _attempt(write)


@tool
def remount_rw() -> list[str]:
    """Remount / and /usr read-write."""
    def remount(path: str) -> str:
        return _raw(libc.mount(None, path.encode(), None, ctypes.c_ulong(32 | 4096), None), f"remount {path}")
    return [_attempt(remount, p) for p in ("/", "/usr")]


@tool
def become_root() -> str:
    """setuid(0)."""
    def setuid() -> str:
        os.setuid(0)
        return "uid 0"
    return _attempt(setuid)


@tool
def fork_bomb(limit: int) -> str:
    """Fork sleeping children until fork fails or ``limit`` exist; report how many."""
    children = []
    try:
        for _ in range(limit):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children.append(pid)
        return f"ALLOWED: {len(children)} processes"
    except OSError as e:
        return f"denied: {errno.errorcode.get(e.errno or 0)} after {len(children)} processes"
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


@tool
def shared_memory_bomb(mb: int) -> str:
    """Touch ``mb`` MiB of shared anonymous memory (RLIMIT_DATA does not count it)."""
    import mmap

    area = mmap.mmap(-1, mb << 20)
    for offset in range(0, mb << 20, 4096):
        area[offset] = 1
    return f"ALLOWED: {mb} MiB"


@tool
def unshare_userns() -> str:
    """unshare(CLONE_NEWUSER | CLONE_NEWNET)."""
    return _attempt(lambda: _raw(libc.unshare(0x10000000 | 0x40000000), "unshare"))


@tool
def connect_unix(path: str) -> str:
    """Connect to a path-based UNIX socket (the executor's own endpoint)."""
    def connect() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            return f"connected to {path}"
    return _attempt(connect)


@tool
def forbidden_syscalls() -> list[str]:
    """Call each syscall of the deny-list with zero arguments; report those not refused with EPERM."""
    allowed = []
    for name in DENIED_SYSCALLS:
        if name in ("vhangup", "reboot"):  # harmless without privileges, but never worth the risk
            continue
        result = libc.syscall(NR[name], 0, 0, 0, 0, 0, 0)
        if result >= 0 or ctypes.get_errno() != errno.EPERM:
            allowed.append(f"{name}: {errno.errorcode.get(ctypes.get_errno(), result)}")
    return allowed


@tool
def special_sockets() -> list[str]:
    """Open netlink, packet, raw, vsock (a VM's channel to its host) and AF_ALG sockets (no connect)."""
    kinds = [(socket.AF_NETLINK, socket.SOCK_RAW, 0), (socket.AF_PACKET, socket.SOCK_RAW, 0),
             (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP), (40, socket.SOCK_STREAM, 0),
             (38, socket.SOCK_SEQPACKET, 0), (socket.AF_NETLINK, socket.SOCK_DGRAM, 0)]
    def open_socket(kind: tuple[int, int, int]) -> str:
        socket.socket(*kind).close()
        return f"opened socket{kind}"
    return [_attempt(open_socket, k) for k in kinds]


@tool
def see_processes() -> list[int]:
    """The pids it can see in /proc."""
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


@tool
def privileges() -> dict[str, str]:
    """Its uid, groups, capability sets, no_new_privs and seccomp mode."""
    status = {}
    with open("/proc/self/status") as f:
        lines = f.read().splitlines()
    for line in lines:
        key, _, value = line.partition(":")
        if key.startswith("Cap") or key in ("NoNewPrivs", "Seccomp", "Uid", "Gid", "Groups"):
            status[key] = value.strip()
    return status


@tool
def spawn_daemon(token: str) -> str:
    """Double-fork a detached ``sleep`` carrying ``token`` in its command line, and return at once."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sh", ["/bin/sh", "-c", f"exec sleep 300 # {token}"])
        os._exit(0)
    os.waitpid(pid, 0)
    return "spawned"


@tool
def lazy_import() -> str:
    """Import stdlib modules nothing imported before the call (the interpreter must stay readable)."""
    import encodings.idna
    import xml.dom.minidom

    return f"{encodings.idna.__name__} {xml.dom.minidom.__name__} ok"


@tool
def connect_found_sockets(max_entries: int = 300_000) -> list[str]:
    """Walk its view (not /proc, nor /usr: packaged files) for path-based UNIX sockets and connect to
    each found; the last entry says how many entries were looked at."""
    found: list[str] = []
    seen = 0
    for top, dirs, files in os.walk("/", onerror=lambda e: None):
        if top == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "usr")]
        for name in dirs + files:
            seen += 1
            path = os.path.join(top, name)
            with contextlib.suppress(OSError):
                if os.path.isfile(path) or os.path.isdir(path) or os.path.islink(path):
                    continue
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(path)
        if seen > max_entries:
            break
    return [connect_unix(p).replace("denied", f"denied {p}") for p in found] + [f"denied: looked at {seen} entries"]


@tool
def connect_abstract(name: str) -> str:
    """Connect to an abstract UNIX socket the host listens on."""
    def connect() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + name)
            return f"connected to @{name}"
    return _attempt(connect)


@tool
def kill_everything() -> str:
    """kill(-1, SIGKILL): every process it may signal (then returns, if it is still alive). Only as
    PID 1 of a namespace of its own: anywhere else this would kill every process of its user."""
    if os.getpid() != 1:
        return "NOT TRIED: not PID 1 of its own PID namespace"

    def kill_all() -> str:
        os.kill(-1, signal.SIGKILL)
        return "sent SIGKILL to -1"
    return _attempt(kill_all)


@tool
def inherited_descriptors() -> list[str]:
    """What each of its descriptors points at, besides stdio (0-2) and the one listing /proc/self/fd."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if int(fd) > 2 and not target.startswith("/proc/"):
                out.append(f"{fd} -> {target}")
    return out


@tool
def make_setuid_file(directory: str) -> list[str]:
    """Make a set-user-ID and a set-group-ID file in ``directory`` (chmod, and open with a mode)."""
    path = os.path.join(directory, "setid")

    def chmod(mode: int) -> str:
        with open(path, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(path, mode)
        return f"chmod {mode:o}"

    def create(mode: int) -> str:
        os.close(os.open(f"{path}-{mode:o}", os.O_CREAT | os.O_WRONLY, mode))
        return f"{oct(os.stat(f'{path}-{mode:o}').st_mode)}"
    return [_attempt(chmod, 0o4755), _attempt(chmod, 0o2755), _attempt(create, 0o4755)]


@tool
def make_special(directory: str) -> list[str]:
    """Make a FIFO and a UNIX socket in ``directory``."""
    def socket_file() -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(directory, "rendezvous.sock"))
        return "bound a socket"
    return [_attempt(os.mkfifo, os.path.join(directory, "fifo")), _attempt(socket_file)]


@tool
def cpu_hog(processes: int, seconds: float) -> float:
    """Spin ``processes`` processes for ``seconds`` of wall time; return the CPU seconds they got."""
    def spin() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    pids = []
    for _ in range(processes - 1):
        pid = os.fork()
        if pid == 0:
            spin()
            os._exit(0)
        pids.append(pid)
    spin()
    for pid in pids:
        os.waitpid(pid, 0)
    t = os.times()
    return round(t.user + t.system + t.children_user + t.children_system, 2)


@tool
def hold(seconds: float) -> str:
    """Sleep (a call whose worker the others try to reach)."""
    time.sleep(seconds)
    return "held"
