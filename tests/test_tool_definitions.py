"""Tool definitions checked at load, arguments checked against annotations, values that are not data
flagged, and what the CIAYN loop does with them: a real executor runs every call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CIAYN_TOOLS, log_lines

from controller.allowlist import AllowedTools
from controller.ciayn import CiaynAgent
from controller.events import Finished, Notice, Rejected, ToolResultEvent
from controller.models import ScriptedModel
from executor.registry import RegistryError, load_tools
from protocol import Call

DONE = 'complete_task(summary="all done")'


@pytest.fixture
def client(make_client: Callable[..., Any], workspace: Path) -> Any:
    return make_client(tools=[CIAYN_TOOLS], workspace=workspace)


def test_a_typo_in_an_annotation_is_refused_at_load_naming_the_tool(tmp_path: Path) -> None:
    module = tmp_path / "typo_tools.py"
    module.write_text(
        "from __future__ import annotations\n"
        "from executor import tool\n\n"
        "@tool\n"
        "def add(a: int, b: itn) -> int:\n"
        '    """Add."""\n'
        "    return a + b\n"
    )
    with pytest.raises(RegistryError, match=r"tool add: the annotation of parameter 'b' \('itn'\) does not resolve"):
        load_tools([str(module)])


def _refused_at_load(tmp_path: Path, tools: str, match: str) -> None:
    """Loading a module of ``tools`` (source after ``from executor import tool``) is refused so."""
    module = tmp_path / "refused_tools.py"
    module.write_text("from executor import tool\n\n" + tools)
    with pytest.raises(RegistryError, match=match):
        load_tools([str(module)])


def _tool_source(decorator: str = "@tool", params: str = "", doc: str = "F.", name: str = "f") -> str:
    return f'{decorator}\ndef {name}({params}) -> int:\n    """{doc}"""\n    return 1\n\n'


@pytest.mark.parametrize(("name", "shown"), [('"n" * 300', "'nnnn"), ("5", "'5'")])
def test_a_tool_name_a_call_could_not_carry_is_refused_at_load(tmp_path: Path, name: str, shown: str) -> None:
    """A call names its tool in 1 to 256 characters; a tool named otherwise could never be called
    (an empty name means the function's own)."""
    _refused_at_load(tmp_path, _tool_source(decorator=f"@tool(name={name})"),
                     rf"its name must be a string of 1 to 256 characters.*not {shown}")


def test_a_parameter_name_over_256_characters_is_refused_at_load(tmp_path: Path) -> None:
    _refused_at_load(tmp_path, _tool_source(params=f"{'p' * 300}: int"),
                     r"tool 'f': parameter name p+\.\.\. is longer than 256 characters")


def test_a_docstring_too_long_for_every_prompt_is_refused_at_load(tmp_path: Path) -> None:
    """A tool's spec goes into every prompt: a docstring over 32768 characters is refused, naming the
    tool and the field, not cut silently."""
    _refused_at_load(tmp_path, _tool_source(doc="d" * 40_000),
                     r"tool 'f' cannot be announced: doc: String should have at most 32768")


def test_more_tools_than_an_executor_serves_are_refused_at_load(tmp_path: Path) -> None:
    _refused_at_load(tmp_path, "".join(_tool_source(name=f"f{i}") for i in range(1025)),
                     r"1025 tools found; an executor serves at most 1024")


def test_a_tool_without_a_docstring_loads_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    module = tmp_path / "nodoc_tools.py"
    module.write_text("from executor import tool\n\n@tool\ndef bare(x: int) -> int:\n    return x\n")
    with caplog.at_level(logging.WARNING, logger="ciayn.executor.registry"):
        tools = load_tools([str(module)])
    assert tools["bare"].spec.doc == "" and tools["bare"].spec.prompt_block() == "bare(x: int) -> int"
    assert "tool bare" in caplog.text and "has no docstring" in caplog.text


def test_an_argument_of_the_wrong_type_is_bad_arguments_naming_the_parameter(client: Any, workspace: Path) -> None:
    result = client.call(Call(tool="typed", kwargs={"count": "3"}, id="typed-1"))
    assert not result.ok and result.error.kind == "bad_arguments"
    assert "typed() argument 'count'" in result.error.message and "'3'" in result.error.message
    assert result.error.traceback is None
    assert result.worker is None  # refused before it was queued: no worker was used for it
    assert client.call(Call(tool="typed", args=[3], id="typed-2")).value == "x x3"


def test_a_value_that_came_back_as_its_repr_is_flagged(client: Any) -> None:
    model = ScriptedModel(["repr_only()", DONE])
    events = list(CiaynAgent(model, client).stream("x"))
    [result] = [e for e in events if isinstance(e, ToolResultEvent) and e.tool == "repr_only"]
    assert result.ok and result.value_is_repr and result.value == "{1, 2, 3}"
    told = model.requests[1][-1]["content"]
    assert "not plain data; this is its repr()" in told


def test_ciayn_warns_when_no_completion_tool_is_offered(client: Any) -> None:
    model = ScriptedModel(["same()"] * 3)
    events = list(CiaynAgent(model, AllowedTools(client, ["same", "tick"]), max_steps=2).stream("x"))
    assert isinstance(events[0], Notice) and "none of the offered tools looks like a completion tool" in events[0].text
    assert isinstance(events[-1], Finished) and events[-1].status == "stopped"
    quiet = list(CiaynAgent(ScriptedModel([DONE]), client).stream("x"))
    assert not any("completion tool" in e.text for e in quiet if isinstance(e, Notice))


def test_prose_then_the_call_on_its_own_line_runs_and_history_keeps_the_call(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["Sure! Here is the call:\nappend_line(text='x')", DONE])
    events = list(CiaynAgent(model, client).stream("x"))
    assert isinstance(events[-1], Finished) and events[-1].status == "completed"
    assert log_lines(workspace) == ["x", "complete all done"]
    assert model.requests[1][-2] == {"role": "assistant", "content": "append_line(text='x')"}


def test_writing_a_default_out_does_not_defeat_the_repeat_guard(client: Any, workspace: Path) -> None:
    model = ScriptedModel(['deploy("prod")', 'deploy(target="prod", count=1)', 'deploy("prod", 2)', DONE])
    events = list(CiaynAgent(model, client).stream("x"))
    assert log_lines(workspace) == ["deploy prod 1", "deploy prod 2", "complete all done"]
    [refused] = [e for e in events if isinstance(e, Rejected)]
    assert refused.code == "repeat"


def test_a_stop_before_stream_is_not_lost(client: Any) -> None:
    model = ScriptedModel([DONE])
    agent = CiaynAgent(model, client)
    agent.stop("stopped from another thread")
    events = list(agent.stream("x"))
    assert isinstance(events[-1], Finished) and events[-1].status == "stopped" and not model.requests
    assert events[-1].reason == "stopped from another thread"
    assert agent.run("x").status == "completed"  # that stop was used up by the run it stopped
