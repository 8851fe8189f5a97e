"""A `work` tool whose spec differs from tests/tools/pool_tools.py's: a pool must refuse it."""

from __future__ import annotations

from executor import tool


@tool
def work(tag: str) -> str:
    """Not the same tool as the pool's `work`."""
    return tag
