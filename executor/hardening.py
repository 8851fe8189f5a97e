"""The hardened profile: OS confinement for each worker, straight from the kernel interfaces.

``ciayn-executor serve --profile hardened`` puts every freshly forked worker into a sandbox before it
reads its call. Each layer below is one entry of ``LAYERS`` with a ``probe()`` (can this machine give
it? ``None``, or the reason it cannot) and an ``apply()`` (run in the worker, in table order); the
result's ``worker.layers`` lists the layers a call ran under, and ``executor.selfcheck`` attacks each
one from inside a real hardened worker.

Mechanism: no helper binary. The template calls ``unshare(CLONE_NEWPID)`` just before ``os.fork()``
and ``setns`` back just after, so the worker itself is PID 1 of a new PID namespace (no relay
process, Python's own fork bookkeeping intact, and SIGKILL to the worker ends everything it
started). The template builds the read-only root once, in a private mount namespace of its own
(nothing it mounts is ever visible to, or left on, the host); a worker then only unshares its other
namespaces, mounts its own ``/tmp``, ``/dev/shm`` and ``/proc`` and pivots into that root. Its
privileges go last: capability bounding set, uid/gid (no groups), ``no_new_privs``, Landlock and a
seccomp deny-list (classic BPF built once here: no libseccomp needed, and ``clone`` flags are
checked). bubblewrap or nsjail would cost an exec per worker, and with it the tool modules the
template already imported.

With ``--workspace-rw`` the forked worker is the call's *keeper* instead: it stays outside the
sandbox, mounts the call's upper layer in a mount namespace of its own, and forks the process that
is PID 1 of the new PID namespace, enters the sandbox and runs the call; afterwards it applies the
call's writes to the workspace within the quota (``executor.overlay``).

Layer order (each relies on the ones before it):

=============  =====================================================================================
pid-ns         own PID namespace: sees only itself; killing its init (the worker) ends all it started
cgroups        memory/pids groups (``executor.workers.cgroups``) checked, plus a CPU-rate group made here
mount-ns       own mount namespace (private propagation: nothing reaches the host)
net-ns         own network namespace with loopback down: no route, TCP/UDP/DNS fail
ipc-ns, uts-ns own System V IPC and hostname
cgroup-ns      ``/proc/self/cgroup`` shows ``/``: its groups' place is invisible
filesystem     read-only view of what tools need (``/usr``, ``/etc`` without shadow files, the
               interpreter, venv and tool modules, the workspace), size-capped tmpfs ``/tmp`` (the
               cwd) and ``/dev/shm``, own ``/proc`` with ``/proc/sys`` read-only, no ``/sys``, no
               home directories, no socket directory of the executor. With ``--workspace-rw`` the
               workspace is an overlay on an idmapped mount (in it the tools act as its owner) whose
               upper layer is the call's own tmpfs, capped at ``--workspace-quota``; the worker's
               keeper applies it after the call (``executor.overlay``)
rlimits        hard = soft for the limits not set per call (stack, address space, processes, ...)
capabilities   bounding, ambient and inheritable sets emptied
identity       unprivileged uid/gid (default nobody), no supplementary groups
no-new-privs   setuid binaries and file capabilities grant nothing
landlock       writes only under ``/tmp``, ``/dev/shm`` (and the workspace with ``--workspace-rw``);
               no TCP bind/connect; no signals or abstract sockets outside the sandbox
seccomp        ptrace, process_vm_*, pidfd_*, mount family, unshare/setns/namespace clones, bpf,
               perf_event_open, kexec, keyctl, raw and netlink sockets, io_uring, set-ID file
               modes, ... give EPERM
=============  =====================================================================================
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import platform
import resource
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor import overlay
from executor.workers import cgroups
from protocol.errors import CiaynError

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
CLONE_NEW_ANY = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                 | CLONE_NEWNET | CLONE_NEWTIME)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
AT_FDCWD, AT_RECURSIVE, AT_EMPTY_PATH = -100, 0x8000, 0x1000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH = 1, 0o2000000, 4

PR_SET_PDEATHSIG = 1
PR_SET_KEEPCAPS = 8
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2

# x86_64 syscall numbers (the seccomp filter and the raw calls below; other machines lack the layer)
NR = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_open": 434,
    "pidfd_send_signal": 424, "pidfd_getfd": 438, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "unshare": 272, "setns": 308, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 321,
    "perf_event_open": 298, "kexec_load": 246, "kexec_file_load": 320, "keyctl": 250, "add_key": 248,
    "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "acct": 163, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159,
    "clock_adjtime": 305, "quotactl": 179, "quotactl_fd": 443, "lookup_dcookie": 212, "userfaultfd": 323,
    "iopl": 172, "ioperm": 173, "syslog": 103, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "uselib": 134, "vhangup": 153, "kcmp": 312, "fanotify_init": 300, "mknod": 133, "mknodat": 259,
    "nfsservctl": 180,
}
NR_CLONE, NR_CLONE3, NR_SOCKET, NR_SOCKETPAIR, NR_IOCTL = 56, 435, 41, 53, 16
NR_LANDLOCK_CREATE_RULESET, NR_LANDLOCK_ADD_RULE, NR_LANDLOCK_RESTRICT_SELF = 444, 445, 446
DENIED_SYSCALLS = tuple(NR)  # the seccomp deny-list, by name (the selfcheck tries each)

STAGE = "/dev/shm"  # where the template mounts the root it builds (in its own mount namespace only)
SECRET_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")
DEVICES = ("null", "zero", "full", "random", "urandom")
NOBODY = 65534
TMPFS_INODES = 65536  # files in /tmp or /dev/shm: their inodes are kernel memory


class LayerError(CiaynError):
    """A layer could not be applied (in a worker) or is missing on this machine; names the layer."""

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(f"{layer}: {message}")
        self.layer = layer


def _check(layer: str, what: str, result: int) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise LayerError(layer, f"{what} failed: {os.strerror(err)} (errno {err})")
    return result


def _syscall(nr: int, *args: object) -> int:
    return int(_libc.syscall(ctypes.c_long(nr), *args))


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None,
           layer: str = "filesystem") -> None:
    _check(layer, f"mount {dst}", _libc.mount(
        src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None,
        ctypes.c_ulong(flags), data.encode() if data else None))


def _bind(src: str, dst: str, readonly: bool) -> None:
    _mount(src, dst, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0)
    _mount(None, dst, None, flags)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _readonly_tree(path: str) -> None:
    """Read-only and nosuid, recursively (one mount_setattr call for the whole tree)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check("filesystem", f"mount_setattr {path}", _syscall(
        442, ctypes.c_int(AT_FDCWD), path.encode(), ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr))))


def _prctl(layer: str, what: str, option: int, arg2: int = 0, arg3: object = 0) -> None:
    _check(layer, what, _libc.prctl(option, ctypes.c_ulong(arg2), arg3, ctypes.c_ulong(0), ctypes.c_ulong(0)))


# --------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class HardenedConfig:
    """What the hardened profile needs to know beyond the call limits."""

    workspace: str  # absolute; mounted read-only unless workspace_rw
    workspace_rw: bool = False  # then each call's writes are a transaction (``executor.overlay``)
    workspace_quota_mb: int = overlay.DEFAULT_QUOTA_MB  # with workspace_rw: the workspace's size after a call
    max_result_kb: int = 4096  # the executor's default (``Limits``): the largest reply a keeper holds
    hide: tuple[str, ...] = ()  # never visible inside: the executor's socket directory, its CurveZMQ key
    uid: int = NOBODY
    gid: int = NOBODY
    tmp_mb: int = 128  # /tmp (the cwd); tmpfs pages count against the memory group too
    shm_mb: int = 64  # /dev/shm
    cpu_cores: float = 1.0  # CPU rate per worker (cgroup cpu quota)
    allow_degraded: bool = False
    group_tag: str = field(default_factory=lambda: os.urandom(4).hex())  # names this executor's CPU groups


# --------------------------------------------------------------------------------------------------
# layers


@dataclass(frozen=True)
class Layer:
    """One isolation layer: ``probe()`` says whether the machine can give it (None) or why not;
    ``apply(sandbox)`` runs in the worker. Namespace layers only contribute ``flags`` to the one
    ``unshare`` call; ``pid-ns`` is applied by the template around the fork."""

    name: str
    denies: str
    probe: Callable[[], str | None]
    apply: Callable[[Sandbox], None] | None = None
    flags: int = 0


def _probe_root() -> str | None:
    return None if os.geteuid() == 0 else f"needs root (the executor runs as uid {os.geteuid()})"


def _probe_ns(kind: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        if os.geteuid() != 0:
            return "needs root"
        return None if os.path.exists(f"/proc/self/ns/{kind}") else f"the kernel has no {kind} namespaces"
    return probe


def _probe_x86_64() -> str | None:
    return None if platform.machine() == "x86_64" else f"syscall table only for x86_64, not {platform.machine()}"


def _probe_filesystem() -> str | None:
    return _probe_root() or _probe_x86_64() or (None if os.path.isdir(STAGE) else f"no {STAGE} to build the root on")


def _probe_cgroups() -> str | None:
    support = cgroups.CgroupSupport.detect()
    if support is None:
        return "no writable control groups (needs root and mounted cgroup hierarchies)"
    missing = [n for n, p in (("memory", support.memory_parent), ("pids", support.pids_parent)) if p is None]
    if _cpu_parent() is None and not _v2_delegates_cpu():
        missing.append("cpu")
    return f"no {', '.join(missing)} controller to nest groups under" if missing else None


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or not on x86_64)."""
    if platform.machine() != "x86_64":
        return 0
    return max(0, _syscall(NR_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def _probe_landlock() -> str | None:
    abi = landlock_abi()
    if abi == 0:
        return "the kernel has no Landlock (or it is disabled: lsm= boot parameter)"
    return None if abi >= 6 else f"Landlock ABI {abi} lacks network rules or scopes (needs 6)"


def _apply_cgroups(sb: Sandbox) -> None:
    """The memory and pids groups were joined by the worker code (``cgroups.Group.join``): check that
    it did (a worker outside them is refused), then put this worker under its CPU limit."""
    own, unified = {}, ""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        unified = path if controllers == "" else unified
        for c in controllers.split(","):
            own[c] = path
    for controller in ("memory", "pids"):  # v1 hierarchies, or the v2 group
        if not own.get(controller, unified).rsplit("/", 1)[-1].startswith(cgroups.PREFIX):
            raise LayerError("cgroups", f"the worker is not in a {controller} group of its own")
    if sb.cpu_group is not None:  # v1: a CPU group of its own
        (sb.cpu_group / "cgroup.procs").write_text("0")
        return
    group = _v2_root() / unified.lstrip("/")  # v2: one group for everything, its own already
    if not (group.name.startswith(cgroups.PREFIX) and (group / "cpu.max").exists()):
        raise LayerError("cgroups", "no CPU limit can be set for this worker")
    _limit_cpu(group, sb.config.cpu_cores)


def _apply_filesystem(sb: Sandbox) -> None:
    root = sb.root
    size = f"size={sb.config.tmp_mb}m,nr_inodes={TMPFS_INODES},mode=1777"
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size)
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={sb.config.shm_mb}m,nr_inodes={TMPFS_INODES},mode=1777")
    for src, dst, readonly in sb.late_binds:  # under /tmp: only now, on top of the new /tmp
        _mountpoint(root, dst)
        _bind(src, root + dst, readonly)
    if sb.staged_workspace:  # the idmapped workspace was bound from its staging place: drop that one
        _check("filesystem", "detach the staged workspace", _libc.umount2(sb.staged_workspace.encode(), MNT_DETACH))
    for hidden in sb.late_hides:
        _hide(root, hidden)
    if sb.keeper:
        _mount_overlay(sb)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _bind(root + "/proc/sys", root + "/proc/sys", readonly=True)
    os.chdir(root)
    _check("filesystem", "pivot_root", _syscall(NR["pivot_root"], b".", b"."))
    _check("filesystem", "detach the old root", _libc.umount2(b".", MNT_DETACH))
    os.chdir("/tmp")
    # The cwd is scratch now (tools find the workspace by name); home and temp are the scratch too.
    os.environ.update({"CIAYN_WORKSPACE": sb.config.workspace, "HOME": "/tmp", "TMPDIR": "/tmp"})


def _mount_overlay(sb: Sandbox) -> None:
    """``--workspace-rw``: the workspace becomes an overlay whose upper layer is the call's tmpfs (the
    keeper mounted it; its own mount is dropped here, so the tools reach it only through the
    overlay). Hidden paths inside the workspace are hidden again on top (an overlay layer does not
    show the mounts under its directory)."""
    workspace = os.path.realpath(sb.config.workspace)
    lower, upper = sb.root + workspace, sb.root + overlay.UPPER
    _mount("overlay", lower, "overlay", MS_NOSUID | MS_NODEV,
           f"lowerdir={lower},upperdir={upper}/upper,workdir={upper}/work,{overlay.OVERLAY_OPTIONS}")
    _check("filesystem", "detach the call's upper layer", _libc.umount2(upper.encode(), MNT_DETACH))
    _check("filesystem", "detach the keepers' tally", _libc.umount2((sb.root + overlay.TALLY).encode(), MNT_DETACH))
    for hidden in sb.config.hide:
        if _under(os.path.realpath(hidden), workspace):
            _hide(sb.root, os.path.realpath(hidden))


def _apply_capabilities(sb: Sandbox) -> None:
    _prctl("capabilities", "keep no capabilities across setuid", PR_SET_KEEPCAPS, 0)
    for cap in range(sb.cap_last + 1):
        _prctl("capabilities", f"drop capability {cap} from the bounding set", PR_CAPBSET_DROP, cap)
    _prctl("capabilities", "clear ambient capabilities", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _apply_identity(sb: Sandbox) -> None:
    try:
        os.setgroups([])
        os.setresgid(sb.config.gid, sb.config.gid, sb.config.gid)
        os.setresuid(sb.config.uid, sb.config.uid, sb.config.uid)
    except OSError as e:
        raise LayerError("identity", f"cannot become uid {sb.config.uid}: {e}") from None
    # The uid change cleared the effective and permitted sets; clear the inheritable one too.
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check("capabilities", "capset", _libc.capset(ctypes.byref(header), data))
    # It also cleared the parent-death signal (the kernel does on a uid change): set it again, or a
    # call running when its keeper (or the template) is killed would run on, reparented to init.
    _prctl("identity", "die with the parent again", PR_SET_PDEATHSIG, signal.SIGKILL)


# Limits the executor does not set per call: clamped here (hard = soft) so no tool can lift them.
# CPU, data, file size, open files and core are the call limits' (``executor.workers.limits``).
FIXED_RLIMITS = ("RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE",
                 "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_RTTIME", "RLIMIT_SIGPENDING", "RLIMIT_LOCKS")


def _apply_rlimits(sb: Sandbox) -> None:
    for name in FIXED_RLIMITS:
        which = getattr(resource, name, None)
        if which is not None:
            soft, _ = resource.getrlimit(which)
            resource.setrlimit(which, (soft, soft))


def _apply_no_new_privs(sb: Sandbox) -> None:
    _prctl("no-new-privs", "PR_SET_NO_NEW_PRIVS", PR_SET_NO_NEW_PRIVS, 1)


# Landlock (raw syscalls: the PyPI binding covers file rights only, not network rules or scopes)
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_MAKE_CHAR, LL_MAKE_SOCK, LL_MAKE_FIFO, LL_MAKE_BLOCK = 64, 512, 1024, 2048
LL_FS_ABI1 = (1 << 13) - 1
LL_REFER, LL_TRUNCATE, LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1, 2
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1, 2


def _landlock_fs_rights(abi: int) -> int:
    rights = LL_FS_ABI1
    if abi >= 2:
        rights |= LL_REFER
    if abi >= 3:
        rights |= LL_TRUNCATE
    if abi >= 5:
        rights |= LL_IOCTL_DEV
    return rights


def _apply_landlock(sb: Sandbox) -> None:
    abi = landlock_abi()
    fs = _landlock_fs_rights(abi)
    attr = struct.pack("=QQQ", fs, LL_NET_BIND_TCP | LL_NET_CONNECT_TCP,
                       LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check("landlock", "landlock_create_ruleset",
                     _syscall(NR_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)))
    try:
        # The shared workspace takes files and directories, no sockets, FIFOs or devices (no
        # rendezvous there for calls running side by side, nothing for the host to trip on).
        special = LL_MAKE_SOCK | LL_MAKE_FIFO | LL_MAKE_CHAR | LL_MAKE_BLOCK
        writable = [("/tmp", fs), ("/dev/shm", fs)]
        writable += [(sb.config.workspace, fs & ~special)] if sb.config.workspace_rw else []
        rules = [("/", LL_EXECUTE | LL_READ_FILE | LL_READ_DIR),
                 ("/dev", LL_READ_FILE | LL_WRITE_FILE | (LL_IOCTL_DEV if abi >= 5 else 0))]
        rules += writable
        for path, rights in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                _check("landlock", f"landlock_add_rule {path}", _syscall(
                    NR_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0)))
            finally:
                os.close(fd)
        _check("landlock", "landlock_restrict_self",
               _syscall(NR_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)))
    finally:
        os.close(ruleset)


# seccomp: a classic BPF deny-list, assembled once
_BPF_LD_ABS, _BPF_JEQ, _BPF_JGE, _BPF_JSET, _BPF_AND, _BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
AUDIT_ARCH_X86_64 = 0xC000003E
# Socket families a tool may open: UNIX, IPv4, IPv6 (the network namespace has no route for the
# last two). Everything else (netlink, packet, vsock: the VM's channel to its host, AF_ALG, ...) EPERM.
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
SOCK_RAW, SOCK_PACKET, SOCK_TYPE_MASK = 3, 10, 0xF
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# Calls that take a file mode, and which argument holds it: a mode with S_ISUID/S_ISGID is refused.
# With --workspace-rw the tools act as the workspace's owner (often root) there, and a setuid file
# they made would be a setuid-root file on the host. (Writing to a file clears those bits anyway.)
MODE_ARG = {90: 1, 91: 1, 85: 1, 2: 2, 268: 2, 452: 2, 257: 3}  # chmod fchmod creat open fchmodat fchmodat2 openat
SETID_BITS = 0o6000
EPERM, ENOSYS = 1, 38


def seccomp_program() -> bytes:
    """The filter as ``struct sock_filter[]``: wrong architecture kills; x32 calls, the deny-list,
    namespace flags on ``clone``, sockets other than UNIX/IPv4/IPv6 and raw ones, terminal injection
    and set-ID file modes get EPERM;
    ``clone3`` gets ENOSYS (its flags cannot be inspected; libc falls back to ``clone``)."""
    prog: list[tuple[int, int | str, int | str, int]] = []  # (code, jt, jf, k); str = a label

    def op(code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        prog.append((code, jt, jf, k))

    labels: dict[str, int] = {}
    op(_BPF_LD_ABS, 4)  # arch
    op(_BPF_JEQ, AUDIT_ARCH_X86_64, 1, 0)
    op(_BPF_RET, SECCOMP_RET_KILL_PROCESS)
    op(_BPF_LD_ABS, 0)  # nr
    op(_BPF_JGE, 0x40000000, "deny", 0)
    for name in DENIED_SYSCALLS:
        op(_BPF_JEQ, NR[name], "deny", 0)
    op(_BPF_JEQ, NR_CLONE, "clone", 0)
    op(_BPF_JEQ, NR_CLONE3, "enosys", 0)
    op(_BPF_JEQ, NR_SOCKET, "socket", 0)
    op(_BPF_JEQ, NR_SOCKETPAIR, "socket", 0)
    op(_BPF_JEQ, NR_IOCTL, "ioctl", 0)
    for nr, arg in MODE_ARG.items():
        op(_BPF_JEQ, nr, f"mode{arg}", 0)
    op(_BPF_RET, SECCOMP_RET_ALLOW)
    for arg in sorted(set(MODE_ARG.values())):  # a file mode with set-user/group-ID bits
        labels[f"mode{arg}"] = len(prog)
        op(_BPF_LD_ABS, 16 + 8 * arg)
        op(_BPF_JSET, SETID_BITS, "deny", 0)
        op(_BPF_RET, SECCOMP_RET_ALLOW)
    labels["clone"] = len(prog)
    op(_BPF_LD_ABS, 16)  # args[0], low word: the flags
    op(_BPF_JSET, CLONE_NEW_ANY, "deny", 0)
    op(_BPF_RET, SECCOMP_RET_ALLOW)
    labels["socket"] = len(prog)  # socket and socketpair: an allow-list of families
    op(_BPF_LD_ABS, 16)  # domain
    for family in SOCKET_FAMILIES:
        op(_BPF_JEQ, family, "socket_type", 0)
    op(_BPF_RET, SECCOMP_RET_ERRNO | EPERM)
    labels["socket_type"] = len(prog)
    op(_BPF_LD_ABS, 24)  # type
    op(_BPF_AND, SOCK_TYPE_MASK)
    op(_BPF_JEQ, SOCK_RAW, "deny", 0)
    op(_BPF_JEQ, SOCK_PACKET, "deny", 0)
    op(_BPF_RET, SECCOMP_RET_ALLOW)
    labels["ioctl"] = len(prog)
    op(_BPF_LD_ABS, 24)  # request
    op(_BPF_JEQ, TIOCSTI, "deny", 0)
    op(_BPF_JEQ, TIOCLINUX, "deny", 0)
    op(_BPF_RET, SECCOMP_RET_ALLOW)
    labels["enosys"] = len(prog)
    op(_BPF_RET, SECCOMP_RET_ERRNO | ENOSYS)
    labels["deny"] = len(prog)
    op(_BPF_RET, SECCOMP_RET_ERRNO | EPERM)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        jt_n = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf_n = labels[jf] - i - 1 if isinstance(jf, str) else jf
        assert 0 <= jt_n < 256 and 0 <= jf_n < 256, "BPF jump out of range"
        out += struct.pack("=HBBI", code, jt_n, jf_n, k)
    return bytes(out)


_SECCOMP_PROGRAM = seccomp_program()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _apply_seccomp(sb: Sandbox) -> None:
    buf = ctypes.create_string_buffer(_SECCOMP_PROGRAM, len(_SECCOMP_PROGRAM))
    fprog = _SockFprog(len(_SECCOMP_PROGRAM) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _prctl("seccomp", "load the seccomp filter", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog))


LAYERS: tuple[Layer, ...] = (
    Layer("pid-ns", "seeing or signalling any process outside the call; outliving it", _probe_ns("pid")),
    Layer("cgroups", "memory, process count and CPU rate past the limits", _probe_cgroups, _apply_cgroups),
    Layer("mount-ns", "changing the host's mounts", _probe_ns("mnt"), flags=CLONE_NEWNS),
    Layer("net-ns", "any network, loopback included", _probe_ns("net"), flags=CLONE_NEWNET),
    Layer("ipc-ns", "System V IPC and POSIX queues of the host", _probe_ns("ipc"), flags=CLONE_NEWIPC),
    Layer("uts-ns", "the host's hostname", _probe_ns("uts"), flags=CLONE_NEWUTS),
    Layer("cgroup-ns", "seeing its control groups", _probe_ns("cgroup"), flags=CLONE_NEWCGROUP),
    Layer("filesystem", "writes outside /tmp and /dev/shm; homes, shadow files, sockets, /sys",
          _probe_filesystem, _apply_filesystem),
    Layer("rlimits", "lifting the process limits the executor does not set per call", lambda: None,
          _apply_rlimits),
    Layer("capabilities", "every capability", _probe_root, _apply_capabilities),
    Layer("identity", "root's files and processes", _probe_root, _apply_identity),
    Layer("no-new-privs", "privileges from setuid binaries", lambda: None, _apply_no_new_privs),
    Layer("landlock", "writes outside scratch, TCP, signals out", _probe_landlock, _apply_landlock),
    Layer("seccomp", "ptrace, process_vm_*, pidfd_*, mount, unshare, bpf, raw sockets, io_uring, ...",
          _probe_x86_64, _apply_seccomp),
)
LAYER_NAMES = tuple(layer.name for layer in LAYERS)


def probe_all() -> dict[str, str]:
    """The layers this machine cannot give, with the reason for each (empty: all of them)."""
    missing = {}
    for layer in LAYERS:
        try:
            reason = layer.probe()
        except OSError as e:
            reason = str(e)
        if reason is not None:
            missing[layer.name] = reason
    return missing


# --------------------------------------------------------------------------------------------------
# composition


def _cpu_parent() -> Path | None:
    """Where this executor's per-worker CPU groups go: under its own group of the v1 ``cpu``
    hierarchy. (Without one, a v2 tree that delegates ``cpu`` gets the limit on each worker's own
    v2 group instead: a process is in one v2 group only.)"""
    own = cgroups._own_path("cpu")
    if own is None:
        return None
    parent = cgroups.ROOT / "cpu" / own.lstrip("/")
    return parent if (parent / "cpu.cfs_quota_us").exists() and os.access(parent, os.W_OK) else None


def _v2_root() -> Path:
    return cgroups.ROOT / "unified" if (cgroups.ROOT / "unified" / "cgroup.procs").exists() else cgroups.ROOT


def _v2_delegates_cpu() -> bool:
    own = cgroups._own_path("")
    with contextlib.suppress(OSError):
        return "cpu" in (_v2_root() / (own or "/").lstrip("/") / "cgroup.subtree_control").read_text().split()
    return False


def _limit_cpu(group: Path, cores: float) -> None:
    period = 100_000
    quota = max(1000, int(period * cores))
    if (group / "cpu.max").exists():  # v2
        (group / "cpu.max").write_text(f"{quota} {period}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))


class Sandbox:
    """The hardened profile's state in the template (the root it built, the CPU groups of its
    workers) and, after a fork, in the worker that enters it."""

    def __init__(self, config: HardenedConfig, layers: tuple[Layer, ...]) -> None:
        self.config = config
        self.layers = layers
        self.names = [layer.name for layer in layers]
        self.root = STAGE
        self.prepared = False
        self.late_binds: list[tuple[str, str, bool]] = []  # (source, target in the view, read-only)
        self.staged_workspace = ""  # an idmapped workspace under /tmp waits here for each worker
        self.late_hides: list[str] = []
        self.cap_last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        self.own_pidns = -1
        self.cpu_group: Path | None = None
        self.cpu_groups: dict[int, Path] = {}  # worker pid -> its CPU group (template side)
        self.free_cpu_groups: list[Path] = []  # empty ones, of workers gone: the next workers take them
        self.count = 0
        self.timings: dict[str, float] = {}  # layer -> seconds, in the worker that entered
        # --workspace-rw: each worker is a keeper outside the sandbox plus the sandboxed process that
        # runs the call, whose writes the keeper applies afterwards (``executor.overlay``)
        self.keeper = config.workspace_rw and "filesystem" in self.names

    # ---------------------------------------------------------------- template side

    def before_fork(self) -> None:
        """In the template, just before forking a worker: build the root once, remove the CPU
        groups of dead workers, make this worker's, and point the next child at a new PID
        namespace."""
        if not self.prepared:
            self._prepare()
        self._sweep_cpu_groups(dead_only=True)
        self.cpu_group = None
        if "cgroups" in self.names:
            parent = _cpu_parent()
            if self.free_cpu_groups:
                self.cpu_group = self.free_cpu_groups.pop()
            elif parent is not None:
                self.count += 1
                group = parent / f"{cgroups.PREFIX}{self.config.group_tag}-{os.getpid()}-{self.count}"
                with contextlib.suppress(FileExistsError):
                    group.mkdir()
                _limit_cpu(group, self.config.cpu_cores)
                self.cpu_group = group
        if "pid-ns" in self.names:
            # Back to its own namespace first, in case a fork failed after the last unshare (a second
            # unshare(CLONE_NEWPID) before any child would be refused with EINVAL).
            _check("pid-ns", "setns back", _libc.setns(self.own_pidns, CLONE_NEWPID))
            if not self.keeper:  # else the keeper makes it for the process it forks
                _check("pid-ns", "unshare(CLONE_NEWPID)", _libc.unshare(CLONE_NEWPID))

    def after_fork(self, pid: int) -> None:
        """In the template, right after the fork: later children start in its own PID namespace
        again (setns back), and the new worker's CPU group is remembered for removal."""
        if "pid-ns" in self.names:
            _check("pid-ns", "setns back", _libc.setns(self.own_pidns, CLONE_NEWPID))
        if self.cpu_group is not None:
            self.cpu_groups[pid] = self.cpu_group

    def _prepare(self) -> None:
        """Once, in the template: a private mount namespace and, in it, the read-only root."""
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self._sweep_cpu_groups(dead_only=False)
        if "filesystem" in self.names:
            _check("mount-ns", "unshare(CLONE_NEWNS) in the template", _libc.unshare(CLONE_NEWNS))
            _mount(None, "/", None, MS_REC | MS_PRIVATE, layer="mount-ns")
            self._build_root()
        self.prepared = True

    def _build_root(self) -> None:
        root = self.root
        _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for name in ("tmp", "proc", "dev", "dev/shm", "sys", "run", "home", "var", ".ciayn-empty"):
            os.makedirs(f"{root}/{name}", exist_ok=True)
        for name in sorted(os.listdir("/")):  # merged /usr: bin, lib, lib64, sbin are symlinks
            if os.path.islink(f"/{name}"):
                os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")
        for node in DEVICES:
            Path(f"{root}/dev/{node}").touch()
            _mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)  # a device node: no nodev
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
        os.symlink("/proc/self/fd", f"{root}/dev/fd")
        empty = f"{root}/.ciayn-empty/file"
        Path(empty).touch(mode=0)
        os.chmod(empty, 0)
        workspace = os.path.realpath(self.config.workspace)
        rw = self.config.workspace_rw
        for src in _view_roots(workspace, self.config.hide):
            if not _under(src, "/tmp"):
                _mountpoint(root, src)  # the rw workspace's too
                if not (src == workspace and rw):
                    _mount(src, root + src, None, MS_BIND | MS_REC)
        for secret in SECRET_FILES:
            if os.path.isfile(root + secret):
                _mount(empty, root + secret, None, MS_BIND)
        for hidden in self.config.hide:
            hidden = os.path.realpath(hidden)
            if _under(hidden, "/tmp"):
                self.late_hides.append(hidden)
            else:
                _hide(root, hidden)
        if rw and _under(workspace, "/tmp"):
            os.makedirs(root + "/.ciayn-workspace")
        if self.keeper:
            os.makedirs(root + overlay.UPPER)
            os.makedirs(root + overlay.TALLY)
        _readonly_tree(root)
        if self.keeper:  # one tmpfs for this executor's keepers (their mount namespaces copy it), root's only
            _mount("tmpfs", root + overlay.TALLY, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=64k,nr_inodes=16,mode=0700")
        late = [src for src in _view_roots(workspace, self.config.hide) if _under(src, "/tmp")]
        self.late_binds = [(src, src, True) for src in late if not (src == workspace and rw)]
        if rw:  # the tools act as the workspace's owner in it: an idmapped mount, files stay its owner's
            st = os.stat(workspace)
            userns = _idmap_userns((st.st_uid, self.config.uid), (st.st_gid, self.config.gid))
            try:
                if _under(workspace, "/tmp"):
                    self.staged_workspace = root + "/.ciayn-workspace"
                    _idmapped_bind(workspace, self.staged_workspace, userns)
                    self.late_binds.append((self.staged_workspace, workspace, False))
                else:
                    _idmapped_bind(workspace, root + workspace, userns)
            finally:
                os.close(userns)

    def _sweep_cpu_groups(self, dead_only: bool) -> None:
        """Take back the CPU groups of workers that are gone (``dead_only``), or at start remove
        stale ones any executor left (empty and older than ``cgroups.SWEEP_MIN_AGE``)."""
        if dead_only:  # ... and keep them for the next workers: no mkdir, rmdir or limit to write again
            for pid, group in list(self.cpu_groups.items()):
                if os.path.exists(f"/proc/{pid}"):
                    continue  # alive (or not reaped yet): it may not even have joined its group
                with contextlib.suppress(OSError):
                    if not (group / "cgroup.procs").read_text().strip():  # what it started is gone too
                        del self.cpu_groups[pid]
                        self.free_cpu_groups.append(group)
            return
        parent = _cpu_parent()
        if parent is None:
            return
        cutoff = time.time() - cgroups.SWEEP_MIN_AGE
        for child in parent.glob(f"{cgroups.PREFIX}*"):
            with contextlib.suppress(OSError):
                if child.stat().st_mtime < cutoff:
                    child.rmdir()

    def to_wire(self) -> dict[str, Any]:
        """This profile as plain data, for a template started afresh (``restore``)."""
        return {"module": __name__, "state": {"config": dataclasses.asdict(self.config), "layers": list(self.names)}}

    def remove_groups(self) -> None:
        """At the executor's exit: remove every CPU group this executor made (they are empty by
        then) and, with ``--workspace-rw``, what a keeper killed mid-apply by the stop left in the
        workspace (``overlay.recover``)."""
        remove_cpu_groups(self.config.group_tag)
        if self.keeper:
            overlay.recover(os.path.realpath(self.config.workspace), self.root + overlay.TALLY + "/workspace-size")

    # ---------------------------------------------------------------- worker side

    def enter(self) -> list[str]:
        """In a freshly forked worker, before it reads its call: apply every layer, in order.
        Returns the names of the layers applied; raises ``LayerError`` naming the one that failed.
        With ``--workspace-rw`` this process first becomes the call's keeper: only the process it
        forks returns from here."""
        t0 = time.perf_counter()
        if self.keeper:
            self._split()
        flags = 0
        for layer in self.layers:
            flags |= layer.flags
        for layer in self.layers:
            start = time.perf_counter()
            if layer.name == "mount-ns" and flags:  # one unshare for every namespace layer
                _check("mount-ns", "unshare", _libc.unshare(flags))
            if layer.apply is not None:
                try:
                    layer.apply(self)
                except OSError as e:
                    raise LayerError(layer.name, str(e)) from None
            self.timings[layer.name] = time.perf_counter() - start
        self.timings["total"] = time.perf_counter() - t0
        return list(self.names)


    def _split(self) -> None:
        """Become the keeper (``executor.overlay.Keeper``) of this worker's call: a mount namespace of
        its own holding the call's upper layer (a tmpfs capped at the quota), and a child, PID 1 of a
        new PID namespace, that takes over the channel, enters the sandbox and returns from here to
        run the call. The keeper never returns."""
        chan_fd = _channel_fd()
        _check("mount-ns", "unshare(CLONE_NEWNS) for the call's upper layer", _libc.unshare(CLONE_NEWNS))
        upper = self.root + overlay.UPPER
        quota = self.config.workspace_quota_mb * overlay.MB
        _mount("tmpfs", upper, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={quota},nr_inodes={quota // overlay.BLOCK + 16},mode=0700")
        workspace = os.path.realpath(self.config.workspace)
        os.mkdir(upper + "/upper")
        os.chmod(upper + "/upper", stat.S_IMODE(os.stat(workspace).st_mode))
        os.chown(upper + "/upper", self.config.uid, self.config.gid)  # the tools own the merged root
        os.mkdir(upper + "/work", 0o700)
        keeper_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if "pid-ns" in self.names:
            _check("pid-ns", "unshare(CLONE_NEWPID)", _libc.unshare(CLONE_NEWPID))
        pid = os.fork()
        if pid == 0:
            os.dup2(child_end.fileno(), chan_fd, inheritable=False)  # the worker code's channel, now to the keeper
            keeper_end.close()
            child_end.close()
            _prctl("pid-ns", "die with the keeper", PR_SET_PDEATHSIG, signal.SIGKILL)
            return
        child_end.close()
        try:
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
            # The worker's file size limit stays: the call could not write a larger file either.
            _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
            overlay.Keeper(socket.socket(fileno=chan_fd), keeper_end, pid, upper + "/upper", workspace, quota,
                           self.config.max_result_kb, pid_namespace="pid-ns" in self.names,
                           tally=self.root + overlay.TALLY + "/workspace-size").run()
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(70)


def _channel_fd() -> int:
    """The worker's channel: the one socket it holds (``executor.workers.worker`` closed every other
    descriptor but stdio before entering the sandbox)."""
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                sockets.append(fd)
    if len(sockets) != 1:
        raise LayerError("filesystem", f"expected one channel socket in a new worker, found {len(sockets)}")
    return sockets[0]


def remove_cpu_groups(tag: str) -> None:
    parent = _cpu_parent()
    if parent is None:
        return
    for child in parent.glob(f"{cgroups.PREFIX}{tag}-*"):
        cgroups.Group(child, None, None).remove()


def _idmap_userns(uid: tuple[int, int], gid: tuple[int, int]) -> int:
    """A user namespace (its fd) for an idmapped mount showing files of ``uid[0]``/``gid[0]`` as
    owned by ``uid[1]``/``gid[1]`` (and files those write as owned by ``uid[0]``/``gid[0]``). A
    child holds the namespace while its maps are written, then exits."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        ok = _libc.unshare(CLONE_NEWUSER) == 0
        os.read(r, 1)
        os._exit(0 if ok else 1)
    os.close(r)
    try:
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user"):
            if time.monotonic() > deadline:
                raise LayerError("filesystem", "the helper for the workspace's id mapping did not start")
            time.sleep(0.001)
        Path(f"/proc/{pid}/uid_map").write_text(f"{uid[0]} {uid[1]} 1")
        Path(f"/proc/{pid}/gid_map").write_text(f"{gid[0]} {gid[1]} 1")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def _idmapped_bind(src: str, dst: str, userns: int) -> None:
    """Bind ``src`` at ``dst`` through the id mapping of ``userns`` (open_tree, mount_setattr, move_mount)."""
    tree = _check("filesystem", f"open_tree {src}", _syscall(
        NR["open_tree"], ctypes.c_int(AT_FDCWD), src.encode(), ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)))
    try:
        attr = _MountAttr(MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, userns)
        _check("filesystem", f"id-map {src}", _syscall(
            442, ctypes.c_int(tree), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr))))
        _check("filesystem", f"move_mount {dst}", _syscall(
            NR["move_mount"], ctypes.c_int(tree), b"", ctypes.c_int(AT_FDCWD), dst.encode(),
            ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)))
    finally:
        os.close(tree)


def _mountpoint(root: str, path: str) -> None:
    """Make the directory ``root + path`` in the view, never through a symlink (one could lead out
    of the view, onto the host)."""
    current = root
    for part in path.strip("/").split("/"):
        current = f"{current}/{part}"
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise LayerError("filesystem", f"cannot show {path} in the view: {current[len(root):]} is not a directory")


def check_idmap(workspace: str, uid: int = NOBODY, gid: int = NOBODY) -> str | None:
    """Whether the workspace's filesystem takes the idmapped mount ``--workspace-rw`` needs (not all
    do, e.g. NFS), and an overlay on top of it (``executor.overlay``): tried in a child with a mount
    namespace of its own. None, or why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        message = b""
        try:
            _check("mount-ns", "unshare(CLONE_NEWNS)", _libc.unshare(CLONE_NEWNS))
            _mount(None, "/", None, MS_REC | MS_PRIVATE, layer="mount-ns")
            st = os.stat(workspace)
            userns = _idmap_userns((st.st_uid, uid), (st.st_gid, gid))
            _idmapped_bind(workspace, workspace, userns)
            _mount("tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")  # only in this namespace
            for name in ("upper", "work"):
                os.mkdir(f"{STAGE}/{name}")
            _mount("overlay", workspace, "overlay", MS_NOSUID | MS_NODEV,
                   f"lowerdir={workspace},upperdir={STAGE}/upper,workdir={STAGE}/work,{overlay.OVERLAY_OPTIONS}")
        except BaseException as e:
            message = str(e).encode()[:1000]
        os.write(w, message)
        os._exit(0)
    os.close(w)
    try:
        reason = os.read(r, 1000).decode(errors="replace")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return reason or None


def _hide(root: str, path: str) -> None:
    """Cover ``path`` inside the view, if the view shows it: an empty directory or an empty file."""
    if os.path.isdir(root + path):
        _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0")
    elif os.path.lexists(root + path):
        _mount(f"{root}/.ciayn-empty/file", root + path, None, MS_BIND)


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _view_roots(workspace: str, hide: tuple[str, ...]) -> list[str]:
    """The host directories a worker sees (read-only unless it is the writable workspace): system
    files, the interpreter and venv (and the ``sys.path`` entries inside them), every directory a
    module was imported from, the workspace. Not ``sys.path`` as such: ``python -m`` puts the
    working directory there, often a home directory. Nested ones are dropped (their parent shows
    them)."""
    prefixes = {sys.base_prefix, sys.prefix, sys.exec_prefix}
    wanted = {"/usr", "/etc", workspace, *prefixes}
    for entry in sys.path:
        if entry and os.path.isdir(entry) and any(_under(os.path.realpath(entry), os.path.realpath(p))
                                                  for p in prefixes):
            wanted.add(entry)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path):
            wanted.add(os.path.dirname(path))
    real = {os.path.realpath(p) for p in wanted}
    real = {p for p in real if os.path.isdir(p) and p != "/" and not _under(p, STAGE) and not _under(p, "/proc")}
    roots = sorted(p for p in real if not any(q != p and _under(p, q) for q in real))
    if workspace in real and workspace not in roots:
        roots.append(workspace)  # its own mount even under a parent shown read-only (rw, or hidden parts)
    return [r for r in roots if not any(_under(r, os.path.realpath(h)) for h in hide)]


# --------------------------------------------------------------------------------------------------
# the profile of this executor


def activate(config: HardenedConfig) -> Sandbox:
    """The hardened profile for this executor's workers (the CLI builds it before the template is
    forked, and passes it in as the workers' ``Confinement``). Refuses, naming them, when layers
    are missing, unless degraded mode was asked for: then the missing ones are left out and the
    result's ``worker.layers`` says so."""
    missing = probe_all()
    if missing and not config.allow_degraded:
        raise LayerError(", ".join(missing), "; ".join(f"{k}: {v}" for k, v in missing.items()))
    return Sandbox(config, tuple(layer for layer in LAYERS if layer.name not in missing))


def restore(state: dict[str, Any]) -> Sandbox:
    """The profile ``Sandbox.to_wire`` described, with the same layers (already probed, and checked
    by the selfcheck, in the process that described it): in a template started afresh."""
    config = dict(state["config"])
    config["hide"] = tuple(config.get("hide", ()))
    names = set(state["layers"])
    return Sandbox(HardenedConfig(**config), tuple(layer for layer in LAYERS if layer.name in names))
