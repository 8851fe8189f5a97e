"""Two misbehaving tools for the demo: what the executor is for."""

from __future__ import annotations

import ctypes
import time

from executor import tool


@tool(timeout=2)
def hang() -> None:
    """Never return (the executor kills it at its 2 s limit)."""
    while True:
        time.sleep(3600)


@tool
def segfault() -> None:
    """Crash the interpreter with a segmentation fault."""
    ctypes.string_at(0)
