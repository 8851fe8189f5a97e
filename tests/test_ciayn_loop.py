"""The CIAYN agent loop, end to end: a scripted model (the only fake) drives a real executor.

Every loop test starts a real ``ciayn-executor serve`` through the ``make_client`` fixture; the tools
(tests/tools/ciayn_tools.py) write their side effects into the workspace from the executor's worker
processes, so the assertions prove what ran, where and in which order. The pure parts (history
trimming, feedback texts, events) have unit tests at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from conftest import CIAYN_TOOLS, log_lines

from controller import prompts
from controller.ciayn import CiaynAgent, build_grammar
from controller.events import (
    Finished,
    ModelText,
    Notice,
    Rejected,
    StepEvent,
    Tally,
    ToolCallEvent,
    ToolResultEvent,
    Usage,
)
from controller.history import TRIM_NOTE, trim_history
from controller.models import ModelConfig, ModelError, ModelReply, ScriptedModel, estimate_tokens
from controller.progress import without_calls
from protocol import Call, ErrorInfo, Limits, Result, Stats, ToolSpec, WorkerInfo, parse_call

DONE = 'complete_task(summary="all done")'


@pytest.fixture
def client(make_client: Callable[..., Any], workspace: Path) -> Any:
    return make_client(tools=[CIAYN_TOOLS], workspace=workspace)


def run(agent: CiaynAgent, task: Any = "do the task") -> list[StepEvent]:
    events = list(agent.stream(task))
    assert isinstance(events[-1], Finished)
    assert sum(isinstance(e, Finished) for e in events) == 1
    return events


def done(events: list[StepEvent]) -> Finished:
    last = events[-1]
    assert isinstance(last, Finished)
    return last


def of(kind: type[Any], events: Iterable[StepEvent]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def text_of(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m["content"]) for m in messages)


# --- the happy path, markup and reasoning -----------------------------------------------------


def test_calls_run_in_the_executor_and_completion_signal_ends_the_run(client: Any, workspace: Path) -> None:
    model = ScriptedModel(['append_line(text="first")', DONE])
    events = run(CiaynAgent(model, client))
    finished = done(events)
    assert finished.status == "completed"
    assert finished.summary == "all done"
    assert (finished.steps, finished.calls, finished.tool_errors) == (2, 2, 0)
    assert log_lines(workspace) == ["first", "complete all done"]
    result = of(ToolResultEvent, events)[0]
    assert result.ok and result.worker_pid not in (None, os.getpid())
    assert result.value.startswith("appended 'first' in pid ")
    # The model read the result of its first call, in plain words.
    assert "append_line(text='first') returned:\nappended 'first'" in text_of(model.requests[1])


def test_markup_and_think_blocks_are_removed_and_never_executed(client: Any, workspace: Path) -> None:
    reply = '<think>maybe SECRET_PLAN()</think>\n```python\nappend_line(text="a")\n```'
    model = ScriptedModel([reply, "<THINK>\nPONDER\n</THINK>`append_line('b')`", DONE])
    events = run(CiaynAgent(model, client))
    assert done(events).status == "completed"
    assert log_lines(workspace)[:2] == ["a", "b"]
    texts = [e.text for e in of(ModelText, events)]
    assert texts[:2] == ['```python\nappend_line(text="a")\n```', "`append_line('b')`"]
    assert all(e.reasoning == "" for e in of(ModelText, events))  # hidden unless asked
    sent = text_of(model.requests[-1])
    assert "<think" not in sent.lower() and "SECRET_PLAN" not in sent and "PONDER" not in sent
    # The history holds the call itself, without the fences.
    assistant = [m["content"] for m in model.requests[-1] if m["role"] == "assistant"]
    assert assistant == ['append_line(text="a")', "append_line('b')"]


def test_reasoning_is_shown_only_when_asked(client: Any) -> None:
    replies: list[Any] = [
        "<think>inline plan</think>append_line('a')",
        ModelReply(text="append_line('b')", reasoning="structured plan"),
        DONE,
    ]
    shown = of(ModelText, run(CiaynAgent(ScriptedModel(replies), client, show_reasoning=True)))
    assert [e.reasoning for e in shown[:2]] == ["inline plan", "structured plan"]
    hidden = of(ModelText, run(CiaynAgent(ScriptedModel(replies), client)))
    assert [e.reasoning for e in hidden] == ["", "", ""]


def test_list_shaped_content_is_handled(client: Any, workspace: Path) -> None:
    model = ScriptedModel(
        [
            [{"type": "thinking", "thinking": "let me see"}, {"type": "text", "text": "append_line('x')"}],
            ["append_line('y')"],
            [{"type": "text", "text": DONE}],
        ]
    )
    events = run(CiaynAgent(model, client, show_reasoning=True))
    assert done(events).status == "completed"
    assert log_lines(workspace)[:2] == ["x", "y"]
    assert of(ModelText, events)[0].reasoning == "let me see"


# --- empty and invalid replies ----------------------------------------------------------------


def test_empty_replies_fail_the_run_after_the_limit(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["", "   ", "<think>still thinking..."])
    events = run(CiaynAgent(model, client, max_empty=3))
    finished = done(events)
    assert finished.status == "failed"
    assert "3 empty replies in a row" in finished.reason
    assert len(model.requests) == 3
    assert not of(ToolCallEvent, events) and not log_lines(workspace)
    # Each retry told the model its reply was empty, and only once per empty reply.
    assert text_of(model.requests[2]).count("Your last reply was empty") == 2


def test_an_empty_reply_streak_is_reset_by_a_valid_reply(client: Any) -> None:
    model = ScriptedModel(["", "", "append_line('a')", "", "", DONE])
    assert done(run(CiaynAgent(model, client, max_empty=3))).status == "completed"


def test_invalid_reply_is_shown_to_the_model_once_with_its_rejection(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["Sure! I will call x = read()", "append_line('ok')", DONE])
    events = run(CiaynAgent(model, client))
    rejected = of(Rejected, events)
    assert len(rejected) == 1 and rejected[0].code in ("syntax", "not_a_call")
    second = model.requests[1]
    # The model's own reply is the assistant turn, followed by the exact rejection.
    assert second[-2] == {"role": "assistant", "content": "Sure! I will call x = read()"}
    feedback = second[-1]["content"]
    assert feedback == prompts.rejected(rejected[0].message)
    assert text_of(second).count(rejected[0].message) == 1
    assert "\n" in feedback and "\\n" not in feedback
    # Later requests still hold it exactly once (no duplication as the history grows).
    assert text_of(model.requests[2]).count(rejected[0].message) == 1
    assert log_lines(workspace)[0] == "ok"


def test_unknown_tool_and_bad_arguments_are_rejected_before_the_executor(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["delete_everything()", "append_line(txt='a')", DONE])
    events = run(CiaynAgent(model, client))
    codes = [r.code for r in of(Rejected, events)]
    assert codes == ["unknown_tool", "bad_arguments"]
    assert "append_line" in of(Rejected, events)[0].message  # the available tools are named
    assert log_lines(workspace) == ["complete all done"]


def test_consecutive_invalid_replies_fail_the_run(client: Any) -> None:
    model = ScriptedModel(["x = 1", "print(open('f').read())", "import os", "never asked"])
    events = run(CiaynAgent(model, client, max_invalid=3))
    finished = done(events)
    assert finished.status == "failed"
    assert "3 invalid replies in a row" in finished.reason
    assert "not a function call" in finished.reason or "statement" in finished.reason
    assert len(model.requests) == 3 and model.remaining == 1


def test_a_valid_reply_resets_the_invalid_streak(client: Any) -> None:
    model = ScriptedModel(["x = 1", "y = 2", "append_line('a')", "z = 3", "w = 4", DONE])
    assert done(run(CiaynAgent(model, client, max_invalid=3))).status == "completed"


# --- bundles and the repeat guard -------------------------------------------------------------


def test_a_bundle_runs_in_order_and_each_call_gets_its_result(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["append_line('1')\nappend_line('2'); append_line('3')", DONE])
    events = run(CiaynAgent(model, client))
    calls = of(ToolCallEvent, events)[:3]
    assert [c.args for c in calls] == [["1"], ["2"], ["3"]]
    assert {c.step for c in calls} == {1}
    assert len({c.call_id for c in calls}) == 3
    results = of(ToolResultEvent, events)[:3]
    assert [r.call_id for r in results] == [c.call_id for c in calls]
    assert log_lines(workspace)[:3] == ["1", "2", "3"]
    feedback = model.requests[1][-1]["content"]
    assert feedback.startswith("Results of your 3 calls, in order:\n")
    first, second, third = (feedback.index(f"[{i}] append_line('{i}') returned:\nappended '{i}'") for i in (1, 2, 3))
    assert first < second < third


def test_non_bundleable_tools_cannot_be_bundled(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["lookup('a')\nlookup('b')", DONE])
    events = run(CiaynAgent(model, client))
    rejected = of(Rejected, events)
    assert len(rejected) == 1 and rejected[0].code == "bundle"
    assert "append_line, tell" in rejected[0].message
    assert log_lines(workspace) == ["complete all done"]


def test_prompt_lists_tools_rules_and_bundleable_tools(client: Any) -> None:
    model = ScriptedModel([DONE])
    run(CiaynAgent(model, client))
    (first,) = model.requests[0]  # instructions and task merged into one user message
    assert first["role"] == "user"
    content = first["content"]
    spec = next(s for s in client.tools() if s.name == "flaky_lookup")
    assert spec.prompt_block() in content
    assert "one call per line" in content and "append_line, tell" in content
    assert "call complete_task" in content
    assert content.endswith("Task:\ndo the task")
    assert "\\n" not in content


def test_system_role_is_configurable(client: Any) -> None:
    model = ScriptedModel([DONE])
    run(CiaynAgent(model, client, system_role="system"))
    roles = [m["role"] for m in model.requests[0]]
    assert roles == ["system", "user"]
    assert model.requests[0][1]["content"] == "Task:\ndo the task"


def test_a_repeated_no_repeat_call_is_refused_in_plain_words(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["lookup('a')", "lookup(key='a')", "lookup('b')", "lookup('a')", DONE])
    events = run(CiaynAgent(model, client))
    repeats = [r for r in of(Rejected, events) if r.code == "repeat"]
    assert len(repeats) == 1 and repeats[0].step == 2  # keyword form of the same call is a repeat
    assert log_lines(workspace) == ["lookup a", "lookup b", "lookup a", "complete all done"]
    feedback = model.requests[2][-1]["content"]
    assert feedback == prompts.repeat(Call(tool="lookup", kwargs={"key": "a"}))
    assert "was not run" in feedback


def test_repeating_a_call_after_it_failed_is_allowed(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["flaky_lookup('k')", "flaky_lookup('k')", "flaky_lookup('k')", DONE])
    events = run(CiaynAgent(model, client))
    results = of(ToolResultEvent, events)
    assert [r.ok for r in results[:2]] == [False, True]
    assert results[0].error_kind == "crashed" and results[0].worker_restarted
    assert [r.code for r in of(Rejected, events)] == ["repeat"]  # only after it succeeded
    assert log_lines(workspace) == ["flaky_lookup k", "complete all done"]


# --- executor faults mid-run ------------------------------------------------------------------


def test_a_timeout_mid_run_is_explained_and_the_run_completes(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["nap(seconds=30)", "append_line('after')", DONE])
    events = run(CiaynAgent(model, client))
    timeout = of(ToolResultEvent, events)[0]
    assert timeout.error_kind == "timeout" and timeout.worker_restarted
    assert timeout.wall_s is not None and timeout.wall_s < 10
    told = model.requests[1][-1]["content"]
    assert told == (
        "nap(seconds=30) failed: the tool timed out after 1 s and its worker was restarted; tool state was reset."
    )
    finished = done(events)
    assert finished.status == "completed"
    assert (finished.tool_errors, finished.worker_restarts) == (1, 1)
    assert log_lines(workspace) == ["after", "complete all done"]


def test_a_crash_mid_run_is_explained_and_the_run_completes(client: Any) -> None:
    model = ScriptedModel(["remember('secret')", "segfault()", "recall()", DONE])
    events = run(CiaynAgent(model, client))
    results = of(ToolResultEvent, events)
    assert results[1].error_kind == "crashed" and results[1].worker_restarted
    told = model.requests[2][-1]["content"]
    assert told.startswith("segfault() failed: the tool crashed (")
    assert "SIGSEGV" in told and told.endswith("its worker was restarted; tool state was reset.")
    assert results[2].ok and results[2].value == ""  # the new worker has no memory of 'secret'
    assert done(events).status == "completed"


def test_a_tool_error_reaches_the_model_with_its_message(client: Any) -> None:
    model = ScriptedModel(["fail(message='bad input')", DONE])
    events = run(CiaynAgent(model, client))
    assert of(ToolResultEvent, events)[0].error_kind == "tool_error"
    assert (
        model.requests[1][-1]["content"] == "fail(message='bad input') failed: the tool raised ValueError: bad input."
    )
    assert done(events).status == "completed"


def test_an_unavailable_executor_ends_the_run(client: Any) -> None:
    def kill_executor(messages: list[dict[str, Any]]) -> str:
        client.local.proc.kill()
        client.local.proc.wait()
        return "append_line('lost')"

    events = run(CiaynAgent(ScriptedModel(["append_line('a')", kill_executor, DONE]), client))
    finished = done(events)
    assert finished.status == "failed"
    assert "executor is unavailable" in finished.reason


# --- signals and limits -----------------------------------------------------------------------


def test_exit_signal_stops_the_run(client: Any) -> None:
    model = ScriptedModel(["give_up(reason='no credentials')", "never asked"])
    finished = done(run(CiaynAgent(model, client)))
    assert finished.status == "stopped"
    assert "no credentials" in finished.reason and "give_up" in finished.reason
    assert model.remaining == 1


def test_a_note_signal_becomes_a_notice(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["tell('hello user')\nappend_line('x')", DONE])
    events = run(CiaynAgent(model, client))
    assert [n.text for n in of(Notice, events)] == ["tell: hello user"]
    assert done(events).status == "completed"
    assert log_lines(workspace)[0] == "x"


def test_step_limit_stops_the_run(client: Any, workspace: Path) -> None:
    model = ScriptedModel([f"append_line('{i}')" for i in range(10)])
    finished = done(run(CiaynAgent(model, client, max_steps=3)))
    assert finished.status == "stopped"
    assert "step limit (3)" in finished.reason
    assert finished.steps == 3 and len(model.requests) == 3
    assert log_lines(workspace) == ["0", "1", "2"]


def test_cost_limit_stops_the_run_and_usage_is_accounted(client: Any) -> None:
    model = ScriptedModel(
        [f"append_line('{i}')" for i in range(10)], cost_per_call=0.4, prompt_tokens=100, completion_tokens=7
    )
    events = run(CiaynAgent(model, client, max_cost=1.0))
    finished = done(events)
    assert finished.status == "stopped" and "cost limit ($1.0000)" in finished.reason
    assert len(model.requests) == 3
    usage = of(Usage, events)
    assert [u.step for u in usage] == [1, 2, 3]
    assert usage[-1].total_prompt_tokens == 300 and usage[-1].total_completion_tokens == 21
    assert usage[-1].total_cost == pytest.approx(1.2)
    assert finished.tokens == 321 and finished.cost == pytest.approx(1.2)


def test_a_model_error_fails_the_run_with_its_message(client: Any) -> None:
    model = ScriptedModel(["append_line('a')", ModelError("The model 'x' request failed (HTTP 400): bad")])
    finished = done(run(CiaynAgent(model, client)))
    assert finished.status == "failed" and "HTTP 400" in finished.reason


def test_stop_ends_the_run_before_the_next_request(client: Any) -> None:
    agent: CiaynAgent

    def stop_then_call(messages: list[dict[str, Any]]) -> str:
        agent.stop("user pressed Ctrl-C")
        return "append_line('a')"

    agent = CiaynAgent(ScriptedModel([stop_then_call, DONE]), client)
    finished = done(run(agent))
    assert finished.status == "stopped" and finished.reason == "user pressed Ctrl-C"


# --- history ----------------------------------------------------------------------------------


def test_history_trimming_keeps_the_initial_messages(client: Any) -> None:
    model = ScriptedModel([f"append_line('{i}')" for i in range(8)] + [DONE])
    events = run(CiaynAgent(model, client, max_history_messages=4))
    assert done(events).status == "completed"
    last = model.requests[-1]
    assert last[0]["content"].startswith(prompts.instructions(client.tools())[:80])
    assert "Task:\ndo the task" in last[0]["content"]
    assert "earlier messages of this conversation were left out" in last[0]["content"]
    assert [m["role"] for m in last[1:]] == ["assistant", "user", "assistant", "user"]
    assert last[-2]["content"] == "append_line('7')"
    assert len(of(Notice, events)) == 1


def test_history_trimming_by_tokens(client: Any) -> None:
    model = ScriptedModel([f"append_line('{'x' * 400}{i}')" for i in range(6)] + [DONE])
    initial = prompts.instructions(client.tools()) + "\n\nTask:\ndo the task"
    budget = estimate_tokens([{"role": "user", "content": initial}]) + 600
    events = run(CiaynAgent(model, client, max_history_tokens=budget, max_history_messages=None))
    assert done(events).status == "completed"
    last = model.requests[-1]
    assert estimate_tokens(last) <= budget
    assert last[0]["content"].startswith(initial[:200]) and "do the task" in last[0]["content"]
    assert "earlier messages of this conversation were left out" in last[0]["content"]
    assert last[-2]["content"].endswith("5')")
    assert len(last) < 2 + 2 * 6


def test_the_callers_initial_messages_are_not_mutated(client: Any) -> None:
    task = [{"role": "user", "content": "Task: write a line"}]
    snapshot = json.dumps(task)
    model = ScriptedModel([f"append_line('{i}')" for i in range(5)] + [DONE])
    run(CiaynAgent(model, client, max_history_messages=2), task)
    assert json.dumps(task) == snapshot
    assert model.requests[0][0]["content"].endswith("Task: write a line")


# --- repair and grammar -----------------------------------------------------------------------


def test_repair_rewrites_a_rejected_reply(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["I would append the line hi using append_line", "append_line(text='hi')", DONE])
    events = run(CiaynAgent(model, client, repair=True))
    assert done(events).status == "completed"
    assert log_lines(workspace)[0] == "hi"
    repair_request = model.requests[1]
    assert len(repair_request) == 1
    assert "I would append the line hi using append_line" in repair_request[0]["content"]
    assert of(Rejected, events)[0].message in repair_request[0]["content"]
    assert any("Repaired the rejected reply as: append_line(text='hi')" in n.text for n in of(Notice, events))
    # The conversation continues from the repaired call, not the prose.
    assert model.requests[2][-2] == {"role": "assistant", "content": "append_line(text='hi')"}


def test_a_failed_repair_falls_back_to_feedback(client: Any) -> None:
    fixer = ScriptedModel(["still not a call"])
    model = ScriptedModel(["prose instead of a call", DONE])
    events = run(CiaynAgent(model, client, repair=True, repair_model=fixer))
    assert len(fixer.requests) == 1
    assert any("rewrite was rejected too" in n.text for n in of(Notice, events))
    assert model.requests[1][-2] == {"role": "assistant", "content": "prose instead of a call"}
    assert done(events).status == "completed"


def test_a_grammar_is_sent_with_every_request(client: Any) -> None:
    model = ScriptedModel(["append_line('a')", DONE])
    run(CiaynAgent(model, client, grammar='root ::= "x"'))
    assert model.grammars == ['root ::= "x"', 'root ::= "x"']


def test_grammar_true_builds_one_from_the_tool_specs(client: Any) -> None:
    model = ScriptedModel([DONE])
    events = run(CiaynAgent(model, client, grammar=True))
    grammar = model.grammars[0]
    if grammar is None:  # controller.gbnf is not there yet: the run says so and goes on
        assert any("No reply grammar" in n.text for n in of(Notice, events))
    else:
        assert grammar == build_grammar(client.tools())
        assert "append_line" in grammar and "complete_task" in grammar


def test_a_run_over_real_http_with_a_grammar(client: Any, workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: litellm -> an OpenAI-compatible server on 127.0.0.1 -> the loop -> the executor."""
    stub_module = pytest.importorskip("llm_stub")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with stub_module.LLMStub(["append_line(text='over http')", DONE]) as stub:
        config = ModelConfig(model="openai/stub", api_base=stub.api_base, use_grammar=True)
        events = run(CiaynAgent.from_config(config, client))
        assert done(events).status == "completed"
        assert log_lines(workspace) == ["over http", "complete all done"]
        assert len(stub.requests) == 2
        grammar = stub.requests[0].get("grammar")  # litellm sends extra_body fields at the top level
        assert isinstance(grammar, str) and "append_line(" in grammar
        assert "append_line(text='over http') returned:" in stub.requests[1]["messages"][-1]["content"]


def test_text_values_fit_the_models_reply_cap(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stub_module = pytest.importorskip("llm_stub")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with stub_module.LLMStub(["append_line(text='over http')", DONE]) as stub:
        config = ModelConfig(model="openai/stub", api_base=stub.api_base, use_grammar=True, max_tokens=64)
        assert done(run(CiaynAgent.from_config(config, client))).status == "completed"
        grammar = stub.requests[0]["grammar"]
        assert 'append-line-text ::= "text" ws "=" ws append-line-text-value' in grammar
        assert 'append-line-text-value ::= "\\"" str-char{0,64} "\\""' in grammar  # a cut reply would not parse
    with stub_module.LLMStub([DONE]) as stub:
        config = ModelConfig(model="openai/stub", api_base=stub.api_base, use_grammar=True)  # no cap: no bound
        run(CiaynAgent.from_config(config, client))
        assert "str-char{0,64}" not in stub.requests[0]["grammar"]


# --- small models: compact prompt, example turns, loop guard, tool allowlist ------------------


@pytest.fixture
def builtin_client(make_client: Callable[..., Any], workspace: Path) -> Any:
    (workspace / "notes.txt").write_text("The code is 7.\n")
    return make_client(tools=["executor.toolkits.builtin"], workspace=workspace)


def test_compact_prompt_is_short_with_one_line_per_tool(client: Any) -> None:
    model = ScriptedModel([DONE])
    run(CiaynAgent(model, client, prompt_style="compact"))
    content = model.requests[0][0]["content"]
    compact = prompts.compact_instructions(client.tools())
    assert content == compact + "\n\nTask:\ndo the task"
    assert len(compact) < 0.7 * len(prompts.instructions(client.tools()))
    tool_lines = content.split("\nTools:\n")[1].split("\n\nTask:")[0].splitlines()
    assert len(tool_lines) == len(client.tools())
    assert all(line.startswith(f"{t.name}{t.signature}") for line, t in zip(tool_lines, client.tools(), strict=True))
    assert "call complete_task" in content and content.endswith("Task:\ndo the task")


def test_example_turns_demonstrate_the_loop_before_the_task(builtin_client: Any) -> None:
    model = ScriptedModel(['read_file(path="notes.txt")', 'complete_task(summary="The code is 7.")'])
    finished = done(run(CiaynAgent(model, builtin_client, prompt_style="compact", few_shot=True), "Report the code"))
    assert finished.status == "completed" and finished.summary == "The code is 7."
    sent = model.requests[0]
    read, write = prompts.generated_examples(builtin_client.tools())  # made from the offered tools
    assert sent[0]["content"].endswith(prompts.TASK.format(task=read.task))  # merged after the rules
    calls = [m["content"] for m in sent if m["role"] == "assistant"]
    assert calls == [text for text, _ in read.steps] + [text for text, _ in write.steps]
    assert calls[:3] == ['list_dir(path=".")', 'read_file(path="config.ini")', 'complete_task(summary="port = 8080")']
    assert calls[3] == 'write_file(path="status.txt", content="all good")'
    # The example results read exactly like real feedback, and the real task comes last.
    assert sent[2]["content"].startswith("list_dir(path='.') returned 2 entries:\n")
    assert sent[-1]["content"] == "Task:\nReport the code"
    real_feedback = model.requests[1][-1]["content"]
    assert real_feedback.startswith("read_file(path='notes.txt') returned:\nThe code is 7.")


def test_example_turns_follow_the_parameter_names_of_the_offered_tools() -> None:
    def read_text(file_name: str) -> str:
        """Read."""
        return ""

    def finish(answer: str) -> None:
        """Finish."""

    specs = [ToolSpec.from_function(read_text), ToolSpec.from_function(finish)]
    [example] = prompts.generated_examples(specs)
    assert [text for text, _ in example.steps] == ['read_text(file_name="config.ini")', 'finish(answer="port = 8080")']
    assert len(prompts.example_turns(specs)) == 4


def test_seen_values_narrow_paths_and_answers_in_the_grammar(builtin_client: Any) -> None:
    replies = ['list_dir(path=".")', 'read_file(path="notes.txt")', 'complete_task(summary="The code is 7.")']
    model = ScriptedModel(replies)
    agent = CiaynAgent(model, builtin_client, grammar=True, constrain_values=True)
    assert done(run(agent, "Read notes.txt and report the code")).status == "completed"
    first, second, third = model.grammars
    assert first is not None and second is not None and third is not None
    assert '\\"notes.txt\\"' in first and "The code is 7." not in first  # GBNF escapes the quotes
    assert '\\"The code is 7.\\"' in third  # the line read, which shares a word with the task ...
    assert '\\"1 entry\\"' not in third  # ... so the listing's size, which does not, is not offered
    assert "The code is 7." not in second and "complete_task(" not in second  # nothing to report yet
    assert "call-write-file" not in first  # the task asks for no writing


def test_example_turns_are_left_out_when_their_tools_are_not_offered(client: Any) -> None:
    assert prompts.example_turns(client.tools()) == []  # the loop-test tools have no read_file
    model = ScriptedModel([DONE])
    run(CiaynAgent(model, client, few_shot=True))
    assert len(model.requests[0]) == 1  # instructions and task only


def test_a_call_repeated_with_the_same_result_is_called_out(client: Any, workspace: Path) -> None:
    model = ScriptedModel(["same()", "same()", "append_line('b')", DONE])
    events = run(CiaynAgent(model, client))
    assert log_lines(workspace) == ["b", "complete all done"]
    assert "You already made" not in model.requests[1][-1]["content"]
    told = model.requests[2][-1]["content"]
    assert told.startswith("same() returned:")
    assert "You already made this call at step 1 and got the same result" in told and "call complete_task" in told
    assert "You already made" not in model.requests[3][-1]["content"]  # a new call: no note
    progress = [n.text for n in of(Notice, events) if n.text.startswith("Progress:")]
    assert progress == ["Progress: the model repeated same() (same result as at step 1); 1 step in a row without a "
                        "new result."]


def test_a_repeat_with_a_different_result_is_not_called_out(client: Any) -> None:
    model = ScriptedModel(["tick()", "tick()", "same()", "same()", DONE])
    run(CiaynAgent(model, client))
    note = "You already made"
    assert note not in model.requests[2][-1]["content"]  # tick() again, but it now says 2
    assert "You already made this call at step 3" in model.requests[4][-1]["content"]  # same() again, same result


def test_a_repeat_anywhere_in_the_run_is_called_out_not_only_of_the_last_step(client: Any) -> None:
    model = ScriptedModel(["same()", "tick()", "same()", DONE])
    run(CiaynAgent(model, client))
    assert "You already made this call at step 1" in model.requests[3][-1]["content"]


def test_a_repeated_call_is_left_out_of_the_grammar_until_the_run_makes_progress(client: Any) -> None:
    model = ScriptedModel(["same()", "same()", "tell('t')", "same()", DONE])
    run(CiaynAgent(model, client, grammar=True))
    full, *_ = model.grammars
    assert full is not None and "same(" in full
    assert model.grammars[1] == full
    narrowed = model.grammars[2]
    assert narrowed is not None and "same(" not in narrowed and "tell(" in narrowed
    assert narrowed == build_grammar([s for s in client.tools() if s.name != "same"])
    assert model.grammars[3] == full  # tell('t') got something new: same() is back
    assert model.grammars[4] == narrowed  # same() got what it got at step 1 again
    assert model.requests[2][-1]["content"].endswith("Your next reply may not call same().")


def test_an_a_a_b_b_cycle_ends_early_with_the_reason_in_the_events(client: Any) -> None:
    model = ScriptedModel(["same()", "same()", "recall()", "recall()"] * 8)  # no grammar: nothing stops it
    events = run(CiaynAgent(model, client, max_steps=30))
    finished = done(events)
    # same() new, same() again (1), recall() new, recall() again (1), same() (2), same() (3), recall() (4)
    assert finished.status == "stopped" and finished.steps == 7 and len(model.requests) == 7
    assert finished.reason.startswith("no progress: 4 steps in a row got only results this run had already seen")
    assert "same()" in finished.reason and "recall()" in finished.reason and "other 23 steps" in finished.reason
    assert json.loads(finished.to_json())["reason"] == finished.reason
    stalls = [n.text for n in of(Notice, events) if n.text.startswith("Progress:")]
    assert len(stalls) == 5 and stalls[-1].endswith("4 steps in a row without a new result.")


def test_the_stall_limit_can_be_raised_or_turned_off(client: Any) -> None:
    model = ScriptedModel(["same()"] * 10)
    assert done(run(CiaynAgent(model, client, max_steps=10, max_stalled_steps=None))).steps == 10
    model = ScriptedModel(["same()"] * 10)
    assert done(run(CiaynAgent(model, client, max_steps=10, max_stalled_steps=2))).steps == 3
    with pytest.raises(ValueError, match="max_stalled_steps"):
        CiaynAgent(model, client, max_stalled_steps=0)


def test_a_call_that_failed_is_left_out_of_the_grammar_and_unread_files_are_suggested(builtin_client: Any) -> None:
    replies = ['read_file(path=".")', 'list_dir(path=".")', 'list_dir(path=".")', 'read_file(path="notes.txt")', DONE]
    model = ScriptedModel(replies)
    agent = CiaynAgent(model, builtin_client, grammar=True, constrain_values=True)
    assert done(run(agent, "Which file has the code?")).status == "completed"
    specs = builtin_client.tools()
    read_dot, list_dot = Call(tool="read_file", kwargs={"path": "."}), Call(tool="list_dir", kwargs={"path": "."})

    def path_rule(grammar: str | None, tool: str) -> str:
        assert grammar is not None
        return next(line for line in grammar.splitlines() if line.startswith(f"{tool}-path ::="))

    # No file is known before the listing, so read_file is not offered (the script calls it anyway and
    # it fails); then it may read notes.txt. list_dir('.') succeeded, and a listing does not change
    # while nothing writes: it is out too; once notes.txt is read, so is that.
    assert "call-read-file" not in (model.grammars[0] or "") + (model.grammars[1] or "")
    assert "Your next reply may not call read_file(path='.')." in model.requests[1][-1]["content"]
    for grammar in model.grammars[2:4]:
        assert path_rule(grammar, "read-file") == 'read-file-path ::= "path" ws "=" ws "\\"notes.txt\\""'
        assert "call-list-dir" not in (grammar or "")  # "." is the one directory known, and it was listed
    assert "call-read-file" not in (model.grammars[4] or "") and "call-complete-task" in (model.grammars[4] or "")
    assert model.requests[4][-1]["content"].endswith("That is what the task asks for: call complete_task with it now.")
    told = model.requests[3][-1]["content"]
    assert "You already made this call at step 2" in told
    assert "Your next reply may not call list_dir(path='.')." in told
    assert told.endswith('Not looked at yet: notes.txt. Next, try read_file(path="notes.txt").')
    free = CiaynAgent(ScriptedModel(replies), builtin_client, grammar=True)  # no narrowed values: "not" rules
    assert done(run(free, "Which file has the code?")).status == "completed"
    assert free.model.grammars[3] == build_grammar(without_calls(specs, [read_dot, list_dot]))  # type: ignore[attr-defined]


def test_a_completion_before_any_tool_ran_is_refused_with_what_is_missing(builtin_client: Any) -> None:
    replies = ["complete_task(summary='The code is 7.')", 'read_file(path="notes.txt")',
               "complete_task(summary='The code is 7.')"]
    model = ScriptedModel(replies)
    events = run(CiaynAgent(model, builtin_client, check_completion=True), "Read notes.txt and report the code")
    assert done(events).status == "completed" and done(events).steps == 3
    [refused] = of(Rejected, events)
    assert refused.code == "incomplete" and refused.step == 1
    assert refused.message == (
        "complete_task(summary='The code is 7.') was not run: no tool has run yet, so nothing of the task has "
        'been done. Do the task first, for example read_file(path="notes.txt").'
    )
    assert model.requests[1][-1]["content"] == refused.message  # what the model reads next
    assert [e.tool for e in of(ToolCallEvent, events)] == ["read_file", "complete_task"]


WRITE_TASK = "Read notes.txt and write a one-line summary of it to summary.txt"


def test_a_write_task_is_not_reported_done_before_the_file_is_written(builtin_client: Any, workspace: Path) -> None:
    replies = ['read_file(path="notes.txt")', "complete_task(summary='The code is 7.')",
               'write_file(path="summary.txt", content="A code: 7.")', "complete_task(summary='Wrote summary.txt')"]
    model = ScriptedModel(replies)
    events = run(CiaynAgent(model, builtin_client, check_completion=True), WRITE_TASK)
    assert done(events).status == "completed" and (workspace / "summary.txt").read_text() == "A code: 7."
    [refused] = of(Rejected, events)
    assert refused.code == "incomplete" and refused.message == (
        "complete_task(summary='The code is 7.') was not run: the task asks for writing summary.txt and it has "
        'not been written yet. Call write_file first, with path="summary.txt" and the content to write.'
    )
    # Without the check, the same replies end the run as completed with nothing written: issue 23's case.
    (workspace / "summary.txt").unlink()
    unchecked = run(CiaynAgent(ScriptedModel(replies), builtin_client), WRITE_TASK)
    assert done(unchecked).status == "completed" and not (workspace / "summary.txt").exists()


def test_the_grammar_offers_completion_only_once_nothing_is_missing(builtin_client: Any) -> None:
    replies = ['read_file(path="notes.txt")', 'write_file(path="summary.txt", content="A code: 7.")',
               "complete_task(summary='Wrote summary.txt')"]
    for task, model in (
        (WRITE_TASK, ScriptedModel(replies)),
        ("Report the code", ScriptedModel(['read_file(path="notes.txt")', "complete_task(summary='7')"])),
    ):
        agent = CiaynAgent(model, builtin_client, grammar=True, check_completion=True)
        assert done(run(agent, task)).status == "completed"
        offered = ["complete_task(" in (g or "") for g in model.grammars]
        assert offered == [False] * (len(model.grammars) - 1) + [True], task


def test_a_fixed_grammar_is_never_narrowed(client: Any) -> None:
    model = ScriptedModel(["same()", "same()", DONE])
    run(CiaynAgent(model, client, grammar='root ::= "x"'))
    assert model.grammars == ['root ::= "x"'] * 3
    assert "may not call" not in model.requests[2][-1]["content"]


def test_the_repair_request_carries_the_grammar(client: Any) -> None:
    model = ScriptedModel(["not a call at all", "append_line('fixed')", DONE])
    run(CiaynAgent(model, client, repair=True, grammar='root ::= "x"'))
    assert len(model.requests) == 3 and len(model.requests[1]) == 1  # the second one is the repair prompt
    assert model.grammars == ['root ::= "x"'] * 3


def test_an_allowlist_offers_and_runs_only_the_named_tools(client: Any, workspace: Path) -> None:
    from controller.agent import create_agent

    model = ScriptedModel(["append_line('a')", "remember('x')", DONE])
    agent = create_agent(model, client, allow_tools=["append_line", "complete_task"], grammar=True)
    events = list(agent.stream("do the task"))
    assert done(events).status == "completed"
    prompt = model.requests[0][0]["content"]
    assert "append_line(" in prompt and "remember(" not in prompt and "segfault(" not in prompt
    grammar = model.grammars[0]
    assert grammar is not None and "remember(" not in grammar and "complete_task(" in grammar
    rejected = of(Rejected, events)
    assert [r.code for r in rejected] == ["unknown_tool"]  # a hidden tool is an unknown tool
    assert log_lines(workspace) == ["a", "complete all done"]


def test_the_allowlist_refuses_hidden_tools_without_the_executor(client: Any, workspace: Path) -> None:
    from controller.allowlist import AllowedTools, UnknownTools, parse_names

    allowed = AllowedTools(client, parse_names(" append_line , complete_task,"))
    assert [s.name for s in allowed.tools()] == [s.name for s in client.tools() if s.name in allowed.names]
    refused = allowed.call(Call(tool="remember", args=["x"], id="c1"))
    assert not refused.ok and refused.error is not None and refused.error.kind == "unknown_tool"
    assert "not offered in this run" in refused.error.message
    assert allowed.call(Call(tool="append_line", args=["ok"], id="c2")).ok
    assert log_lines(workspace) == ["ok"]
    with pytest.raises(UnknownTools, match="no_such_tool"):
        AllowedTools(client, ["no_such_tool"]).tools()
    with pytest.raises(ValueError, match="empty"):
        AllowedTools(client, [])


def test_an_allowlist_naming_a_missing_tool_fails_the_run_clearly(client: Any) -> None:
    from controller.agent import create_agent

    model = ScriptedModel([DONE])
    finished = create_agent(model, client, allow_tools=["append_line", "nope"]).run("do the task")
    assert finished.status == "failed" and "nope" in finished.reason and not model.requests


def cli_argv(api_base: str, workspace: Path, *options: str) -> list[str]:
    """``ciayn run`` on the scripted stub model, with the loop-test tools in a private executor."""
    model = ["--model", "openai/stub", "--api-base", api_base, "--backend", "ciayn"]
    return ["run", "do the task", *model, "--tools", CIAYN_TOOLS, "--workspace", str(workspace), *options]


def test_ciayn_run_cli_passes_allowlist_prompt_and_sampling_options(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller import cli

    stub_module = pytest.importorskip("llm_stub")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with stub_module.LLMStub(["append_line(text='cli')", DONE]) as stub:
        options = ["--allow-tools", "append_line,complete_task", "--prompt", "compact"]
        options += ["--temperature", "0.5", "--seed", "7", "--max-tokens", "64", "--json"]
        argv = cli_argv(stub.api_base, workspace, *options)
        assert cli.main(argv) == 0
        first = stub.requests[0]
    assert (first["temperature"], first["seed"], first["max_tokens"]) == (0.5, 7, 64)
    messages = first["messages"]
    assert "remember(" not in messages[0]["content"] and "append_line(" in messages[0]["content"]
    assert messages[0]["content"].startswith(prompts.COMPACT_INSTRUCTIONS[:40])
    assert "tools offered to the model: append_line, complete_task" in capsys.readouterr().out
    assert log_lines(workspace) == ["cli", "complete all done"]


def test_ciayn_run_says_why_a_run_that_goes_round_in_circles_stopped_early(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller import cli

    stub_module = pytest.importorskip("llm_stub")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with stub_module.LLMStub(["same()", "same()", "recall()", "recall()"] * 8) as stub:
        assert cli.main(cli_argv(stub.api_base, workspace, "--max-steps", "30")) == 1
        assert len(stub.requests) == 7
    out = capsys.readouterr().out
    assert "no progress: 4 steps in a row got only results this run had already seen" in out
    assert "stopped early instead of spending the other 23 steps of the limit" in out


def test_ciayn_run_cli_rejects_an_allowlist_naming_a_missing_tool(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller import cli

    stub_module = pytest.importorskip("llm_stub")
    with stub_module.LLMStub([]) as stub:
        argv = cli_argv(stub.api_base, workspace, "--allow-tools", "append_line,nope")
        assert cli.main(argv) == 2
        assert not stub.requests  # refused before the first step
    err = capsys.readouterr().err
    assert "--allow-tools" in err and "nope" in err and "append_line" in err


# --- pure parts: history, feedback texts, events ----------------------------------------------


def _conversation(steps: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    initial = [{"role": "user", "content": "instructions"}, {"role": "user", "content": "task"}]
    history: list[dict[str, Any]] = []
    for i in range(steps):
        history += [{"role": "assistant", "content": f"call{i}()"}, {"role": "user", "content": f"result {i}"}]
    return initial, history


def test_trim_by_count_keeps_initial_and_starts_at_a_call() -> None:
    initial, history = _conversation(5)
    before = json.dumps([initial, history])
    out, dropped = trim_history(initial, history, max_messages=5)
    assert json.dumps([initial, history]) == before  # nothing mutated
    assert out[:2] == initial
    assert out[2]["content"] == TRIM_NOTE.format(dropped=dropped)
    assert out[3]["role"] == "assistant" and dropped == 6
    assert out[-1]["content"] == "result 4"


def test_trim_by_tokens_keeps_the_latest_step_even_when_over_budget() -> None:
    initial, history = _conversation(5)
    out, dropped = trim_history(initial, history, max_tokens=1)
    assert out[:2] == initial and out[-2:] == history[-2:] and dropped == 8
    out, dropped = trim_history(initial, history, max_tokens=10_000)
    assert out == initial + history and dropped == 0


def test_trim_by_tokens_uses_the_given_counter() -> None:
    initial, history = _conversation(10)
    out, _ = trim_history(initial, history, max_tokens=100, count_tokens=lambda ms: 10 * len(ms), headroom=0)
    assert len(out) * 10 <= 100


def _result(kind: str | None, message: str = "", **fields: Any) -> Result:
    if kind is None:
        return Result(id="1", ok=True, **fields)
    return Result(id="1", ok=False, error=ErrorInfo(kind=kind, message=message), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (
            _result(
                "timeout",
                "x",
                limits=Limits(timeout_s=5),
                worker=WorkerInfo(id=0, pid=1, incarnation=2, restarted=True),
            ),
            "the tool timed out after 5 s and its worker was restarted; tool state was reset",
        ),
        (  # killed at its limit, measured a hair short of it: said as the limit
            _result("timeout", limits=Limits(timeout_s=1), stats=Stats(wall_s=0.97)),
            "the tool timed out after 1 s",
        ),
        (  # it waited in the queue first: it ran for less than its limit, and says how long
            _result("timeout", limits=Limits(timeout_s=5), stats=Stats(wall_s=0.4)),
            "the tool timed out after 0.4 s",
        ),
        (
            _result("memory", "killed", limits=Limits(memory_mb=256)),
            "the tool ran out of memory (limit 256 MB) (killed)",
        ),
        (_result("unknown_tool", "no tool 'x'"), "the executor refused the call: no tool 'x'"),
        (
            _result("output_limit", "too much", limits=Limits(max_output_kb=8)),
            "the tool's output was larger than allowed (8 KB) (too much)",
        ),
        (_result("cancelled"), "the call was cancelled"),
    ],
)
def test_describe_failure_in_plain_words(result: Result, expected: str) -> None:
    assert prompts.describe_failure(result) == expected


def test_feedback_renders_values_and_output() -> None:
    call = parse_call("f(1, k='v')")
    ok = _result(None, value={"a": [1, 2]}, stdout="printed\n")
    assert prompts.feedback([(call, ok)]) == "f(1, k='v') returned:\n{\"a\": [1, 2]}\nIt printed:\nprinted"
    nothing = _result(None)
    assert prompts.feedback([(call, nothing)]) == "f(1, k='v') returned:\n(the tool returned nothing)"
    long = _result(None, value="x" * (prompts.MAX_FEEDBACK_CHARS + 5))
    assert prompts.feedback([(call, long)]).endswith("(cut here: 5 more characters)")


def test_example_call_uses_required_parameters() -> None:
    def tool_fn(path: str, count: int, /, flag: bool, opt: str = "") -> None: ...

    spec = ToolSpec.from_function(tool_fn, name="t")
    assert prompts.example_call(spec) == 't("...", 1, flag=True)'
    parse_call(prompts.example_call(spec))


def test_events_serialise_to_json() -> None:
    tally = Tally()
    usage = tally.add_usage(1, 10, 2, 0.5)
    event = ToolResultEvent(step=1, call_id="c", tool="t", ok=True, value=b"\xff\x00")
    for e in (usage, event, tally.finished("completed", "done", "summary"), Notice("n")):
        data = json.loads(e.to_json())
        assert data["event"] == e.KIND
    assert json.loads(event.to_json())["value"] == {"base64": "/wA="}
    assert json.loads(tally.finished("failed", "r").to_json())["tokens"] == 12


def test_seen_values_follow_what_the_task_asks() -> None:
    from controller.seen import SeenValues

    read = Call(tool="read_file", kwargs={"path": "alpha.txt"})
    which = SeenValues.from_task("Which of alpha.txt and beta.txt mentions the umbrella? Finish with the name.")
    which.add_result(Result(id="1", ok=True, value="Dear Ann, the meeting moved.\n"), read)
    assert which.answer == "name" and not which.answer_ready()  # beta.txt is not read yet
    beta = read.model_copy(update={"kwargs": {"path": "beta.txt"}})
    which.add_result(Result(id="2", ok=True, value="Bring the umbrella.\n"), beta)
    assert which.answer_ready() and which._choices("summary", "finish") == ["beta.txt"]

    count = SeenValues.from_task("How many files are in the data directory?")
    assert count.answer == "count" and count.names == ["data"] and not count.answer_ready()
    count.add_result(Result(id="3", ok=True, value=["a.csv", "b.csv", "c.csv"]))
    assert count._choices("summary", "finish") == ["3 entries"]
    assert count._choices("path", "other") == ["data", "a.csv", "b.csv", "c.csv", "."]

    for task in ("List data and report how many files it holds.", "How many entries does the directory data have?"):
        assert SeenValues.from_task(task).task_dirs == ["data"]
    listed = SeenValues.from_task("List the data folder and call complete_task with how many entries it has.")
    listed.add_result(Result(id="4", ok=True, value=["x"] * 7), Call(tool="list_dir", kwargs={"path": "."}))
    assert not listed.answer_ready()  # the workspace's size is not what was asked
    listed.add_result(Result(id="5", ok=True, value=["a", "b", "c"]), Call(tool="list_dir", kwargs={"path": "data"}))
    assert listed.answer_ready() and listed._choices("summary", "finish") == ["3 entries"]

    write = SeenValues.from_task("Write the text 'hello world' to greeting.txt, then finish.")
    assert write.writes and write._choices("content", "other") == ["hello world"]
    assert write.completion_missing() == "no tool has run yet, so nothing of the task has been done"
    write.add_result(Result(id="6", ok=True, value=["a.txt"]), Call(tool="list_dir", kwargs={"path": "."}))
    assert write.completion_missing() == (
        "the task asks for writing greeting.txt and it has not been written yet"
    ) and not write.answer_ready()
    assert write._choices("path", "write") == ["greeting.txt"]
    write.add_result(Result(id="8", ok=True, value="wrote"), Call(tool="write_file", kwargs={"path": "a.txt"}))
    assert write.completion_missing() is not None  # not the file the task names
    write.add_result(Result(id="7", ok=True, value="wrote"), Call(tool="write_file", kwargs={"path": "greeting.txt"}))
    assert write.completion_missing() is None and write.answer_ready()


def narrowed(seen: Any, *names: str) -> dict[str, dict[str, Any]]:
    """The builtin tools' parameter schemas as ``seen`` narrows them (only the tools it offers)."""
    import executor.toolkits.builtin as builtin

    specs = [ToolSpec.from_function(getattr(builtin, n)) for n in names]
    return {s.name: {p.name: s.parameters["properties"][p.name] for p in s.params} for s in seen.constrain(specs)}


def test_seen_values_offer_each_kind_of_tool_what_it_can_take() -> None:
    from controller.seen import SeenValues

    seen = SeenValues.from_task("How many lines does poem.txt have?")
    tools = ("list_dir", "read_file", "write_file", "complete_task")
    assert list(narrowed(seen, *tools)) == ["list_dir", "read_file"]  # no writing asked, no answer yet
    seen.add_result(Result(id="1", ok=True, value=["a.txt", "docs/", "poem.txt"]), Call(tool="list_dir"))
    schemas = narrowed(seen, *tools)
    assert schemas["list_dir"]["path"]["enum"] == ["docs", "."]  # directories only
    assert schemas["read_file"]["path"]["enum"] == ["poem.txt"]  # the file the task names, while unread
    assert "max_bytes" not in schemas["read_file"]  # an optional number keeps its default
    seen.add_result(Result(id="2", ok=True, value="a\nb\nc\n"), Call(tool="read_file", kwargs={"path": "poem.txt"}))
    assert narrowed(seen, *tools)["read_file"]["path"]["enum"] == ["a.txt", "poem.txt"]
    assert narrowed(seen, *tools)["complete_task"]["summary"]["enum"] == ["3 lines"]  # lines, not "3 entries"
    assert "read_file" not in narrowed(SeenValues.from_task("Which file mentions the owl?"), *tools)  # none known


def test_seen_values_write_what_was_read_to_the_file_the_task_names_after_reading() -> None:
    from controller.seen import SeenValues

    seen = SeenValues.from_task("Create report.txt with a one-line summary of garden.md.")
    tools = ("read_file", "write_file", "complete_task")
    assert list(narrowed(seen, *tools)) == ["read_file"]  # two files named: write after reading one
    seen.add_result(Result(id="1", ok=True, value="The owl is grey.\nThe fox ran.\n"),
                    Call(tool="read_file", kwargs={"path": "garden.md"}))
    write = narrowed(seen, *tools)["write_file"]
    assert write["path"]["enum"] == ["report.txt"]  # never the file it read
    assert write["content"]["enum"] == ["The owl is grey.", "The fox ran."]
    seen.add_result(Result(id="2", ok=True, value="wrote"), Call(tool="write_file", kwargs={"path": "garden.md"}))
    assert seen.completion_missing() == "the task asks for writing report.txt and it has not been written yet"
    free = SeenValues.from_task("Write a poem to poem.txt.")
    assert narrowed(free, "write_file")["write_file"]["content"] == {"title": "Content", "type": "string",
                                                                     "minLength": 1}
    unread = SeenValues.from_task("Create report.txt with a one-line summary of garden.md.")
    unread.add_result(Result(id="3", ok=True, value="wrote"), Call(tool="write_file", kwargs={"path": "report.txt"}))
    assert unread.completion_missing() == "the task names garden.md, which has not been read yet"
    # Reading back what it wrote does not make report.txt a file it summarised (held-out seed 23 of the
    # eval: the model checked its write, and could never finish after).
    seen.add_result(Result(id="4", ok=True, value="wrote"), Call(tool="write_file", kwargs={"path": "report.txt"}))
    seen.add_result(Result(id="5", ok=True, value="The owl is grey."), Call(tool="read_file",
                                                                            kwargs={"path": "report.txt"}))
    assert seen.completion_missing() is None and seen.write_targets() == ["report.txt"]


def test_a_directory_the_task_names_as_a_bare_word_is_the_one_counted() -> None:
    from controller.seen import SeenValues

    seen = SeenValues.from_task("Count the entries of archive.")
    seen.add_result(Result(id="1", ok=True, value=["archive/", "a.txt", "b.txt"]), Call(tool="list_dir"))
    assert seen.task_dirs == ["archive"] and not seen.answer_ready()  # "3 entries" is the workspace's
    seen.add_result(Result(id="2", ok=True, value=["x", "y"]), Call(tool="list_dir", kwargs={"path": "archive"}))
    assert seen.answer_ready() and seen._choices("summary", "finish") == ["2 entries"]
    assert SeenValues.from_task("Find the file that mentions salmon and report its name.").answer == "name"


def test_after_the_answer_is_seen_one_more_call_then_only_finishing(builtin_client: Any) -> None:
    replies = ['read_file(path="notes.txt")', 'list_dir(path=".")', 'list_dir(path=".")', DONE]
    model = ScriptedModel(replies)
    agent = CiaynAgent(model, builtin_client, grammar=True, constrain_values=True)
    run(agent, "Read notes.txt and report the code")
    assert model.requests[1][-1]["content"].endswith("That is what the task asks for: call complete_task with it now.")
    assert model.requests[2][-1]["content"].endswith("Your next reply may only call complete_task.")
    assert "call-list-dir" in (model.grammars[1] or "") and "call-list-dir" not in (model.grammars[2] or "")
    assert (model.grammars[2] or "").startswith("root ::= call-complete-task\n")


def test_a_which_file_answer_waits_for_a_file_related_to_the_task_or_for_every_file() -> None:
    from controller.seen import SeenValues

    which = SeenValues.from_task("Which file mentions the fox?")  # a short word counts
    assert which.answer == "name" and "fox" in which.task_words and "mentions" not in which.task_words
    which.add_result(Result(id="1", ok=True, value=["a.txt", "b.txt", "c.txt"]), Call(tool="list_dir"))
    which.add_result(Result(id="2", ok=True, value="Nothing here.\n"), Call(tool="read_file", kwargs={"path": "a.txt"}))
    assert not which.answer_ready()  # b.txt and c.txt may be the one
    which.add_result(Result(id="3", ok=True, value="A fox ran.\n"), Call(tool="read_file", kwargs={"path": "b.txt"}))
    assert which.answer_ready() and which._choices("summary", "finish") == ["b.txt"]
    none = SeenValues.from_task("Which file mentions the owl?")
    none.add_result(Result(id="4", ok=True, value=["a.txt"]), Call(tool="list_dir"))
    none.add_result(Result(id="5", ok=True, value="Nothing.\n"), Call(tool="read_file", kwargs={"path": "a.txt"}))
    assert none.answer_ready()  # every file was read: the model may say what it found
    assert SeenValues.from_task("Which line of poem.txt mentions the rose?").answer == "any"
