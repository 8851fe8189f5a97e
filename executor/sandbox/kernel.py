"""The kernel interfaces the sandbox calls directly: the C library, x86_64 syscall numbers, the flag
constants, ``LayerError``, and the checked ``syscall``/``prctl`` every layer uses.

The bottom of ``executor.sandbox``: it imports nothing else of it, so no module of the sandbox can
close a circle through it.
"""

from __future__ import annotations

import ctypes
import os

from executor.workers import processes
from protocol.errors import CiaynError

libc = processes.libc  # the one handle on the C library (``executor.workers.processes``)

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

# x86_64 syscall numbers (the seccomp filter and the raw calls; other machines lack those layers)
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
}  # every one of these is on the seccomp deny-list (``executor.sandbox.seccomp``)
NR_CLONE, NR_CLONE3, NR_SOCKET, NR_SOCKETPAIR, NR_IOCTL = 56, 435, 41, 53, 16
NR_LANDLOCK_CREATE_RULESET, NR_LANDLOCK_ADD_RULE, NR_LANDLOCK_RESTRICT_SELF = 444, 445, 446


class LayerError(CiaynError):
    """A layer could not be applied (in a worker) or is missing on this machine; names the layer."""

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(f"{layer}: {message}")
        self.layer = layer


def check(layer: str, what: str, result: int) -> int:
    """``result`` of a C call, or ``LayerError`` naming ``layer`` and the errno when it is negative."""
    if result < 0:
        err = ctypes.get_errno()
        raise LayerError(layer, f"{what} failed: {os.strerror(err)} (errno {err})")
    return result


def syscall(nr: int, *args: object) -> int:
    return int(libc.syscall(ctypes.c_long(nr), *args))


def prctl(layer: str, what: str, option: int, arg2: int = 0, arg3: object = 0) -> None:
    check(layer, what, libc.prctl(option, ctypes.c_ulong(arg2), arg3, ctypes.c_ulong(0), ctypes.c_ulong(0)))
