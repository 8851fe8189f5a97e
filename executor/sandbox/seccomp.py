"""The ``seccomp`` layer: a classic BPF deny-list, assembled once here (no libseccomp).

``apply`` loads it in the worker, last of all layers. The filter kills a call of another
architecture; gives EPERM to x32 calls, the syscalls of ``DENIED_SYSCALLS``, namespace flags on
``clone``, sockets other than UNIX/IPv4/IPv6 and raw ones, terminal injection and set-ID file modes;
and ENOSYS to ``clone3`` (its flags cannot be inspected; libc falls back to ``clone``).
"""

from __future__ import annotations

import ctypes
import platform
import struct

from executor.sandbox.kernel import (
    CLONE_NEW_ANY,
    NR,
    NR_CLONE,
    NR_CLONE3,
    NR_IOCTL,
    NR_SOCKET,
    NR_SOCKETPAIR,
    PR_SET_SECCOMP,
    SECCOMP_MODE_FILTER,
    prctl,
)

DENIED_SYSCALLS = tuple(NR)  # the deny-list, by name (the selfcheck tries each)

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


def probe_x86_64() -> str | None:
    return None if platform.machine() == "x86_64" else f"syscall table only for x86_64, not {platform.machine()}"


class _Program:
    """A BPF program being written: instructions whose jumps may name a label, resolved by ``bytes``."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int | str, int | str, int]] = []  # (code, jt, jf, k); str = a label
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        self.ops.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.ops)

    def bytes(self) -> bytes:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.ops):
            jt_n = self.labels[jt] - i - 1 if isinstance(jt, str) else jt
            jf_n = self.labels[jf] - i - 1 if isinstance(jf, str) else jf
            assert 0 <= jt_n < 256 and 0 <= jf_n < 256, "BPF jump out of range"
            out += struct.pack("=HBBI", code, jt_n, jf_n, k)
        return bytes(out)


def seccomp_program() -> bytes:
    """The filter as ``struct sock_filter[]`` (see the module's docstring for what it refuses)."""
    p = _Program()
    p.op(_BPF_LD_ABS, 4)  # arch
    p.op(_BPF_JEQ, AUDIT_ARCH_X86_64, 1, 0)
    p.op(_BPF_RET, SECCOMP_RET_KILL_PROCESS)
    p.op(_BPF_LD_ABS, 0)  # nr
    p.op(_BPF_JGE, 0x40000000, "deny", 0)
    for name in DENIED_SYSCALLS:
        p.op(_BPF_JEQ, NR[name], "deny", 0)
    p.op(_BPF_JEQ, NR_CLONE, "clone", 0)
    p.op(_BPF_JEQ, NR_CLONE3, "enosys", 0)
    p.op(_BPF_JEQ, NR_SOCKET, "socket", 0)
    p.op(_BPF_JEQ, NR_SOCKETPAIR, "socket", 0)
    p.op(_BPF_JEQ, NR_IOCTL, "ioctl", 0)
    for nr, arg in MODE_ARG.items():
        p.op(_BPF_JEQ, nr, f"mode{arg}", 0)
    p.op(_BPF_RET, SECCOMP_RET_ALLOW)
    _argument_checks(p)
    p.label("enosys")
    p.op(_BPF_RET, SECCOMP_RET_ERRNO | ENOSYS)
    p.label("deny")
    p.op(_BPF_RET, SECCOMP_RET_ERRNO | EPERM)
    return p.bytes()


def _argument_checks(p: _Program) -> None:
    """The labelled checks of a call's arguments: file modes, ``clone`` flags, socket families and
    types, ``ioctl`` requests."""
    for arg in sorted(set(MODE_ARG.values())):  # a file mode with set-user/group-ID bits
        p.label(f"mode{arg}")
        p.op(_BPF_LD_ABS, 16 + 8 * arg)
        p.op(_BPF_JSET, SETID_BITS, "deny", 0)
        p.op(_BPF_RET, SECCOMP_RET_ALLOW)
    p.label("clone")
    p.op(_BPF_LD_ABS, 16)  # args[0], low word: the flags
    p.op(_BPF_JSET, CLONE_NEW_ANY, "deny", 0)
    p.op(_BPF_RET, SECCOMP_RET_ALLOW)
    p.label("socket")  # socket and socketpair: an allow-list of families
    p.op(_BPF_LD_ABS, 16)  # domain
    for family in SOCKET_FAMILIES:
        p.op(_BPF_JEQ, family, "socket_type", 0)
    p.op(_BPF_RET, SECCOMP_RET_ERRNO | EPERM)
    p.label("socket_type")
    p.op(_BPF_LD_ABS, 24)  # type
    p.op(_BPF_AND, SOCK_TYPE_MASK)
    p.op(_BPF_JEQ, SOCK_RAW, "deny", 0)
    p.op(_BPF_JEQ, SOCK_PACKET, "deny", 0)
    p.op(_BPF_RET, SECCOMP_RET_ALLOW)
    p.label("ioctl")
    p.op(_BPF_LD_ABS, 24)  # request
    p.op(_BPF_JEQ, TIOCSTI, "deny", 0)
    p.op(_BPF_JEQ, TIOCLINUX, "deny", 0)
    p.op(_BPF_RET, SECCOMP_RET_ALLOW)


_SECCOMP_PROGRAM = seccomp_program()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def apply_seccomp() -> None:
    buf = ctypes.create_string_buffer(_SECCOMP_PROGRAM, len(_SECCOMP_PROGRAM))
    fprog = _SockFprog(len(_SECCOMP_PROGRAM) // 8, ctypes.cast(buf, ctypes.c_void_p))
    prctl("seccomp", "load the seccomp filter", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog))
