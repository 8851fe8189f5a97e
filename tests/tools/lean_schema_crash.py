"""Tools for tests/test_lean_template_redteam.py: annotations whose JSON Schema (written by pydantic
in the template's describe child, from ``json_schema_extra``/``WithJsonSchema``) holds keywords of
the wrong JSON type, which the supervisor's argument check (``ToolSpec.check_arguments``) then reads.
``echo`` is an ordinary tool, to show the executor still serves."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from executor import tool


@tool
def all_of_int(x: Annotated[int, Field(json_schema_extra={"allOf": 1})]) -> int:
    """``allOf`` is a number, not a list of schemas."""
    return x


@tool
def type_of_lists(x: Annotated[int, WithJsonSchema({"type": [[]]})]) -> int:
    """``type`` is a list holding a list (unhashable)."""
    return x


@tool
def required_lists(x: Annotated[dict[str, int], WithJsonSchema({"type": "object", "required": [[1]]})]) -> int:
    """``required`` holds a list (unhashable) where a key name belongs."""
    return len(x)


@tool
def echo(value: Any = None) -> Any:
    """Return ``value``."""
    return value
