"""Waiting on a condition, always with a bound (no test sleeps in place of a condition)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

START_BOUND = 30.0  # seconds for processes to come up on a loaded machine


def wait_until(what: str, check: Callable[[], Any], timeout: float = START_BOUND, every: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail the test saying ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def wait_for(condition: Callable[[], object], within: float, what: str) -> float:
    """Poll ``condition`` until it holds; return the seconds it took, fail after ``within``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, f"{what}: not within {within} s"
        time.sleep(0.01)
    return time.monotonic() - started
