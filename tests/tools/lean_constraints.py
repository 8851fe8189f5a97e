"""Tools for tests/test_lean_template_redteam.py: honest tools that guard their arguments with
annotation constraints pydantic enforces (README: "Arguments are checked against the annotations
(pydantic, strict)"), each returning its argument when it runs: a name held to a pattern, a path
held inside by a validator, a map of allowed keys only, a map of at most two entries."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from executor import tool


def _inside(path: str) -> str:
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError("the path must stay inside the workspace")
    return path


@tool
def note_name(name: Annotated[str, Field(pattern=r"^[a-z0-9_]+$")]) -> str:
    """A note's name: lower-case letters, digits and underscores only."""
    return name


@tool
def inside(path: Annotated[str, AfterValidator(_inside)]) -> str:
    """A relative path that stays inside the workspace."""
    return path


@tool
def settings(values: dict[Literal["color", "size"], int]) -> Any:
    """Set ``color`` and/or ``size``."""
    return values


@tool
def few(values: Annotated[dict[str, int], Field(max_length=2)]) -> Any:
    """At most two values."""
    return values
