"""Processes on the far side of the fork: the C library once, ``prctl``, descriptors, and killing
what a process left behind.

Used by the template, the workers and the sandbox, and by the supervisor for what a dead template
left; it imports nothing of the executor but ``procfs``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import time

from executor.workers import procfs

libc = ctypes.CDLL(None, use_errno=True)  # the one handle on the C library (``executor.workers.quickfork``
#                                           keeps a ``PyDLL`` of its own: it must hold the GIL across fork)

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
KILL_WAIT = 1.0  # seconds kill_children waits for what it killed to die
SHUTDOWN_WAIT = 0.2  # ...and at shutdown, where the supervisor waits for its template only so long


def close_fds_except(*keep: int) -> None:
    """Close every descriptor of this process except ``keep`` (and nothing below 0)."""
    lo = 0
    for fd in [*sorted(k for k in set(keep) if k >= 0), max(max_fd(), max(keep, default=0) + 1)]:
        if fd > lo:  # never an empty range: closerange(n, n) closes everything from n on
            os.closerange(lo, fd)
        lo = fd + 1


def max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if 0 < soft < 1 << 20 else 1 << 20


def prctl(option: int, value: int) -> None:
    """``prctl(option, value)``; its result is not checked (every use here is best effort or
    checked by its caller's behaviour)."""
    libc.prctl(option, value, 0, 0, 0)


def child_pids() -> list[int]:
    """Direct children of this process, from /proc (cheap: no full /proc scan)."""
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                pids.extend(map(int, procfs.read(f"/proc/self/task/{tid}/children").split()))
            except OSError:
                continue
    except OSError:
        pass
    return pids


def has_children() -> bool:
    """Whether any child (running or a zombie) exists: one waitpid, no /proc reads. As a subreaper,
    the worker inherits every orphan of the call, so "no child" means nothing was left behind."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True  # running children (pid 0), or one zombie just reaped: look closer


def kill_children(keep: frozenset[int] = frozenset(), wait: float = KILL_WAIT) -> int:
    """SIGKILL and reap every child except ``keep``, repeating while new ones appear (a subreaper
    inherits the grandchildren of the ones it kills). Returns how many were killed.

    It waits at most ``wait`` seconds and never blocks on one process: a child SIGKILL cannot stop
    yet (frozen, or in uninterruptible sleep) is left to be reaped when it finally dies (the caller
    reaps children anyway), instead of wedging whoever called this."""
    killed: set[int] = set()
    deadline = time.monotonic() + wait
    while True:
        victims = [p for p in child_pids() if p not in keep]
        if not victims:
            break
        for pid in victims:
            if pid not in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        for pid in victims:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.0005)
    return len(killed)
