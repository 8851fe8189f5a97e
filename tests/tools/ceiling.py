"""Tools for the timeout ceiling tests (``--max-timeout``): one with a long timeout of its own, one with
none, both sleeping longer than any ceiling a test sets."""

from __future__ import annotations

import time

from executor import tool


@tool(timeout=60)
def patient(seconds: float = 30.0) -> str:
    """Sleep `seconds` under this tool's own 60 s timeout."""
    time.sleep(seconds)
    return "woke"


@tool
def plain(seconds: float = 30.0) -> str:
    """Sleep `seconds` under the call's or the executor's timeout."""
    time.sleep(seconds)
    return "woke"
