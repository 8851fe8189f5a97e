"""What the executor's own processes keep from the tools they run, in every profile: their initial
environment strings (``scrub_initial_environment`` overwrites what ``/proc/PID/environ`` shows), their
memory and descriptors (``not_dumpable``: no ptrace, ``/proc/PID/mem`` or ``pidfd_getfd`` by a tool
of the same user), and the secrets ``serve`` started with (``reexec_without_secrets``). As root, a
worker of the default profile must not hold ``CAP_SYS_PTRACE`` (which ignores ``not_dumpable``),
``CAP_SYS_RESOURCE`` or ``HOST_ADMIN_CAPS``: ``drop_capabilities`` takes them away for good.
Why and how: docs/executor.md#privacy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

from executor.workers.processes import PR_SET_DUMPABLE
from executor.workers.processes import libc as _libc
from executor.workers.procfs import stat_fields

_capget, _capset = _libc.capget, _libc.capset  # looked up at import (in the template), not in each worker


def not_dumpable() -> None:
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _environ_region() -> tuple[int, int] | None:
    """The (start, end) addresses of this process's initial environment strings."""
    try:
        fields = stat_fields("/proc/self/stat")
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51
    except (OSError, IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def scrub_initial_environment() -> bool:
    """Overwrite the initial environment strings, so ``/proc/PID/environ`` shows nothing. Every
    variable still set is first copied to the heap (``setenv`` allocates), so ``getenv`` keeps
    working. Returns whether the region was overwritten."""
    for key, value in list(os.environ.items()):
        with contextlib.suppress(ValueError, OSError):
            os.putenv(key, value)
    region = _environ_region()
    if region is None:
        return False
    start, end = region
    ctypes.memset(start, 0, end - start)
    return True


CAP_SYS_PTRACE = 19
CAP_SYS_RESOURCE = 24
# What a root worker of the default profile gives up besides those two: the rights over the machine
# itself, none of which a tool needs to read, write and run things as root, and each of which breaks
# out of the executor: mounts and namespaces (unmount the namespace's /proc, bind over what later
# calls read), reboot (kills a PID namespace's init), kernel modules, raw I/O and device nodes (the
# disks), BPF and perf (a program that signals any process), the clock, the network's configuration,
# security modules, the audit log and the kernel log.
HOST_ADMIN_CAPS = {
    "CAP_MKNOD": 27, "CAP_NET_ADMIN": 12, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_ADMIN": 21,
    "CAP_SYS_BOOT": 22, "CAP_SYS_TIME": 25, "CAP_AUDIT_CONTROL": 30, "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34, "CAP_PERFMON": 38, "CAP_BPF": 39,
    # ...and what reaches other calls or the executor's scheduling: process accounting (acct(2)
    # records every later call's processes), real-time priorities and other processes' nice values,
    # immutable files, System V IPC of others, checkpoint/restore, the terminal, alarms and suspend.
    "CAP_SYS_PACCT": 20, "CAP_SYS_NICE": 23, "CAP_LINUX_IMMUTABLE": 9, "CAP_IPC_OWNER": 15,
    "CAP_CHECKPOINT_RESTORE": 40, "CAP_SYS_TTY_CONFIG": 26, "CAP_WAKE_ALARM": 35, "CAP_BLOCK_SUSPEND": 36,
}
PR_CAPBSET_DROP = 24
_CAP_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities(*caps: int) -> bool:
    """Take ``caps`` out of this process's bounding, permitted, effective and inheritable sets, for
    good (nothing it execs gets them back). A worker of an executor running as root drops
    ``CAP_SYS_PTRACE`` (so it cannot trace, read or take descriptors from the executor's other, non-
    dumpable processes) and ``CAP_SYS_RESOURCE`` (so it cannot lift its hard limits). Returns whether
    it held any of them; a process without them has nothing to drop."""
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    if _capget(ctypes.byref(header), data) != 0:
        return False
    held = any(data[c // 32].permitted & (1 << (c % 32)) for c in caps)
    for c in caps:
        _libc.prctl(PR_CAPBSET_DROP, c, 0, 0, 0)  # EPERM without CAP_SETPCAP: then it was not ours to drop
        word, bit = c // 32, 1 << (c % 32)
        data[word].effective &= ~bit
        data[word].permitted &= ~bit
        data[word].inheritable &= ~bit
    if held and _capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed while dropping capabilities")
    return held


# What the interpreter needs to start from a source checkout; never handed to tools (the template
# applies the tools' allowlist again).
_INTERPRETER_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV")
_REEXEC_MARK = "CIAYN_EXECUTOR_REEXEC"


def reexec_without_secrets(pass_env: list[str]) -> None:
    """Start this executor again in a fresh interpreter whose environment is only the allowlist.

    A worker is a fork of the template, itself a fork of this process: everything this process
    ever held is in a tool's address space, where deleting ``os.environ`` entries does not reach
    (the kernel's copy at the top of the stack, freed strings on the heap). The selfcheck found an
    API key there by scanning the worker's own memory. After the exec it was never in memory. Only
    for ``ciayn-executor serve``; a no-op when the environment holds nothing beyond the allowlist
    (as when ``ciayn`` or ``LocalExecutor`` start the executor)."""
    from protocol.environment import allowed_environment

    keep = allowed_environment(os.environ, pass_env)
    keep.update({k: os.environ[k] for k in _INTERPRETER_ENV if k in os.environ})
    if os.environ.get(_REEXEC_MARK) == "1" or set(keep) == set(os.environ) or sys.argv[1:2] != ["serve"]:
        os.environ.pop(_REEXEC_MARK, None)
        return
    keep[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "executor.cli", *sys.argv[1:]], keep)
