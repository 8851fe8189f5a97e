"""``ciayn-executor selfcheck``: attack the hardened profile from inside a real hardened worker.

It starts a real executor (``serve --profile hardened``) whose tools are the escape attempts below,
calls each one over ZeroMQ as a client would, and judges each outcome on the host: an attempt
passes only if it was denied. It ends with the executor stopped and checks that nothing it did
stayed on the host (processes, files in ``/dev/shm``, control groups, mounts). It prints a table
(layer, attempt, expected, observed) or, with ``--json``, the same rows for CI, and exits 0 only
if every attempt was denied. ``serve --profile hardened`` runs it before serving.

The attempt functions are tools (this module is the executor's ``--tools``): each tries one thing
and returns what happened as data; they never judge themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from executor.registry import tool

SECRET_ENV = "CIAYN_SELFCHECK_SECRET"
START_TIMEOUT = 30.0  # the executor under test imports only this module
CALL_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0
MEMORY_MB = 128
PROCESSES = 32
QUOTA_MB = 16  # --workspace-quota of the executor under test with --workspace-rw (its writes are in memory)

_libc = ctypes.CDLL(None, use_errno=True)


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


# ------------------------------------------------------------------------------------------------
# the attempts (tools run inside the hardened worker)


@tool
def ptrace_attach(pids: list[int]) -> list[str]:
    """PTRACE_ATTACH to each pid (the supervisor, the template, a sibling worker)."""
    def attach(pid: int) -> str:
        return _raw(_libc.ptrace(16, pid, None, None), f"ptrace({pid})")
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
        return _raw(_libc.syscall(310, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0),
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
        return _raw(_libc.mount(None, path.encode(), None, ctypes.c_ulong(32 | 4096), None), f"remount {path}")
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
    return _attempt(lambda: _raw(_libc.unshare(0x10000000 | 0x40000000), "unshare"))


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
    from executor.hardening import DENIED_SYSCALLS, NR

    allowed = []
    for name in DENIED_SYSCALLS:
        if name in ("vhangup", "reboot"):  # harmless without privileges, but never worth the risk
            continue
        result = _libc.syscall(NR[name], 0, 0, 0, 0, 0, 0)
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


# ------------------------------------------------------------------------------------------------
# the runner (in the controller-side process that starts the executor under test)


@dataclass
class Row:
    layer: str
    attempt: str
    expected: str
    observed: str = ""
    ok: bool = False


@dataclass
class Context:
    """What the attempts need to know about the host side."""

    endpoint: str
    sock_path: str
    workspace: str
    supervisor: int
    template: int
    sibling: int
    controller: int
    tcp_port: int
    udp_port: int
    token: str
    secret: str
    abstract: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    keeper: int = 0  # --workspace-rw: the sibling's keeper (root, outside its sandbox)

    def executor_pids(self) -> list[int]:
        """The executor's processes a tool must not reach: supervisor, template, a sibling call
        (and, with --workspace-rw, that call's keeper)."""
        return [self.supervisor, self.template, self.sibling, *([self.keeper] if self.keeper else [])]


def _denied(observed: Any) -> bool:
    items = observed if isinstance(observed, list) else [observed]
    return all(isinstance(o, str) and o.startswith("denied") for o in items)


def _errno_in(*names: str) -> Callable[[Any], bool]:
    def judge(observed: Any) -> bool:
        items = observed if isinstance(observed, list) else [observed]
        return all(isinstance(o, str) and o.startswith("denied") and any(n in o for n in names) for o in items)
    return judge


@dataclass(frozen=True)
class Attempt:
    """One escape: the tool and its arguments, what must happen, and how to judge the outcome.
    ``judge`` gets the tool's value (the call failed when ``error_kind`` is set instead)."""

    layer: str
    name: str
    expected: str
    tool: str
    args: Callable[[Context], dict[str, Any]]
    judge: Callable[[Any], bool] = _denied
    error_kind: str | None = None  # the call itself must fail with this kind
    host_check: Callable[[Context], str | None] | None = None  # after the call: what it left, or None
    mode: str = "any"  # "ro" or "rw": only against a read-only workspace, or only with --workspace-rw


def _targets(c: Context) -> dict[str, Any]:
    return {"pids": c.executor_pids()}


ATTEMPTS: tuple[Attempt, ...] = (
    Attempt("seccomp, pid-ns", "ptrace the supervisor, the template, a sibling worker", "EPERM/ESRCH",
            "ptrace_attach", _targets, _errno_in("EPERM", "ESRCH")),
    Attempt("pid-ns, identity", "read another call's memory via /proc/PID/mem", "ENOENT/EACCES",
            "read_proc_mem", _targets),
    Attempt("seccomp, pid-ns", "read another call's memory via process_vm_readv", "EPERM/ESRCH",
            "process_vm_readv", _targets, _errno_in("EPERM", "ESRCH")),
    Attempt("pid-ns, landlock", "signal the supervisor, the template, a sibling, the controller", "ESRCH/EPERM",
            "signal_pids", lambda c: {"pids": [*c.executor_pids(), c.controller]},
            _errno_in("ESRCH", "EPERM")),
    Attempt("filesystem, cgroup-ns", "move itself out of its control groups (cgroup.procs)", "ENOENT/EROFS",
            "leave_cgroup", lambda c: {}),
    Attempt("filesystem", "freeze itself with the v1 freezer", "denied", "freeze_self", lambda c: {}),
    Attempt("filesystem", "fill /dev/shm past its cap", "ENOSPC", "write_dev_shm",
            lambda c: {"name": f"ciayn-selfcheck-{c.token}-big", "mb": 200}, _errno_in("ENOSPC", "EFBIG")),
    Attempt("filesystem", "leave a file in /dev/shm after the call", "gone from the host", "write_dev_shm",
            lambda c: {"name": f"ciayn-selfcheck-{c.token}", "mb": 1}, lambda o: True,
            host_check=lambda c: _shm_left(c.token)),
    Attempt("filesystem", "write to the workspace (read-only)", "EROFS/EACCES", "write_file",
            lambda c: {"path": os.path.join(c.workspace, "escaped.txt")}, mode="ro"),
    Attempt("filesystem", "write to the workspace (--workspace-rw), as its owner", "written, the owner's",
            "write_file", lambda c: {"path": os.path.join(c.workspace, "written.txt")},
            lambda o: isinstance(o, str) and o.startswith("ALLOWED: 'wrote"), mode="rw",
            host_check=lambda c: _not_owners(c.workspace, "written.txt")),
    Attempt("landlock, seccomp", "leave a FIFO or socket in the workspace (--workspace-rw)", "EPERM/EACCES",
            "make_special", lambda c: {"directory": c.workspace}, _errno_in("EPERM", "EACCES"), mode="rw"),
    Attempt("seccomp", "leave a set-user-ID file in the workspace (--workspace-rw)", "EPERM", "make_setuid_file",
            lambda c: {"directory": c.workspace}, _errno_in("EPERM"), mode="rw"),
    Attempt("filesystem", f"fill the disk through the workspace (--workspace-rw, {4 * QUOTA_MB} MiB at a "
            f"{QUOTA_MB} MiB quota)", "error kind output_limit; workspace within its quota", "fill_workspace",
            lambda c: {"directory": c.workspace, "mb": 4 * QUOTA_MB}, error_kind="output_limit", mode="rw",
            host_check=lambda c: _over_quota(c.workspace)),
    Attempt("filesystem, landlock", "write outside scratch (/etc, /usr, /)", "EROFS/EACCES", "write_file",
            lambda c: {"path": "/etc/ciayn-escaped"}),
    Attempt("capabilities", "raise hard rlimits (or soft up to hard)", "EPERM", "raise_rlimits", lambda c: {}),
    Attempt("filesystem, identity", "read /etc/shadow", "EACCES/empty", "read_file",
            lambda c: {"paths": ["/etc/shadow", "/etc/gshadow"]}),
    Attempt("filesystem", "read SSH keys and home directories", "ENOENT", "read_file",
            lambda c: {"paths": ["/root/.ssh", "/root/.ssh/id_rsa", "/home"]},
            lambda o: all(x.startswith("denied") or x.startswith("ALLOWED: 'listed /home: []") for x in o)),
    Attempt("identity", "read a root-only file in the workspace", "EACCES", "read_file",
            lambda c: {"paths": [os.path.join(c.workspace, "root-only.txt")]}, _errno_in("EACCES"), mode="ro"),
    Attempt("env allowlist", "read an environment secret not passed with --pass-env", "not found",
            "find_secret", lambda c: {"digest": hashlib.sha256(c.secret.encode()).hexdigest()}, lambda o: o == []),
    Attempt("net-ns, landlock", "exfiltrate over loopback TCP to the host", "ENETUNREACH/EACCES", "tcp_connect",
            lambda c: {"host": "127.0.0.1", "port": c.tcp_port}),
    Attempt("net-ns, landlock", "TCP connect to a port it listens on", "denied", "tcp_self", lambda c: {}),
    Attempt("net-ns", "UDP send to the host", "ENETUNREACH", "udp_send",
            lambda c: {"host": "127.0.0.1", "port": c.udp_port, "payload": c.token}),
    Attempt("net-ns", "DNS lookup", "gaierror", "dns_lookup", lambda c: {"name": "pypi.org"}),
    Attempt("filesystem", "write /proc/sys", "EROFS/EACCES", "write_proc_sys", lambda c: {}),
    Attempt("seccomp, capabilities", "remount / read-write", "EPERM", "remount_rw", lambda c: {}),
    Attempt("identity, no-new-privs", "setuid(0)", "EPERM", "become_root", lambda c: {}, _errno_in("EPERM")),
    Attempt("cgroups", f"fork past the process limit ({PROCESSES})", "EAGAIN", "fork_bomb",
            lambda c: {"limit": 4 * PROCESSES}, _errno_in("EAGAIN")),
    Attempt("cgroups", "use more than one core (3 processes spinning for 2 s)", "at most ~2.2 CPU s",
            "cpu_hog", lambda c: {"processes": 3, "seconds": 2.0}, lambda o: isinstance(o, float) and o <= 2.3),
    Attempt("cgroups", f"allocate past the memory limit ({MEMORY_MB} MB, shared memory)", "error kind memory",
            "shared_memory_bomb", lambda c: {"mb": 4 * MEMORY_MB}, error_kind="memory"),
    Attempt("seccomp", "unshare (user and network namespaces)", "EPERM", "unshare_userns", lambda c: {},
            _errno_in("EPERM")),
    Attempt("filesystem", "connect to the executor's socket", "ENOENT", "connect_unix",
            lambda c: {"path": c.sock_path}),
    Attempt("filesystem", "connect to every UNIX socket in its view", "none found, or refused", "connect_found_sockets",
            lambda c: {}),
    Attempt("net-ns, landlock", "connect to the host's abstract UNIX socket", "ECONNREFUSED/EPERM",
            "connect_abstract", lambda c: {"name": c.abstract}),
    Attempt("pid-ns", "kill every process it may (kill -1)", "only its own; the executor serves on",
            "kill_everything", lambda c: {}, lambda o: "NOT TRIED" not in o, host_check=lambda c: _executor_gone(c)),
    Attempt("worker integrity", "hold a descriptor besides stdio and its channel", "one socket (the channel)",
            "inherited_descriptors", lambda c: {}, lambda o: len(o) == 1 and "socket:" in o[0]),
    Attempt("seccomp", "call the denied system calls", "all EPERM", "forbidden_syscalls", lambda c: {},
            lambda o: o == []),
    Attempt("seccomp", "open netlink, packet, raw, vsock and AF_ALG sockets", "EPERM", "special_sockets",
            lambda c: {}, _errno_in("EPERM")),
    Attempt("seccomp", "make a set-user-ID or set-group-ID file", "EPERM", "make_setuid_file",
            lambda c: {"directory": "/tmp"}, _errno_in("EPERM")),
    Attempt("pid-ns", "see other processes", "only itself (pid 1)", "see_processes", lambda c: {},
            lambda o: o == [1]),
    Attempt("capabilities, no-new-privs, seccomp", "hold privileges", "uid != 0, no capabilities, nnp, seccomp",
            "privileges", lambda c: {},
            lambda o: all(o.get(k) == "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
            and o.get("NoNewPrivs") == "1" and o.get("Seccomp") == "2" and not o.get("Uid", "0").startswith("0")
            and o.get("Groups", "") == ""),
    Attempt("pid-ns, cgroups", "leave a process running after the call", "none left", "spawn_daemon",
            lambda c: {"token": c.token}, lambda o: True, host_check=lambda c: _processes_left(c.token)),
    Attempt("filesystem", "import a module only inside a call (interpreter readable)", "works", "lazy_import",
            lambda c: {}, lambda o: isinstance(o, str) and o.endswith("ok")),
)


def _executor_gone(c: Context) -> str | None:
    """After kill -1 inside: the supervisor, the template and the sibling's call must be alive."""
    dead = []
    for what, pid in (("supervisor", c.supervisor), ("template", c.template), ("sibling worker", c.sibling),
                      *((("its keeper", c.keeper),) if c.keeper else ())):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(what)
    return f"KILLED on the host: {', '.join(dead)}" if dead else None


def _not_owners(workspace: str, name: str) -> str | None:
    """What is wrong with ``name``, written in the workspace by a tool: it must be the workspace owner's."""
    try:
        owner, got = os.stat(workspace).st_uid, os.stat(os.path.join(workspace, name)).st_uid
    except OSError as e:
        return f"NOT WRITTEN: {e}"
    return None if got == owner else f"owned by uid {got} on the host, not by the workspace's owner ({owner})"


def _over_quota(workspace: str) -> str | None:
    from executor import overlay

    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = overlay.tree_usage(fd)
    finally:
        os.close(fd)
    return None if size <= QUOTA_MB << 20 else f"the workspace holds {size >> 20} MiB, over the {QUOTA_MB} MiB quota"


def _shm_left(token: str) -> str | None:
    left = [n for n in os.listdir("/dev/shm") if token in n]
    return f"LEFT on the host: /dev/shm/{left[0]}" if left else None


def _processes_left(token: str, bound: float = 10.0) -> str | None:
    """Processes carrying ``token`` in their command line (waiting up to ``bound`` for the kill)."""
    import psutil

    deadline = time.monotonic() + bound
    while True:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if token in " ".join(p.info["cmdline"] or ()):
                    left.append(p.pid)
        if not left or time.monotonic() > deadline:
            return f"LEFT on the host: pids {left}" if left else None
        time.sleep(0.05)


class _Client:
    """The few protocol exchanges the selfcheck needs (``executor`` never imports the controller)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pending: dict[str, Any] = {}

    def send(self, tool_name: str, kwargs: dict[str, Any], timeout: float = CALL_TIMEOUT) -> str:
        from protocol import Call, encode

        cid = uuid.uuid4().hex
        self.sock.send_multipart(encode(Call(id=cid, tool=tool_name, args=[], kwargs=kwargs, timeout=timeout)))
        return cid

    def wait(self, cid: str, bound: float) -> Any:
        from protocol import Result, decode

        deadline = time.monotonic() + bound
        while cid not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                if cid in self.pending:
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer to the selfcheck's call within {bound:g} s")
                continue
            msg = decode(self.sock.recv_multipart())
            if isinstance(msg, Result):
                self.pending[msg.id] = msg
        return self.pending.pop(cid)

    def call(self, tool_name: str, kwargs: dict[str, Any]) -> Any:
        return self.wait(self.send(tool_name, kwargs), CALL_TIMEOUT + 10)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _host_state() -> dict[str, Any]:
    """What an executor could leave behind on the host: mounts, groups, files in /dev/shm."""
    from executor.workers import cgroups

    groups = []
    for hierarchy in ("memory", "pids", "cpu", "unified"):
        base = cgroups.ROOT / hierarchy
        own = cgroups._own_path("" if hierarchy == "unified" else hierarchy)
        if own is not None:
            groups += [str(p) for p in (base / own.lstrip("/")).glob(f"{cgroups.PREFIX}*")]
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(line.split()[4] for line in f)
    return {"mounts": mounts, "groups": sorted(groups), "shm": sorted(os.listdir("/dev/shm"))}


class Target:
    """A hardened executor serving the attempts, with what they aim at on the host: a workspace
    holding a root-only file, a socket directory, TCP and UDP listeners, a secret in the
    executor's environment, and a sibling worker busy with a long call. A context manager: on
    exit the executor is stopped and ``host_rows`` says what it left on the host."""

    def __init__(self, workers: int = 3, quiet: bool = True, extra: tuple[str, ...] = (),
                 workspace_owner: int | None = None, parent: str | None = None,
                 replace_template: bool = False) -> None:
        self.workers, self.quiet, self.extra, self.owner = workers, quiet, extra, workspace_owner
        self.replace_template = replace_template  # SIGKILL the first template: the attempts meet its replacement
        self.parent = parent or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.host_rows: list[Row] = []

    def __enter__(self) -> Target:
        import psutil

        self.before = _host_state()
        # Not under /tmp: Landlock rights go down a path, so a workspace under the sandbox's /tmp would
        # get /tmp's (sockets may be made there); a workspace is rarely under /tmp in CI.
        self.top = tempfile.mkdtemp(prefix="ciayn-selfcheck-", dir=self.parent)
        workspace = os.path.join(self.top, "workspace")
        os.mkdir(workspace)
        os.chmod(self.top, 0o755)
        with open(os.path.join(workspace, "root-only.txt"), "w") as f:
            f.write("root only")
        os.chmod(os.path.join(workspace, "root-only.txt"), 0o600)
        if self.owner is not None:
            os.chown(workspace, self.owner, self.owner)
        sockdir = os.path.join(self.top, "run")
        os.mkdir(sockdir, 0o700)
        sock_path = os.path.join(sockdir, "executor.sock")
        endpoint = f"ipc://{sock_path}"
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abstract_name = f"ciayn-selfcheck-{uuid.uuid4().hex[:12]}"
        self.abstract.bind("\0" + abstract_name)
        self.abstract.listen()
        secret = f"sk-{uuid.uuid4().hex}"
        cmd = [sys.executable, "-m", "executor.cli", "serve", "--profile", "hardened", "--skip-selfcheck",
               "--tools", "executor.selfcheck", "--bind", endpoint, "--workers", str(self.workers),
               "--workspace", workspace, "--memory-mb", str(MEMORY_MB), "--max-processes", str(PROCESSES),
               "--timeout", "15", "--parent-pid", str(os.getpid()), "--log-level", "warning", *self.extra]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **{SECRET_ENV: secret}), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL if self.quiet else None, cwd=workspace)
        self.client: _Client | None = None
        self.ours: tuple[str, ...] = ()
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not os.path.exists(sock_path):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the hardened executor did not start (exit code {self.proc.poll()}); "
                                       f"run `ciayn-executor {' '.join(cmd[3:])}` to see why")
                time.sleep(0.02)
            self.client = _Client(endpoint)
            first = self.client.wait(self.client.send("hold", {"seconds": 0.0}), START_TIMEOUT)
            if self.replace_template:
                old = psutil.Process(self.proc.pid).children()[0]
                old.kill()
                replaced_by = time.monotonic() + START_TIMEOUT
                while True:  # a call may still meet the old template's workers, or none: until one works
                    first = self.client.wait(self.client.send("hold", {"seconds": 0.0}), START_TIMEOUT)
                    # the replacement is a fresh interpreter; the old template's orphans may linger a while
                    kids = [c.pid for c in psutil.Process(self.proc.pid).children() if _is_template_exec(c, psutil)]
                    if first.ok and kids:
                        template = kids[0]
                        break
                    if time.monotonic() > replaced_by:
                        raise RuntimeError("the killed template was not replaced")
                    time.sleep(0.05)
            else:
                tree = psutil.Process(self.proc.pid).children()
                template = tree[0].pid if tree else 0
            self.ours = (first.executor or "?", f"-{template}-")  # in the names of its control groups
            self.client.send("hold", {"seconds": 300.0}, timeout=300.0)  # cancelled by the shutdown
            self.ctx = Context(endpoint=endpoint, sock_path=sock_path, workspace=workspace, supervisor=self.proc.pid,
                               template=template, sibling=(sibling := _busy_worker(template, psutil)),
                               keeper=_keeper_of(sibling, template, psutil), controller=os.getpid(),
                               tcp_port=self.tcp.getsockname()[1], udp_port=self.udp.getsockname()[1],
                               token=uuid.uuid4().hex[:12], secret=secret, abstract=abstract_name)
        except BaseException:
            self._stop()
            raise
        return self

    def attempt(self, attempt: Attempt) -> Row:
        assert self.client is not None
        row = _run_attempt(self.client, attempt, self.ctx)
        if attempt.tool == "udp_send":
            got = b""
            with contextlib.suppress(BlockingIOError):
                got = self.udp.recv(256)
            if got:
                row.ok, row.observed = False, f"the host received {got!r}"
        return row

    def _stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.tcp.close()
        self.udp.close()
        self.abstract.close()

    def __exit__(self, *exc: object) -> None:
        self._stop()
        ctx: Context | None = getattr(self, "ctx", None)
        self.host_rows = _host_rows(self.before, ctx.token if ctx else "-", self.ours)
        shutil.rmtree(self.top, ignore_errors=True)


RW_EXTRA = ("--workspace-rw", "--workspace-quota", str(QUOTA_MB))  # the executor under test with --workspace-rw


def attempts(workspace_rw: bool = False) -> list[Attempt]:
    """The attempts for a read-only workspace, or for ``--workspace-rw``."""
    skip = "ro" if workspace_rw else "rw"
    return [a for a in ATTEMPTS if a.mode != skip]


def run(quiet: bool = True, workspace_rw: bool = False) -> list[Row]:
    """Start a hardened executor serving the attempts, run every attempt, stop it, and check the
    host. Returns one row per attempt, then the host checks."""
    with Target(quiet=quiet, extra=RW_EXTRA if workspace_rw else ()) as target:
        rows = [target.attempt(a) for a in attempts(workspace_rw)]
    return rows + target.host_rows


def _busy_worker(template: int, psutil: Any) -> int:
    """The host pid of the worker running the long ``hold`` call (the sibling whose call the others
    attack): the one asleep in nanosleep, where idle workers wait on their channel. (With
    --workspace-rw the template's child is the call's keeper, and the call runs in its child.)"""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            children = psutil.Process(template).children(recursive=True)
        except psutil.NoSuchProcess:
            raise RuntimeError(f"the template ({template}) is gone before the selfcheck's long call started") from None
        for child in children:
            with contextlib.suppress(OSError, psutil.Error), open(f"/proc/{child.pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return int(child.pid)
        time.sleep(0.02)
    raise RuntimeError("the selfcheck's long call did not start in a worker within 10 s")


def _is_template_exec(process: Any, psutil: Any) -> bool:
    """Whether ``process`` is a template started as a fresh interpreter (``-m executor.workers.template``)."""
    try:
        return "executor.workers.template" in process.cmdline()
    except psutil.Error:
        return False


def _keeper_of(worker: int, template: int, psutil: Any) -> int:
    """The keeper of a --workspace-rw worker (its parent, a child of the template), else 0."""
    parent = psutil.Process(worker).ppid()
    return parent if parent != template else 0


def _run_attempt(client: _Client, attempt: Attempt, ctx: Context) -> Row:
    row = Row(attempt.layer, attempt.name, attempt.expected)
    try:
        result = client.call(attempt.tool, attempt.args(ctx))
    except (TimeoutError, OSError) as e:
        row.observed = f"no answer: {e}"
        return row
    if attempt.error_kind is not None:
        kind = result.error.kind if result.error else None
        row.ok = kind == attempt.error_kind
        row.observed = f"error {kind}: {result.error.message}" if result.error else f"ALLOWED: {result.value!r}"
    elif result.error is not None:
        tail = result.stderr.strip().splitlines()[-1:] if result.stderr else []
        row.observed = f"the call failed: {result.error.kind}: {result.error.message} {' '.join(tail)}"[:300]
    else:
        row.ok = bool(attempt.judge(result.value))
        row.observed = json.dumps(result.value)[:300]
    if attempt.host_check is not None and (left := attempt.host_check(ctx)):
        row.ok, row.observed = False, left
    return row


def _host_rows(before: dict[str, Any], token: str, ours: tuple[str, ...]) -> list[Row]:
    """After the executor stopped: nothing of it may remain on the host (bounded wait for the
    kernel to finish tearing down what it killed). Its groups are those whose names hold its id
    (memory, pids, kill) or its template's pid (CPU): other executors may run meanwhile."""
    deadline = time.monotonic() + 10
    while True:
        after = _host_state()
        leftovers = {
            "processes": [_processes_left(token, 0)] if _processes_left(token, 0) else [],
            "mounts": sorted(set(after["mounts"]) - set(before["mounts"])),
            "groups": sorted(g for g in set(after["groups"]) - set(before["groups"]) if any(o in g for o in ours)),
            "shm": sorted(set(after["shm"]) - set(before["shm"])),
        }
        if not any(leftovers.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    rows = []
    for what, layer in (("processes", "pid-ns, cgroups"), ("mounts", "mount-ns"), ("groups", "cgroups"),
                        ("shm", "filesystem")):
        left = leftovers[what]
        rows.append(Row(layer, f"host after exit: no {what} left", "none",
                        "none" if not left else f"LEFT: {left[:5]}", not left))
    return rows


def format_table(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, k)) for r in rows) for k in ("layer", "attempt", "expected")]
    widths = [min(w, 60) for w in widths]
    lines = [f"{'layer':<{widths[0]}}  {'attempt':<{widths[1]}}  {'expected':<{widths[2]}}  observed"]
    for r in rows:
        mark = "ok  " if r.ok else "FAIL"
        lines.append(f"{r.layer:<{widths[0]}}  {r.attempt:<{widths[1]}}  {r.expected:<{widths[2]}}  "
                     f"{mark} {r.observed}")
    failed = sum(1 for r in rows if not r.ok)
    lines.append(f"{len(rows) - failed} of {len(rows)} attempts denied" + (f"; {failed} FAILED" if failed else ""))
    return "\n".join(lines)


def main(as_json: bool = False, quiet: bool = True, workspace_rw: bool = False) -> int:
    """``ciayn-executor selfcheck``: 0 only when every attempt was denied; 2 when the machine
    lacks layers (named)."""
    from executor.hardening import probe_all

    missing = probe_all()
    if missing:
        text = "; ".join(f"{k}: {v}" for k, v in missing.items())
        if as_json:
            print(json.dumps({"ok": False, "missing_layers": missing, "rows": []}))
        else:
            print(f"ciayn-executor selfcheck: this machine cannot give these layers: {text}", file=sys.stderr)
        return 2
    try:
        rows = run(quiet=quiet, workspace_rw=workspace_rw)
    except RuntimeError as e:
        print(f"ciayn-executor selfcheck: {e}", file=sys.stderr)
        return 1
    ok = all(r.ok for r in rows)
    if as_json:
        print(json.dumps({"ok": ok, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(format_table(rows))
    return 0 if ok else 1


def start_hardened(args: Any) -> int:
    """``serve --profile hardened``, before the supervisor starts: check the options, refuse when
    the machine lacks a layer (naming it), run the selfcheck, and build the profile, which the
    caller passes in as the workers' ``Confinement``. Returns 0 to go on, the profile then in
    ``args.confinement``; else the exit code."""
    import atexit

    from executor import hardening, overlay

    if getattr(args, "reuse_workers", False):
        print("ciayn-executor: --reuse-workers cannot be used with --profile hardened (every hardened call "
              "runs in a fresh worker)", file=sys.stderr)
        return 2
    if args.no_cgroups:
        print("ciayn-executor: --no-cgroups cannot be used with --profile hardened (its memory, process and CPU "
              "limits are control groups)", file=sys.stderr)
        return 2
    hide = [os.path.dirname(os.path.abspath(e[len("ipc://"):]))
            for e in (args.bind, getattr(args, "connect", None)) if e and e.startswith("ipc://") and e[6:7] != "@"]
    hide += [os.path.abspath(f) for f in (args.curve_secret,) if f]
    config = hardening.HardenedConfig(
        workspace=os.path.abspath(args.workspace or os.getcwd()), workspace_rw=args.workspace_rw,
        workspace_quota_mb=getattr(args, "workspace_quota", None) or overlay.DEFAULT_QUOTA_MB,
        max_result_kb=getattr(args, "max_result_kb", None) or hardening.HardenedConfig.max_result_kb,
        hide=tuple(hide), allow_degraded=args.allow_degraded)
    if problem := _workspace_problem(config):
        print(f"ciayn-executor: --profile hardened: {problem}", file=sys.stderr)
        return 2
    if config.workspace_rw and os.geteuid() == 0 and (problem := hardening.check_idmap(config.workspace)):
        print(f"ciayn-executor: --workspace-rw: the workspace {config.workspace} cannot be mounted for the "
              f"tools to write as its owner (an idmapped mount): {problem}", file=sys.stderr)
        return 1
    missing = hardening.probe_all()
    if missing:
        named = "; ".join(f"{k} ({v})" for k, v in missing.items())
        if not args.allow_degraded:
            print(f"ciayn-executor: --profile hardened refused: this machine cannot give these layers: {named}. "
                  "Fix that (run as root on a kernel with namespaces, cgroups, Landlock and seccomp) or, knowing "
                  "that tools are then less confined, add --allow-degraded.", file=sys.stderr)
            return 1
        _loud(f"DEGRADED: serving without these layers: {named}")
    if not args.skip_selfcheck:
        log = logging.getLogger("ciayn-executor")
        count = len(attempts(args.workspace_rw))
        log.info("hardened: selfcheck: %d escape attempts from a real worker, then checks of the host ...", count)
        started = time.monotonic()
        rows = run(workspace_rw=args.workspace_rw)
        failed = [r for r in rows if not r.ok]
        if not failed:
            log.info("hardened: selfcheck passed: %d attempts denied, the host left as it was (%.1f s)", count,
                     time.monotonic() - started)
        if failed:
            text = "\n".join(f"  {r.layer}: {r.attempt}: {r.observed}" for r in failed)
            if not args.allow_degraded:
                print(f"ciayn-executor: --profile hardened refused: the selfcheck got through {len(failed)} "
                      f"layer(s):\n{text}\n(`ciayn-executor selfcheck` shows the whole table; --allow-degraded "
                      "serves anyway)", file=sys.stderr)
                return 1
            _loud(f"DEGRADED: the selfcheck got through {len(failed)} attempt(s):\n{text}")
    sandbox = hardening.activate(config)
    atexit.register(sandbox.remove_groups)
    args.confinement = sandbox
    return 0


def _workspace_problem(config: Any) -> str | None:
    """Tools run as ``config.uid``: a read-only workspace must let others in; with --workspace-rw
    they act as its owner (an idmapped mount), who must be able to write it."""
    try:
        st = os.stat(config.workspace)
    except OSError as e:
        return f"cannot use the workspace: {e}"
    if config.workspace_rw:
        if unsafe := sorted(set(",:\\") & set(os.path.realpath(config.workspace))):
            return (f"--workspace-rw: the workspace's path {os.path.realpath(config.workspace)!r} holds "
                    f"{' '.join(unsafe)}, which an overlay's layer path cannot; choose another --workspace")
        if st.st_mode & 0o700 != 0o700:
            return (f"--workspace-rw: tools act as the owner of the workspace {config.workspace}, who cannot "
                    f"read, write and enter it (mode {st.st_mode & 0o777:o}); chmod u+rwx it")
        return None
    read = 0o500 if st.st_uid == config.uid else 0o005
    if st.st_mode & read != read:
        return (f"tools run as uid {config.uid}, who cannot read the workspace {config.workspace} (mode "
                f"{st.st_mode & 0o777:o}); make it readable by others (chmod o+rx), add --workspace-rw (tools "
                "then act as its owner in it), or choose another --workspace")
    return None


def _loud(text: str) -> None:
    bar = "!" * 78
    print(f"{bar}\nciayn-executor: {text}\nciayn-executor: tools are NOT fully confined (--allow-degraded)\n{bar}",
          file=sys.stderr)
