"""Tools for tests/test_startup_redteam.py: each import of this module appends a line to
``imports`` in the working directory (the executor's workspace) and fails when its number (1 for
the first) is listed in ``fail-imports`` there, so a test decides which templates cannot start."""

from __future__ import annotations

import os

from executor import tool

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
with open("imports") as _f:
    _number = len(_f.read().split())
if os.path.exists("fail-imports"):
    with open("fail-imports") as _f:
        if str(_number) in _f.read().split():
            raise RuntimeError(f"startup_flaky: import {_number} told to fail")


@tool
def echo(x: object) -> object:
    """Return ``x``. Any value: the flood test sends 64 KiB strings, and the executor checks arguments
    against the annotations before it queues a call."""
    return x
