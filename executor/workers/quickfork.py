"""Forking a worker without Python's after-fork hooks, where that is safe. ``fork`` calls the C
library's ``fork()`` directly (and reseeds ``random``) when the template has one thread and nothing
in it registered an after-fork hook (``watch_hooks``, installed before the tool modules are
imported, records that); anywhere else it is ``os.fork()``. A worker is then spared the pages those
hooks would copy. Why and how: docs/executor.md#the-bare-fork.
"""

from __future__ import annotations

import ctypes
import os
import posix
import sys
from collections.abc import Callable
from typing import Any

_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL is held across the call
_libc.fork.restype = ctypes.c_int
_tool_hooks: list[str] = []  # the modules (by caller) that registered after-fork hooks while tools were imported


def watch_hooks() -> Callable[[], None]:
    """In the template, before the tool modules are imported, for the rest of its life: note every
    ``os.register_at_fork`` call (a thread a module left may register one after its import), which
    then makes ``fork`` use ``os.fork()`` so the hooks run. Returns what undoes it (for tests)."""
    real: Callable[..., Any] = posix.register_at_fork  # os's is the same function

    def register(**hooks: Any) -> None:
        frame = sys._getframe(1)
        _tool_hooks.append(str(frame.f_globals.get("__name__", "?")))
        real(**hooks)

    os.register_at_fork = posix.register_at_fork = register

    def undo() -> None:
        os.register_at_fork = posix.register_at_fork = real

    return undo


def why_not() -> str:
    """Why ``fork`` must use ``os.fork()`` now ("" if it need not)."""
    if _tool_hooks:
        return f"tool modules registered after-fork hooks ({', '.join(sorted(set(_tool_hooks)))})"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "/proc/self/task cannot be read"
    if threads != 1:
        return f"the template has {threads} threads"
    threading = sys.modules.get("threading")
    if threading is not None and (len(threading._active) != 1 or threading._limbo):
        # An entry for a thread that is gone (a _DummyThread of a foreign thread, say): only
        # os.fork()'s threading hook rebuilds the table in the child.
        return "the template's threading module lists threads other than its own"
    return ""


def fork() -> int:
    """``os.fork()``'s result: 0 in the child, the child's pid in the parent."""
    if why_not():
        return os.fork()
    pid: int = _libc.fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fork: {os.strerror(err)}")
    if pid == 0:
        rng = sys.modules.get("random")
        if rng is not None:
            rng.seed()  # what random's own after-fork hook does: a worker draws numbers of its own
    return pid
