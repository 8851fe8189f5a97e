"""Argument types checked from a spec's JSON Schema (``ToolSpec.check_arguments``), as the executor's
supervisor does before it queues a call: its tools' functions live in the template only, so it has
the schema the template described, not the annotations.

The check must take the decisions pydantic's strict mode takes on the annotations themselves (the
controller's specs, built by ``from_function``, check with pydantic), and a schema a hostile tool
module made must cost the supervisor little: no regular expression of it runs, and the work is
bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from protocol.spec import SCHEMA_CHECK_STEPS, BindError, ToolSpec, _SchemaCheck


class Point(BaseModel):
    x: int
    y: float = 0.0


def typed(name: str, count: int = 3, ratio: float = Field(default=1.0, gt=0), flag: bool = False,
          tags: list[str] | None = None, mode: Literal["fast", "slow"] = "fast", pair: tuple[int, str] = (1, "a"),
          scores: dict[str, int] | None = None, where: Path = Path("."), point: Point | None = None,
          blob: bytes = b"", anything: Any = None, short: str = Field(default="", max_length=3)) -> None:
    """A tool of many annotations."""


LOCAL = ToolSpec.from_function(typed)
WIRE = ToolSpec.model_validate(LOCAL.model_dump())  # what the supervisor holds: no annotations

CASES: list[dict[str, Any]] = [
    {"name": "a"}, {"name": 5}, {"name": b"bytes pass as a string"}, {"name": None},
    {"name": "a", "count": True}, {"name": "a", "count": 3.0}, {"name": "a", "count": "3"}, {"name": "a", "count": -7},
    {"name": "a", "ratio": 2}, {"name": "a", "ratio": 0}, {"name": "a", "ratio": -1.5}, {"name": "a", "ratio": True},
    {"name": "a", "flag": 1}, {"name": "a", "flag": True},
    {"name": "a", "tags": ["x", "y"]}, {"name": "a", "tags": ["x", 1]}, {"name": "a", "tags": None},
    {"name": "a", "tags": "x"}, {"name": "a", "tags": ("x",)},
    {"name": "a", "mode": "slow"}, {"name": "a", "mode": "medium"}, {"name": "a", "mode": 1},
    {"name": "a", "pair": [2, "b"]}, {"name": "a", "pair": [2, "b", 3]}, {"name": "a", "pair": ["2", "b"]},
    {"name": "a", "pair": [2]},
    {"name": "a", "scores": {"k": 1}}, {"name": "a", "scores": {"k": "1"}}, {"name": "a", "scores": [1]},
    {"name": "a", "where": "some/path"}, {"name": "a", "where": 3},
    {"name": "a", "point": {"x": 1}}, {"name": "a", "point": {"x": 1, "y": 2.5}}, {"name": "a", "point": {"y": 1}},
    {"name": "a", "point": {"x": "1"}}, {"name": "a", "point": [1, 2]},
    {"name": "a", "blob": b"\x00\xff"}, {"name": "a", "anything": {"any": [1, None]}},
    {"name": "a", "short": "abc"}, {"name": "a", "short": "abcd"},
]


def _decision(spec: ToolSpec, kwargs: dict[str, Any]) -> str:
    try:
        spec.check_arguments(spec.bind([], kwargs))
    except BindError as e:
        return f"refused: {e}"
    return "ok"


@pytest.mark.parametrize("kwargs", CASES, ids=[repr(c)[:60] for c in CASES])
def test_the_schema_check_takes_the_decision_pydantic_takes_on_the_annotations(kwargs: dict[str, Any]) -> None:
    local, wire = _decision(LOCAL, kwargs), _decision(WIRE, kwargs)
    assert (local == "ok") == (wire == "ok"), (local, wire)
    if wire != "ok":
        bad = next(k for k in kwargs if k != "name" or len(kwargs) == 1)
        assert wire.startswith(f"refused: typed() argument {bad!r}"), wire


def test_a_refusal_names_where_in_the_value_and_shows_it() -> None:
    assert _decision(WIRE, {"name": "a", "scores": {"k": "1"}}) == (
        "refused: typed() argument 'scores'['k']: should be an integer, got '1'")
    assert _decision(WIRE, {"name": "a", "tags": ["x", 1]}) == (
        "refused: typed() argument 'tags'[1]: should be a string, got 1")
    assert _decision(WIRE, {"name": "a", "pair": [2, "b", 3]}) == (
        "refused: typed() argument 'pair': should have 2 items, got [2, 'b', 3]")
    shown = _decision(WIRE, {"name": 10**40})
    assert shown == f"refused: typed() argument 'name': should be a string, got {10**40}"


def _wire_spec(schema: dict[str, Any]) -> ToolSpec:
    return ToolSpec(name="hostile", signature="(value)", parameters={"type": "object", "properties": {"value": schema},
                                                                      "$defs": schema.pop("$defs", {})},
                    params=[{"name": "value"}])  # type: ignore[list-item]


def test_a_schemas_regular_expression_never_runs_in_the_checker() -> None:
    """``(a+)+$`` against 60 a's and a '!' backtracks for longer than the test may run, if it runs."""
    spec = _wire_spec({"type": "string", "pattern": "^(a+)+$"})
    spec.check_arguments({"value": "a" * 60 + "!"})


def test_a_schema_that_refers_to_itself_forever_is_cut_off() -> None:
    spec = _wire_spec({"$ref": "#/$defs/Loop", "$defs": {"Loop": {"anyOf": [{"$ref": "#/$defs/Loop"}] * 8}}})
    spec.check_arguments({"value": 1})  # nothing to refuse in the part it had time to check


def test_the_work_on_a_branching_schema_is_bounded() -> None:
    """Eight alternatives at each of 30 levels, and a value 30 levels deep that fails every one at the
    bottom: 8**30 paths. The checker stops counting at its budget and lets the value through."""
    node: dict[str, Any] = {"type": "integer"}
    value: Any = "not an integer"
    for _ in range(30):
        node = {"anyOf": [{"type": "array", "items": node}] * 8}
        value = [value]
    check = _SchemaCheck({})
    assert check.problem(node, value) is None
    assert -64 <= check.steps < 0  # past the budget, one more visit per level on the way out


def test_a_spec_built_where_the_function_is_checks_with_pydantic() -> None:
    """The controller's path is unchanged: ``bind`` already checks a local spec's types."""
    with pytest.raises(BindError, match=r"typed\(\) argument 'count': Input should be a valid integer"):
        LOCAL.bind([], {"name": "a", "count": "3"})
    assert WIRE.bind([], {"name": "a", "count": "3"}) == {"name": "a", "count": "3"}  # names only
    assert SCHEMA_CHECK_STEPS >= 10_000


def test_a_schema_nested_past_the_recursion_limit_is_cut_off_not_a_crash() -> None:
    """A ``$ref`` chain through ``anyOf`` at every level of a value 60 deep would nest Python calls
    past the interpreter's limit (a ``RecursionError`` in the supervisor's loop): the check stops
    going deeper at ``SCHEMA_CHECK_DEPTH`` and lets the rest through."""
    defs = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}, {"type": "array", "items": {"$ref": "#/$defs/D0"}}]}
            for i in range(31)}
    defs["D31"] = {"type": "array", "items": {"$ref": "#/$defs/D0"}}
    spec = _wire_spec({"$ref": "#/$defs/D0", "$defs": defs})
    value: Any = "deep"
    for _ in range(60):
        value = [value]
    spec.check_arguments({"value": value})


def test_a_huge_bad_value_is_shown_in_a_few_characters() -> None:
    big = "x" * 50_000_000
    with pytest.raises(BindError) as refused:
        WIRE.check_arguments({"name": "a", "count": big})
    assert len(str(refused.value)) < 200 and "xxx" in str(refused.value)
    with pytest.raises(BindError) as refused:
        WIRE.check_arguments({"name": "a", "scores": {big: "1"}})
    assert len(str(refused.value)) < 300
