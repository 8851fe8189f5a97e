"""Tools for tests/test_lean_template_redteam.py: at import, this module leaves a thread in the
template that waits (bounded) for ``strike`` in the working directory (the workspace), then writes
on the template's channel a ``Spawned`` report of a worker nobody asked for, whose "channel" is a
pipe and whose pidfd is the template's own, and leaves ``struck``. ``strike`` (a call) writes the
file."""

from __future__ import annotations

import os
import sys
import threading
import time

from executor import tool
from executor.workers import framing
from executor.workers.channel import Spawned

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import channel

_WORKSPACE = os.getcwd()


def _wait_and_strike() -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(_WORKSPACE, "strike")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    r, _w = os.pipe()
    fds = [r, r, r, os.pidfd_open(os.getpid())]
    framing.send_with_fds(channel(), Spawned(worker=1_000_000, pid=os.getpid()).to_wire(), fds)
    with open(os.path.join(_WORKSPACE, "struck"), "w") as f:
        f.write(f"{os.getpid()}\n")


threading.Thread(target=_wait_and_strike, daemon=True).start()


@tool
def strike() -> bool:
    """Tell the template's thread to write its forged report."""
    with open("strike", "w"):
        pass
    return True


@tool
def whoami() -> int:
    """The worker's pid."""
    return os.getpid()
