"""Tools for the red team of ``--max-timeout`` and the canonical resend key
(``tests/test_redteam_ceiling_resend.py``): sleepers and burners that outlast any ceiling a test
sets, one that leaves a daemon behind, tools whose own ``@tool(timeout=...)`` is every odd float,
and ``tally``, which writes a line per run so a test can count runs."""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
import uuid

from executor import tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forged_notice import forge_applying as _forge_applying  # beside this file: see its docstring


def _mark(log: str, what: str) -> None:
    if log:
        with open(log, "a") as f:
            f.write(f"{what} {time.time():.6f}\n")


@tool
def nap(seconds: float = 30.0, log: str = "") -> str:
    """Write a start line to `log` (if given), then sleep `seconds`."""
    _mark(log, "start")
    time.sleep(seconds)
    return "woke"


@tool
def burn(seconds: float = 30.0) -> int:
    """Spin the CPU for `seconds` of wall clock."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


@tool
def lingering(lock: str, ready: str) -> str:
    """Leave a daemon behind (double fork, own session, SIGTERM ignored) that holds an exclusive
    flock on `lock` for a minute, say so in `ready`, and sleep well past any ceiling."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            with open(ready, "w") as f:
                f.write("locked\n")
            time.sleep(60)
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
    return "outlived"


@tool
def tally(log: str, /, *args: object, **kwargs: object) -> str:
    """Write a line to `log` for this run and return a fresh token (the other arguments are only
    there to be compared)."""
    _mark(log, "run")
    return uuid.uuid4().hex


@tool
def blob(kb: int) -> str:
    """Return `kb` KiB of text (to fill a result cache)."""
    return "x" * (kb * 1024)


# A tool's own timeout of every odd value: none may take a call past the executor's ceiling.
@tool(timeout=float("inf"))
def own_inf(seconds: float = 30.0) -> str:
    """Sleep under @tool(timeout=inf)."""
    time.sleep(seconds)
    return "woke"


@tool(timeout=-5.0)
def own_negative(seconds: float = 30.0) -> str:
    """Sleep under @tool(timeout=-5)."""
    time.sleep(seconds)
    return "woke"


@tool(timeout=0.0)
def own_zero(seconds: float = 30.0) -> str:
    """Sleep under @tool(timeout=0)."""
    time.sleep(seconds)
    return "woke"


@tool(timeout=1e308)
def own_huge(seconds: float = 30.0) -> str:
    """Sleep under @tool(timeout=1e308)."""
    time.sleep(seconds)
    return "woke"


@tool(timeout=10**30)
def own_huge_int(seconds: float = 30.0) -> str:
    """Sleep under @tool(timeout=10**30)."""
    time.sleep(seconds)
    return "woke"


@tool(timeout=5e-324)
def own_subnormal(seconds: float = 30.0) -> str:
    """Sleep under @tool(timeout=5e-324), the smallest positive float."""
    time.sleep(seconds)
    return "woke"


@tool
def forge_applying(seconds: float = 30.0) -> str:
    """Send the hardened keeper's own notice (``applying``: the apply grace, 60 s more) on every
    socket descriptor for every sequence number a call may have, then sleep `seconds`."""
    _forge_applying()
    time.sleep(seconds)
    return "forged"
