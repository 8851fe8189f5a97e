"""Tools for tests/test_startup_redteam.py: importing this module stops and kills its own process
(the template) and, when that does not work (a PID namespace's init is spared signals sent from
inside it), leaves ``survived`` in the working directory and exits with ``os._exit``: the template
is gone before it answered the supervisor."""

from __future__ import annotations

import os
import signal

from executor import tool

for _sig in (signal.SIGSTOP, signal.SIGKILL):
    try:
        os.kill(os.getpid(), _sig)
    except OSError:
        pass
with open("survived", "w") as _f:
    _f.write(f"{os.getpid()}\n")
os._exit(9)


@tool
def never() -> None:
    """Never served."""
