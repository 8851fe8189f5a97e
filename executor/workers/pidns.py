"""The template and its workers in a PID namespace of their own, in every profile where the machine
allows it: as root by ``unshare(CLONE_NEWPID)`` around the template's fork (``isolate_next_child``,
``restore``); as any other user in a user namespace that maps only its own uid and gid, with a relay
process left between supervisor and template (``enter_user_namespace``). The template mounts its
namespace's ``/proc`` first (``set_up_child``), so a tool can address no process outside by pid, and
``HostPids`` gives the supervisor host pids; the template never holds a descriptor of the host's
``/proc``. Where neither way works, the template shares the executor's namespace and the executor
logs that at start-up. Why and how: docs/executor.md#the-pid-namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import NoReturn

from executor.workers.processes import libc as _libc

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_REC, MS_SLAVE = 0x4000, 0x80000
FAILED = "pid-ns: "  # a template's LoadFailed message that starts so: it could not set its namespace up


class _Unavailable(Exception):
    pass


_own_ns = -1  # the supervisor's own PID namespace, kept open to setns back into
_why_not: str | None = None  # set once the root way was refused: the reason, and no further tries
_refused: str | None = None  # set once a template could not set its namespace up: no more tries at all
user_namespace = False  # in a template (and its workers) made in a user namespace of its own


def isolate_next_child() -> bool:
    """In the supervisor, just before ``os.fork()``: the child will be PID 1 of a new PID namespace.
    False (and nothing changed) where the machine refuses it (not root)."""
    global _own_ns, _why_not
    if _why_not is not None or _refused is not None:
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


def why_not() -> str:
    """Why a template forked now would not be PID 1 of a namespace of its own by the root way."""
    return _refused or _why_not or ""


def try_user_namespace() -> bool:
    """In the supervisor: whether a template it forks now should try ``enter_user_namespace``."""
    return _refused is None and _why_not is not None


def refused() -> bool:
    """Whether namespaces were turned off (``refuse``)."""
    return _refused is not None


def refuse(reason: str) -> None:
    """Make no more namespaces (a template could not set one up: ``reason``)."""
    global _refused
    _refused = reason


def _setns(fd: int) -> None:
    if fd >= 0 and _libc.setns(fd, CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), f"setns back into the executor's PID namespace: "
                      f"{os.strerror(ctypes.get_errno())}")


def in_own_namespace() -> bool:
    """In a template: whether it is PID 1 of the namespace made for it."""
    return os.getpid() == 1 and os.getppid() == 0


def enter_user_namespace() -> str:
    """In the child the supervisor just forked (one thread): make a user namespace of our own uid
    and gid and a PID namespace in it, and fork the template there. Returns only in the template
    (PID 1 of the new namespace), with "" ; or, if the kernel refuses, in this same process, which
    is then the template in the executor's namespace, with the reason. The forked-from process
    stays as the relay and never returns."""
    global user_namespace
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(CLONE_NEWUSER) != 0:
        return f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}"
    user_namespace = True  # from here on we hold capabilities in it: workers must drop them
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
    except OSError as e:
        return f"mapping our uid in a user namespace: {e.strerror}"
    if _libc.unshare(CLONE_NEWPID) != 0:
        return f"unshare(CLONE_NEWPID) in a user namespace: {os.strerror(ctypes.get_errno())}"
    template = os.fork()
    if template == 0:
        return ""
    _relay(template)


def _relay(template: int) -> NoReturn:
    """The process between the supervisor and a template in a user namespace: dies with the
    supervisor (the template dies with us), exits when the template does, holds nothing."""
    with contextlib.suppress(OSError):
        os.closerange(3, 1 << 16)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 1
    while True:
        try:
            _, status = os.waitpid(template, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        code = os.waitstatus_to_exitcode(status)
        break
    os._exit(code if code >= 0 else 128 - code)


class HostPids:
    """In the supervisor, for a template that is PID 1 of its namespace: the host pid of each
    worker it reports (by its pid in that namespace). The template holds no descriptor of the host's
    ``/proc``: a root tool could take it from the template (``/proc/1/fd``) and read host processes
    through it."""

    def __init__(self, template: int) -> None:
        self.template = template  # its host pid
        # Its namespace's place in NSpid lines (the host's pid first, then one per nested namespace):
        # its own ends with 1; a hardened worker's has one more entry, its own namespace's.
        self.level = len(_nspid(_read(f"/proc/{template}/status"))) - 1
        self.known: dict[int, int] = {}  # pid in the namespace -> host pid, for the workers alive

    def of(self, pid: int) -> int:
        """The host pid of the template's child ``pid`` (just forked, alive or a zombie); remembered
        until ``forget``. 0 if it is not among the template's children (gone already)."""
        taken = set(self.known.values())
        try:
            children = _read(f"/proc/{self.template}/task/{self.template}/children", whole=True).split()
        except OSError:
            return 0
        for host in (int(c) for c in children):
            if host in taken:
                continue
            try:
                nspid = _nspid(_read(f"/proc/{host}/status"))
            except OSError:
                continue
            if len(nspid) > self.level and nspid[self.level] == pid:
                self.known[pid] = host
                return host
        return 0

    def remember(self, pid: int, host: int) -> None:
        """Note the host pid of worker ``pid``, learnt from its pidfd (``pid_of_pidfd``)."""
        self.known[pid] = host

    def forget(self, pid: int) -> int:
        """The host pid of a worker that died (0 if it was never seen)."""
        return self.known.pop(pid, 0)


def pid_of_pidfd(fd: int) -> int | None:
    """The pid, in our namespace, of the process a pidfd refers to (its ``fdinfo``'s ``Pid:``
    line): 0 if that process is gone, None if the kernel does not say (older than 5.x)."""
    try:
        info = _read(f"/proc/self/fdinfo/{fd}", whole=True)
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith(b"Pid:"):
            try:
                pid = int(line.split()[1])
            except (IndexError, ValueError):
                return None
            return pid if pid > 0 else 0
    return None


def template_in(relay_or_template: int) -> int:
    """The host pid of the template the supervisor forked (``relay_or_template``): that process if
    it is PID 1 of its namespace, else its child that is (a template in a user namespace has a relay
    above it); 0 if neither."""
    try:
        if _nspid(_read(f"/proc/{relay_or_template}/status"))[1:2] == [1]:
            return relay_or_template
        children = _read(f"/proc/{relay_or_template}/task/{relay_or_template}/children").split()
        for child in (int(c) for c in children):
            if _nspid(_read(f"/proc/{child}/status"))[1:2] == [1]:
                return child
    except OSError:
        pass
    return 0


def _nspid(status: bytes) -> list[int]:
    """The pids of a task's NSpid line (``/proc/PID/status``), outermost namespace first."""
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def _read(path: str, whole: bool = False) -> bytes:
    """A /proc file's first 64 KiB, or (``whole``) all of it: a template's ``children`` list is as
    long as the processes a tool parked there with ``CLONE_PARENT``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 1 << 16)
        if whole:
            parts = [data]
            while chunk := os.read(fd, 1 << 16):
                parts.append(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def set_up_child() -> None:
    """In a template that is PID 1 of its namespace, first thing (before it execs, if it does): a
    mount namespace of its own (slave: host mounts still come in, nothing goes out), and in it a
    ``/proc`` of the new PID namespace. Raises ``OSError`` with what failed."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"{FAILED}unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
    if _libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None) != 0:
        raise OSError(ctypes.get_errno(), f"{FAILED}making / a slave mount: {os.strerror(ctypes.get_errno())}")
    if _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        raise OSError(ctypes.get_errno(), f"{FAILED}mounting /proc: {os.strerror(ctypes.get_errno())}")
    # The kernel's settings stay out of a root tool's reach (core_pattern runs a program as the
    # host's root; sysrq-trigger crashes or reboots the machine). Workers lack the right to undo it.
    for path in (b"/proc/sys", b"/proc/sysrq-trigger"):
        if not os.path.exists(path):
            continue  # (a kernel without magic SysRq)
        if (_libc.mount(path, path, None, MS_BIND, None) != 0
                or _libc.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0):
            raise OSError(ctypes.get_errno(), f"{FAILED}making {path.decode()} read-only: "
                          f"{os.strerror(ctypes.get_errno())}")
