"""A tool module for routing tests: only `alpha`."""

from __future__ import annotations

from executor import tool


@tool
def alpha(x: int) -> str:
    """Answer which module served the call."""
    return f"alpha:{x}"
