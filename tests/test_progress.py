"""``controller.progress``: what counts as progress, which calls are kept out of the reply grammar,
and what the grammar then lets a model write (walked with the grammar tests' recogniser).

The agent loop's use of it (cycles ending early, notes, narrowed grammars) is tested with a real
executor in test_ciayn_loop.py; these are the pure parts.
"""

from __future__ import annotations

from gbnf_walk import admits

from controller.gbnf import call_rules
from controller.progress import Progress, without_calls
from protocol import Call, ErrorInfo, Result, ToolSpec


def read_file(path: str, max_bytes: int = 200_000) -> str:
    """Read a file."""
    return ""


def list_dir(path: str = ".") -> list[str]:
    """List a directory."""
    return []


def write_file(path: str, content: str) -> str:
    """Write a file."""
    return ""


def ping() -> str:
    """Ping."""
    return ""


def lookup(key: str) -> str:
    """Look a key up (its answer may change: not idempotent)."""
    return ""


SPECS = [
    ToolSpec.from_function(read_file, idempotent=True),
    ToolSpec.from_function(list_dir, idempotent=True),
    ToolSpec.from_function(write_file),
    ToolSpec.from_function(ping, idempotent=True),
    ToolSpec.from_function(lookup),
]
TOOLS = {s.name: s for s in SPECS}


def ok(value: object) -> Result:
    return Result(id="x", ok=True, value=value)


def failed(kind: str, message: str = "no") -> Result:
    return Result(id="x", ok=False, error=ErrorInfo(kind=kind, message=message))  # type: ignore[arg-type]


def call(tool: str, **kwargs: object) -> Call:
    return Call(tool=tool, kwargs=kwargs)


def test_a_step_progresses_only_with_an_outcome_the_run_has_not_seen_for_that_call() -> None:
    progress = Progress(TOOLS)
    a, b = call("read_file", path="a.txt"), call("list_dir")
    assert progress.record(1, [(a, ok("x"))]).stalled == 0
    again = progress.record(2, [(a, ok("x"))])
    assert again.stalled == 1 and [(r.call, r.first_step) for r in again.repeats] == [(a, 1)]
    assert progress.record(3, [(b, ok([]))]).stalled == 0  # a new call
    assert progress.record(4, [(call("list_dir", path="."), ok([]))]).stalled == 1  # the same call, default given
    assert progress.record(5, [(a, ok("y"))]).stalled == 0  # the same call, a new result
    assert progress.record(6, [(a, "refused: not run")]).stalled == 1  # a refusal is never progress


def test_an_a_b_a_b_cycle_keeps_both_calls_out_until_something_new_happens() -> None:
    progress = Progress(TOOLS)
    a, b = call("lookup", key="a"), call("lookup", key="b")  # a tool whose answer may change
    for step, c in enumerate([a, b], start=1):
        progress.record(step, [(c, ok(c.kwargs["key"]))])
    assert progress.kept_out() == []
    assert progress.record(3, [(a, ok("a"))]).stalled == 1
    assert progress.kept_out() == [a]
    assert progress.record(4, [(b, ok("b"))]).stalled == 2
    assert progress.kept_out() == [a, b]
    progress.record(5, [(a, ok("a, changed"))])
    assert progress.kept_out() == []


def test_a_call_of_an_idempotent_tool_that_succeeded_is_kept_out_until_something_may_have_changed() -> None:
    progress = Progress(TOOLS)
    read, listing = call("read_file", path="a.txt"), call("list_dir")
    assert progress.record(1, [(read, ok("a")), (listing, ok(["a.txt"]))]).kept_out == ()  # nothing new to say
    assert progress.kept_out() == [read, listing]  # their results are in the conversation already
    progress.record(2, [(call("lookup", key="k"), ok("v"))])
    assert progress.kept_out() == []


def test_a_settled_failure_is_kept_out_at_once_a_chance_failure_once_it_repeats() -> None:
    progress = Progress(TOOLS)
    bad, slow = call("read_file", path="."), call("read_file", path="big.log")
    assert progress.record(1, [(bad, failed("tool_error", "is a directory"))]).kept_out == (bad,)
    assert progress.record(2, [(slow, failed("timeout"))]).kept_out == ()  # a retry may succeed
    assert progress.record(3, [(slow, failed("timeout"))]).kept_out == (slow,)
    assert progress.kept_out() == [bad, slow]


def test_a_tool_that_may_change_the_workspace_lets_failed_calls_back_in() -> None:
    progress = Progress(TOOLS)
    missing, other = call("read_file", path="out.txt"), call("read_file", path="a.txt")
    progress.record(1, [(missing, failed("tool_error", "no such file"))])
    progress.record(2, [(other, ok("a"))])  # idempotent: nothing changed
    assert progress.kept_out() == [missing, other]
    progress.record(3, [(call("write_file", path="out.txt", content="x"), ok("wrote"))])
    assert progress.kept_out() == []


def test_unexplored_names_are_the_tasks_files_then_listed_entries_no_call_used() -> None:
    progress = Progress(TOOLS)
    progress.record(1, [(call("list_dir"), ok(["a.txt", "b.txt", "data/", "notes.txt"]))])
    progress.record(2, [(call("read_file", path="a.txt"), ok("a"))])
    progress.record(3, [(call("read_file", path="b.txt"), failed("timeout"))])  # tried, but not looked at
    progress.record(4, [(call("read_file", path="notes.txt"), failed("tool_error", "a directory"))])
    assert progress.unexplored(["notes.txt", "report.md"]) == ["notes.txt", "report.md", "b.txt", "data/"]


def test_without_calls_keeps_the_first_text_argument_from_its_value() -> None:
    specs = without_calls(SPECS, [call("read_file", path="."), call("write_file", path="a.txt", content="x")])
    grammar = call_rules(specs)
    assert not admits(grammar, 'read_file(path=".")') and not admits(grammar, 'read_file(path=".", max_bytes=5)')
    assert admits(grammar, 'read_file(path="a.txt")')
    assert not admits(grammar, 'write_file(path="a.txt", content="y")')  # keyed on the path only
    assert admits(grammar, 'write_file(path="b.txt", content="x")')


def test_a_kept_out_default_makes_the_parameter_required() -> None:
    grammar = call_rules(without_calls(SPECS, [call("list_dir")]))
    assert not admits(grammar, "list_dir()") and not admits(grammar, 'list_dir(path=".")')
    assert admits(grammar, 'list_dir(path="data")')


def test_an_enum_loses_the_kept_out_value_and_a_tool_left_with_none_is_left_out() -> None:
    def narrowed(spec: ToolSpec, enum: list[str]) -> ToolSpec:
        path = {**spec.parameters["properties"]["path"], "enum": enum}
        return spec.model_copy(update={"parameters": {**spec.parameters, "properties": {"path": path}}})

    specs = without_calls(
        [narrowed(TOOLS["read_file"], [".", "a.txt"]), narrowed(TOOLS["list_dir"], ["."])],
        [call("read_file", path="."), call("list_dir", path=".")],
    )
    assert [s.name for s in specs] == ["read_file"]  # list_dir() would list "." too
    assert specs[0].parameters["properties"]["path"]["enum"] == ["a.txt"]
    optional = without_calls([narrowed(TOOLS["list_dir"], ["data"])], [call("list_dir", path="data")])
    assert admits(call_rules(optional), "list_dir()") and not admits(call_rules(optional), 'list_dir(path="data")')


def test_a_tool_without_parameters_is_left_out_but_never_every_tool() -> None:
    assert [s.name for s in without_calls(SPECS, [call("ping")])] == ["read_file", "list_dir", "write_file", "lookup"]
    only = [TOOLS["ping"]]
    assert without_calls(only, [call("ping")]) == only
