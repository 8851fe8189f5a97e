"""A tool module for routing tests: only `beta`, and a `work` that differs from pool_tools.work."""

from __future__ import annotations

from executor import tool


@tool
def beta(x: int) -> str:
    """Answer which module served the call."""
    return f"beta:{x}"
