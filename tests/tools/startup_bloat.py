"""Tools for tests/test_startup_redteam.py: at import this module writes on the template's channel,
as the report of its import, a ``ToolsLoaded`` of no tools carrying an extra field: an array of 8
million nils (8 MiB on the wire, and a list of 8 million references, 64 MiB, once decoded without a
bound on work). Then it waits (bounded) for ``release`` in the working directory."""

from __future__ import annotations

import os
import sys
import time

from executor import tool
from executor.workers import framing
from executor.workers.channel import ToolsLoaded

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import channel

COUNT = 8 * 1024 * 1024


_message = ToolsLoaded(specs=[]).to_wire()
_message["pad"] = [None] * COUNT
framing.send(channel(), _message)
del _message
with open("bloated", "w") as _f:
    _f.write(f"{os.getpid()}\n")
_deadline = time.monotonic() + 30
while not os.path.exists("release") and time.monotonic() < _deadline:
    time.sleep(0.01)


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x
