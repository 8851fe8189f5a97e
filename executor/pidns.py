"""The template and its workers in a PID namespace of their own, in every profile where the machine
allows it (``CAP_SYS_ADMIN``: root, as on CI).

The supervisor calls ``unshare(CLONE_NEWPID)`` just before it forks a template and ``setns`` back
just after, so the template is PID 1 of a new namespace and every worker, and all a tool starts, is
in it. From there a tool cannot address the supervisor, the controller or any other process of its
user by pid: ``kill``, ``pidfd_open`` and ``kill(-1)`` resolve pids in the caller's namespace, and a
``/proc/PID`` descriptor of an outside process is refused by ``pidfd_send_signal``. The template is
its namespace's init, which the kernel spares every signal sent from inside that it has no handler
for (``SIGKILL`` and ``SIGSTOP`` included), and when the template dies the kernel kills everything
left in the namespace, ``CLONE_PARENT`` children of children included.

The template mounts a ``/proc`` of its namespace (in a mount namespace of its own that host mounts
still propagate into, and nothing propagates out of), so that its and its workers' ``/proc`` reads
name the same processes their ``kill`` calls do, and a tool sees only the namespace's processes. It
keeps a descriptor of the host's ``/proc`` to translate a worker's pid into the one the supervisor
uses (``HostPids``): the supervisor, the log and a result's ``worker.pid`` always give host pids.

Where the namespace cannot be made (no ``CAP_SYS_ADMIN``), the template runs in the executor's
namespace as before, and the executor logs at start-up that a tool can signal the executor's
processes there.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 0x80000
FAILED = "pid-ns: "  # a template's LoadFailed message that starts so: it could not set its namespace up


class _Unavailable(Exception):
    pass


_own_ns = -1  # the supervisor's own PID namespace, kept open to setns back into
_why_not: str | None = None  # set once unshare was refused: the reason, and no further tries


def isolate_next_child() -> bool:
    """In the supervisor, just before ``os.fork()``: the child will be PID 1 of a new PID namespace.
    False (and nothing changed) where the machine refuses it; ``why_not()`` says why."""
    global _own_ns, _why_not
    if _why_not is not None:
        return False
    try:
        if _own_ns < 0:
            _own_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        _setns(_own_ns)  # in case an earlier fork failed after the unshare (a second one is EINVAL)
        if _libc.unshare(CLONE_NEWPID) != 0:
            raise _Unavailable(f"unshare(CLONE_NEWPID): {os.strerror(ctypes.get_errno())}")
    except (OSError, _Unavailable) as e:
        _why_not = str(e)
        return False
    return True


def restore() -> None:
    """In the supervisor, right after the fork: its later children start in its own namespace."""
    _setns(_own_ns)


def refuse(reason: str) -> None:
    """Make no more namespaces (a template could not set one up: ``reason``)."""
    global _why_not
    _why_not = reason


def why_not() -> str | None:
    """Why templates run in the executor's own PID namespace, or None if they do not."""
    return _why_not


def _setns(fd: int) -> None:
    if fd >= 0 and _libc.setns(fd, CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), f"setns back into the executor's PID namespace: "
                      f"{os.strerror(ctypes.get_errno())}")


def in_own_namespace() -> bool:
    """In a template: whether it is PID 1 of the namespace the supervisor made for it."""
    return os.getpid() == 1 and os.getppid() == 0


class HostPids:
    """In a template that is PID 1 of its namespace: the host pid of each worker it forks."""

    def __init__(self, host_proc: int) -> None:
        self.proc = host_proc  # a descriptor of the host's /proc, opened before ours was mounted
        self.me = int(os.readlink("self", dir_fd=host_proc))
        # Our namespace's place in the NSpid lines of the host's /proc (the host's pid first, then
        # one per nested namespace): ours ends with 1; a hardened worker's has one more, its own.
        self.level = len(_nspid(_read(host_proc, f"{self.me}/status"))) - 1
        self.known: dict[int, int] = {}  # our pid -> host pid, for the workers alive

    def of(self, pid: int) -> int:
        """The host pid of our child ``pid`` (just forked, alive or a zombie); remembered until
        ``forget``. Raises ``OSError`` if it is not among our children."""
        taken = set(self.known.values())
        children = _read(self.proc, f"{self.me}/task/{self.me}/children").split()
        for host in (int(c) for c in children):
            if host in taken:
                continue
            try:
                status = _read(self.proc, f"{host}/status")
            except OSError:
                continue
            nspid = _nspid(status)
            if len(nspid) > self.level and nspid[self.level] == pid:
                self.known[pid] = host
                return host
        raise OSError(f"child {pid} is not among the template's children in the host's /proc")

    def forget(self, pid: int) -> int:
        """The host pid of a child that died (0 if it was never ours)."""
        return self.known.pop(pid, 0)

    def host_pid(self) -> int:
        return self.me


def _nspid(status: bytes) -> list[int]:
    """The pids of a task's NSpid line (``/proc/PID/status``), outermost namespace first."""
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def _read(dir_fd: int, path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def set_up_template() -> HostPids:
    """In a template that is PID 1 of its namespace, first thing: a mount namespace of its own
    (slave: host mounts still come in, nothing goes out), and in it a ``/proc`` of the new PID
    namespace. Raises ``OSError`` with what failed."""
    host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    pids = HostPids(host_proc)
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"{FAILED}unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
    if _libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None) != 0:
        raise OSError(ctypes.get_errno(), f"{FAILED}making / a slave mount: {os.strerror(ctypes.get_errno())}")
    if _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        raise OSError(ctypes.get_errno(), f"{FAILED}mounting /proc: {os.strerror(ctypes.get_errno())}")
    return pids
