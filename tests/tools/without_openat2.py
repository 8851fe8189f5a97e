"""A kernel without openat2, for one executor: imported (``--tools`` before the built-in toolkit) in
the template, it installs a seccomp filter that answers openat2 with ENOSYS, as a kernel before 5.6
would. The template and every worker it forks inherit it; the supervisor does not.

x86-64 only (the filter checks the architecture and lets any other one through unchanged)."""

from __future__ import annotations

import ctypes
import struct

from executor import tool

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW, ENOSYS = 0x00050000, 0x7FFF0000, 38
AUDIT_ARCH_X86_64, SYS_OPENAT2 = 0xC000003E, 437
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _hide_openat2() -> None:
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (BPF_JEQ_K, 0, 1, SYS_OPENAT2),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    code = b"".join(struct.pack("=HBBI", op, jt, jf, k) for op, jt, jf, k in program)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(program), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
        PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0
    ) != 0:
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter that hides openat2")


_hide_openat2()


@tool
def openat2_errno() -> int:
    """The errno a raw openat2 gets in this worker (38, ENOSYS, when the filter holds)."""
    from executor.toolkits.paths import AT_FDCWD, openat2

    try:
        openat2(AT_FDCWD, ".", 0)
    except OSError as e:
        return e.errno or 0
    return 0
