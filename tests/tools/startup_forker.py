"""Tools for tests/test_startup_redteam.py: importing this module starts a daemon (double fork,
new session, its own process group, ignoring SIGTERM/SIGHUP) that would outlive the template. Its
command line ends with the working directory (the executor's workspace, unique per test), so a test
can find it from the host. A file ``fail`` in the workspace makes the import fail after that."""

from __future__ import annotations

import os
import sys

from executor import tool

_where = os.getcwd()
_child = os.fork()
if _child == 0:
    try:
        os.setsid()
        if os.fork() == 0:
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", f"startup-daemon:{_where}"])
    finally:
        os._exit(0)
os.waitpid(_child, 0)
with open("forked", "w") as _f:
    _f.write("1\n")
if os.path.exists("fail"):
    raise RuntimeError("startup_forker: told to fail after starting its daemon")


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x
