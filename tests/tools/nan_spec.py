"""A tool whose spec holds NaNs (its own timeout, which the executor ignores, and a default): two
executors serving this module announce one tool, which must not differ from itself."""

from __future__ import annotations

from executor import tool


@tool(timeout=float("nan"))
def scale(x: float, factor: float = float("nan")) -> float:
    """Multiply x by factor."""
    return x * factor
