"""Who the worker is once confined: the layers ``rlimits``, ``capabilities``, ``identity`` and
``no-new-privs``.

Each ``apply_*`` runs in the worker, in the order of ``executor.sandbox.layers.LAYERS``: hard
rlimits clamped to the soft ones, every capability dropped (bounding, ambient, inheritable), an
unprivileged uid/gid without supplementary groups, and ``no_new_privs``. Raises ``LayerError``.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal

from executor.sandbox.kernel import (
    PR_CAP_AMBIENT,
    PR_CAP_AMBIENT_CLEAR_ALL,
    PR_CAPBSET_DROP,
    PR_SET_KEEPCAPS,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    LayerError,
    check,
    libc,
    prctl,
)

NOBODY = 65534

# Limits the executor does not set per call: clamped here (hard = soft) so no tool can lift them.
# CPU, data, file size, open files and core are the call limits' (``executor.workers.limits``).
FIXED_RLIMITS = ("RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE",
                 "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_RTTIME", "RLIMIT_SIGPENDING", "RLIMIT_LOCKS")


def probe_root() -> str | None:
    return None if os.geteuid() == 0 else f"needs root (the executor runs as uid {os.geteuid()})"


def apply_rlimits() -> None:
    for name in FIXED_RLIMITS:
        which = getattr(resource, name, None)
        if which is not None:
            soft, _ = resource.getrlimit(which)
            resource.setrlimit(which, (soft, soft))


def apply_capabilities(cap_last: int) -> None:
    """Empty the bounding and ambient sets (capabilities 0 to ``cap_last``, the kernel's last)."""
    prctl("capabilities", "keep no capabilities across setuid", PR_SET_KEEPCAPS, 0)
    for cap in range(cap_last + 1):
        prctl("capabilities", f"drop capability {cap} from the bounding set", PR_CAPBSET_DROP, cap)
    prctl("capabilities", "clear ambient capabilities", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def apply_identity(uid: int, gid: int) -> None:
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise LayerError("identity", f"cannot become uid {uid}: {e}") from None
    # The uid change cleared the effective and permitted sets; clear the inheritable one too.
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    check("capabilities", "capset", libc.capset(ctypes.byref(header), data))
    # It also cleared the parent-death signal (the kernel does on a uid change): set it again, or a
    # call running when its keeper (or the template) is killed would run on, reparented to init.
    prctl("identity", "die with the parent again", PR_SET_PDEATHSIG, signal.SIGKILL)


def apply_no_new_privs() -> None:
    prctl("no-new-privs", "PR_SET_NO_NEW_PRIVS", PR_SET_NO_NEW_PRIVS, 1)
