"""Tools for tests/test_startup_redteam.py: importing this module blocks until a file named
``release`` appears in the working directory (the executor's workspace), so a test controls the
window in which the executor's tools are still being imported. It first leaves ``importing`` there
(with the template's pid as it sees it), so the test knows the template is inside the import.

The wait is bounded (50 s, below the executor's 60 s for an import), so a template a test forgot
does not stay. A ``release`` file that says ``fail`` makes the import fail instead."""

from __future__ import annotations

import os
import time

from executor import tool

with open("importing", "a") as _f:
    _f.write(f"{os.getpid()}\n")
_deadline = time.monotonic() + 50
while not os.path.exists("release") and time.monotonic() < _deadline:
    time.sleep(0.005)
with open("release") as _f:  # (raises when the bound passed without one: the import fails)
    if _f.read().strip() == "fail":
        raise RuntimeError("startup_gate: told to fail at import")


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x


@tool
def length(data: bytes) -> int:
    """The number of bytes in ``data``."""
    return len(data)
