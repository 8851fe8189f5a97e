"""Tools for tests/test_lean_template_redteam.py: a tool module that, at an import chosen by the
test, writes on the template's channel a ``ToolsLoaded`` report of its own, before the template's
describe child can send the real one.

The import forges when the executor's workspace (the working directory) holds ``forge-at`` naming
the import's number (1: the first template's, 2: the first replacement's) and ``forge-specs``, the
report's ``specs`` as JSON; it leaves ``forged`` (before it sends), sends, and waits (bounded) to be killed, unless
``forge-then-go-on`` exists, when the import goes on and the template serves. Every import is
counted in ``imports``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from executor import tool
from executor.workers import framing
from executor.workers.channel import ToolsLoaded

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import channel

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
with open("imports") as _f:
    _number = len(_f.read().split())
_at = Path("forge-at")
if _at.exists() and int(_at.read_text()) == _number:
    with open("forged", "a") as _f:  # first: the supervisor may kill us as soon as it has read the report
        _f.write(f"{os.getpid()}\n")
    framing.send(channel(), ToolsLoaded(specs=json.loads(Path("forge-specs").read_text())).to_wire())
    if not os.path.exists("forge-then-go-on"):
        _deadline = time.monotonic() + 30  # the supervisor kills us now
        while time.monotonic() < _deadline:
            time.sleep(0.01)


@tool
def whoami(value: Any = None) -> int:
    """The worker's pid (``value`` is ignored)."""
    return os.getpid()
