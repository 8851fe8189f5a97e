"""The ``landlock`` layer (raw syscalls: the PyPI binding covers file rights only, not network
rules or scopes).

``apply_landlock`` runs in the worker: reads and executes anywhere, writes only under ``/tmp``,
``/dev/shm`` and, with ``--workspace-rw``, the workspace (files and directories there, no sockets,
FIFOs or devices); no TCP bind or connect; no signals or abstract sockets outside the sandbox.
Needs Landlock ABI 6 (``probe_landlock``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

from executor.sandbox.kernel import (
    NR_LANDLOCK_ADD_RULE,
    NR_LANDLOCK_CREATE_RULESET,
    NR_LANDLOCK_RESTRICT_SELF,
    check,
    syscall,
)

LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_MAKE_CHAR, LL_MAKE_SOCK, LL_MAKE_FIFO, LL_MAKE_BLOCK = 64, 512, 1024, 2048
LL_FS_ABI1 = (1 << 13) - 1
LL_REFER, LL_TRUNCATE, LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1, 2
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1, 2


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or not on x86_64)."""
    if platform.machine() != "x86_64":
        return 0
    return max(0, syscall(NR_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def probe_landlock() -> str | None:
    abi = landlock_abi()
    if abi == 0:
        return "the kernel has no Landlock (or it is disabled: lsm= boot parameter)"
    return None if abi >= 6 else f"Landlock ABI {abi} lacks network rules or scopes (needs 6)"


def _fs_rights(abi: int) -> int:
    rights = LL_FS_ABI1
    if abi >= 2:
        rights |= LL_REFER
    if abi >= 3:
        rights |= LL_TRUNCATE
    if abi >= 5:
        rights |= LL_IOCTL_DEV
    return rights


def apply_landlock(writable_workspace: str | None) -> None:
    """Restrict this process as the module says; ``writable_workspace`` with ``--workspace-rw``."""
    abi = landlock_abi()
    fs = _fs_rights(abi)
    attr = struct.pack("=QQQ", fs, LL_NET_BIND_TCP | LL_NET_CONNECT_TCP,
                       LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = check("landlock", "landlock_create_ruleset",
                    syscall(NR_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)))
    try:
        # The shared workspace takes files and directories, no sockets, FIFOs or devices (no
        # rendezvous there for calls running side by side, nothing for the host to trip on).
        special = LL_MAKE_SOCK | LL_MAKE_FIFO | LL_MAKE_CHAR | LL_MAKE_BLOCK
        writable = [("/tmp", fs), ("/dev/shm", fs)]
        writable += [(writable_workspace, fs & ~special)] if writable_workspace else []
        rules = [("/", LL_EXECUTE | LL_READ_FILE | LL_READ_DIR),
                 ("/dev", LL_READ_FILE | LL_WRITE_FILE | (LL_IOCTL_DEV if abi >= 5 else 0))]
        rules += writable
        for path, rights in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                check("landlock", f"landlock_add_rule {path}", syscall(
                    NR_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0)))
            finally:
                os.close(fd)
        check("landlock", "landlock_restrict_self",
              syscall(NR_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)))
    finally:
        os.close(ruleset)
