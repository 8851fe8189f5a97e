"""Tools for tests/test_replacement_redteam.py: the first import is honest; every later one (a
replacement template) starts a daemon (double fork, new session, SIGTERM and SIGHUP ignored, named
``rt-daemon``, its pid appended to ``daemons`` in the working directory) and then raises, so the
replacement cannot start and the supervisor tries again, and again."""

from __future__ import annotations

import os
import select
import signal
import time

from executor import tool

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
with open("imports") as _f:
    _number = len(_f.read().split())

if _number >= 2:
    _ready_r, _ready_w = os.pipe()  # the import goes on (and fails) only once the daemon has registered
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            with open("/proc/self/comm", "w") as _c:
                _c.write("rt-daemon")
            with open("daemons", "a") as _d:
                _d.write(f"{os.getpid()}\n")
            os.write(_ready_w, b"!")
            time.sleep(120)
        os._exit(0)
    os.wait()
    os.close(_ready_w)
    select.select([_ready_r], [], [], 10)  # bounded: a daemon that never registers fails the test's premise
    raise RuntimeError(f"replace_daemon: import {_number} told to fail after starting its daemon")


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x
