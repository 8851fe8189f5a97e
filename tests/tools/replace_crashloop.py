"""Tools for tests/test_replacement_redteam.py: each import appends a line to ``imports`` in the
working directory (the executor's workspace). From the second import on (replacement templates) it
registers a before-fork hook that ends the template with ``os._exit``: the template loads the tools
and reports them fine, then dies at its first worker fork (the first ``Spawn`` after its start)."""

from __future__ import annotations

import os

from executor import tool

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
with open("imports") as _f:
    _number = len(_f.read().split())
if _number >= 2:
    os.register_at_fork(before=lambda: os._exit(3))


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x
