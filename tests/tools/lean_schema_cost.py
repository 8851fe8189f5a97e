"""Tools for tests/test_lean_template_redteam.py: parameters whose JSON Schema makes the supervisor's
argument check (``ToolSpec.check_arguments``) do work per schema node that its step budget
(``SCHEMA_CHECK_STEPS``) does not count.

- ``pick``: an honest tool, a list of codes out of 250 (``Literal``): pydantic writes an ``enum`` of
  250 strings, which the check scans once per item of the list. ``tag`` is its control: the same
  list, of any strings.
- ``pick_big``: a hostile module's choice, a list of an ``IntEnum`` of 10,000 members (59 KB of
  schema): 10,000 comparisons per item.
- ``keyed``: a list of maps whose model's ``json_schema_extra`` lists the one required key 12,000
  times: 12,000 lookups per item."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from executor import tool

CODES = tuple(f"c{i:03d}" for i in range(250))
Code = Literal[CODES]  # type: ignore[valid-type]
Big = enum.IntEnum("Big", {f"v{i}": i for i in range(10_000)})  # type: ignore[misc]
REQUIRED_REPEATS = 12_000


class Keyed(BaseModel):
    model_config = ConfigDict(json_schema_extra={"required": ["a"] * REQUIRED_REPEATS})
    a: int


@tool
def pick(codes: list[Code]) -> int:
    """How many codes were picked."""
    return len(codes)


@tool
def tag(codes: list[str]) -> int:
    """How many tags were given."""
    return len(codes)


@tool
def pick_big(values: list[Big]) -> int:
    """How many values were given."""
    return len(values)


@tool
def keyed(items: list[Keyed]) -> int:
    """How many items were given."""
    return len(items)
