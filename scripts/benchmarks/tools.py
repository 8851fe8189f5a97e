"""The tools the benchmarks call, as plain functions (listed in ``__all__``, so the executor serves
them without the ``@tool`` decorator). The module imports nothing but the standard library, so
every contestant runs the very same function at the same cost: the executor's workers, an
in-process call, a Jupyter kernel and a fresh ``python -c``.
"""

from __future__ import annotations

import ctypes
import os
import time

__all__ = ["crash", "hang", "nap", "noop", "pid", "stamp"]


def noop() -> None:
    """Do nothing: the call path's cost alone."""


def stamp() -> int:
    """Return ``time.perf_counter_ns()`` at the moment the tool runs. On Linux that is
    CLOCK_MONOTONIC, one clock for every process, so a client can split a round trip into the
    request path (client -> tool) and the reply path (tool -> client)."""
    return time.perf_counter_ns()


def nap(ms: float = 10.0) -> float:
    """Sleep ``ms`` milliseconds (a tool that waits on I/O), then return them."""
    time.sleep(ms / 1000)
    return ms


def pid() -> int:
    """The worker's pid (tells whether calls share a worker)."""
    return os.getpid()


def crash() -> None:
    """Crash the interpreter (SIGSEGV)."""
    ctypes.string_at(0)


def hang() -> None:
    """Hang until killed."""
    while True:
        time.sleep(3600)
