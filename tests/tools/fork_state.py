"""Tools for tests/test_quickfork.py: what a fresh worker holds of the template it was forked from.
This module starts no thread and registers no after-fork hook, so its workers are forked with the
bare ``fork()`` (``executor.workers.quickfork``)."""

from __future__ import annotations

import random
import threading

from executor import tool


@tool
def draw() -> float:
    """A number from the ``random`` module's shared generator."""
    return random.random()


@tool
def threads() -> dict[str, object]:
    """What the worker's ``threading`` module believes about its threads."""
    main = threading.main_thread()
    return {"count": len(threading.enumerate()), "main_is_current": threading.current_thread() is main,
            "ident_is_ours": main.ident == threading.get_ident()}


SUPERVISOR_ONLY = ("zmq", "asyncio", "ssl", "subprocess", "executor.supervisor", "executor.pool", "executor.clientside")


@tool
def supervisor_modules() -> list[str]:
    """Which of the supervisor's own modules this worker holds (a copy of its template's memory)."""
    import sys

    return [m for m in SUPERVISOR_ONLY if m in sys.modules]
