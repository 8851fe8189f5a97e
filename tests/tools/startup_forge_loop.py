"""Tools for tests/test_startup_redteam.py: at every import, in any template, this module writes on
the template's channel the message a template sends when it could not set its PID namespace up
(``LoadFailed("pid-ns: ...")``), counts the import in ``imports`` in the working directory (the
executor's workspace), and waits to be killed (bounded)."""

from __future__ import annotations

import os
import sys
import time

from executor import tool
from executor.workers import framing, pidns
from executor.workers.channel import LoadFailed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import channel

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
framing.send(channel(), LoadFailed(message=pidns.FAILED + "forged again by a tool module").to_wire())
_deadline = time.monotonic() + 30
while time.monotonic() < _deadline:
    time.sleep(0.01)


@tool
def never() -> None:
    """Never served."""
