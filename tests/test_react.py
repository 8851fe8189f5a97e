"""The ReAct backend against a real executor, with only the model scripted.

Every tool here runs in an executor's worker process (``make_client``); the model is a LangChain
fake chat model that answers from a script and records what it was sent, so the tests can check
both what happened in the executor and what the model was told about it.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import CIAYN_TOOLS
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.warnings import LangGraphDeprecatedSinceV10
from pydantic import Field

from controller.agent import Agent, create_agent
from controller.events import (
    Finished,
    ModelText,
    Notice,
    Rejected,
    StepEvent,
    StepStarted,
    ToolCallEvent,
    ToolResultEvent,
    Usage,
)
from controller.react import (
    FINAL_ANSWER,
    ExecutorBridge,
    ReactAgent,
    call_from_arguments,
    estimate_message_tokens,
    make_tools,
    trim_messages,
)
from protocol import Call, Result, ToolSpec

TESTS = Path(__file__).parent
FAULTY = str(TESTS / "tools" / "faulty.py")

Script = AIMessage | BaseException | Callable[[list[BaseMessage]], AIMessage]


class ScriptedChat(FakeMessagesListChatModel):
    """A tool-calling chat model that answers from ``script`` in order and records every request.
    An entry is an ``AIMessage``, an exception to raise, or a callable of the messages."""

    script: list[Any] = Field(default_factory=list)
    received: list[list[BaseMessage]] = Field(default_factory=list)
    responses: list[BaseMessage] = Field(default_factory=list)

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChat:
        return self  # the base class raises NotImplementedError; tool calls are scripted anyway

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        self.received.append(list(messages))
        index = len(self.received) - 1
        if index >= len(self.script):
            raise AssertionError(f"the scripted model was asked {index + 1} times; the script has {len(self.script)}")
        entry = self.script[index]
        if isinstance(entry, BaseException):
            raise entry
        if callable(entry):
            entry = entry(list(messages))
        return ChatResult(generations=[ChatGeneration(message=entry)])


def calls(*items: tuple[str, dict[str, Any]], ids: Sequence[str] | None = None, tokens: int = 10) -> AIMessage:
    """An assistant reply with these tool calls (in one message: parallel calls)."""
    ids = ids or [f"call_{i}" for i in range(len(items))]
    return AIMessage(
        content="",
        tool_calls=[{"name": n, "args": a, "id": i, "type": "tool_call"} for (n, a), i in zip(items, ids, strict=True)],
        usage_metadata={"input_tokens": tokens, "output_tokens": 5, "total_tokens": tokens + 5},
    )


def say(text: str) -> AIMessage:
    return AIMessage(content=text, usage_metadata={"input_tokens": 10, "output_tokens": 3, "total_tokens": 13})


def run(agent: ReactAgent | Agent, task: str = "do the task") -> list[StepEvent]:
    events = list(agent.stream(task))
    assert isinstance(events[-1], Finished) and sum(isinstance(e, Finished) for e in events) == 1
    return events


def of(kind: type, events: list[StepEvent]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def tool_messages(request: list[BaseMessage]) -> list[ToolMessage]:
    return [m for m in request if isinstance(m, ToolMessage)]


class TransientError(Exception):
    status_code = 429


class BadRequest(Exception):
    status_code = 400


# --- whole runs --------------------------------------------------------------------------------


def test_a_run_survives_a_timeout_and_a_crash_mid_run_and_completes(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(
        script=[
            calls(("remember", {"value": "kept"})),
            calls(("nap", {"seconds": 30})),  # the tool's own limit is 1 s
            calls(("segfault", {})),
            calls(("recall", {})),
            calls(("complete_task", {"summary": "all done"})),
        ]
    )
    events = run(ReactAgent(model, client))

    results = of(ToolResultEvent, events)
    assert [(r.tool, r.ok, r.error_kind) for r in results] == [
        ("remember", True, None),
        ("nap", False, "timeout"),
        ("segfault", False, "crashed"),
        ("recall", True, None),
        ("complete_task", True, None),
    ]
    assert results[1].worker_restarted and results[2].worker_restarted
    assert all(r.worker_pid and r.worker_pid != os.getpid() for r in results)
    assert all(r.wall_s is not None and r.peak_rss_kb for r in results if r.ok)
    assert results[3].value == ""  # the worker that remembered was replaced: its state is gone

    # The model was told each failure in plain words, as an error tool message, and went on.
    timeout_msg = tool_messages(model.received[2])[-1]
    crash_msg = tool_messages(model.received[3])[-1]
    assert timeout_msg.status == "error" and crash_msg.status == "error"
    assert "timed out after 1 s" in timeout_msg.content
    assert "worker was restarted; tool state was reset" in str(timeout_msg.content)
    assert "crashed" in str(crash_msg.content)
    assert tool_messages(model.received[1])[-1].status == "success"

    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.status, finished.summary) == ("completed", "all done")
    assert (finished.steps, finished.calls, finished.tool_errors, finished.worker_restarts) == (5, 5, 2, 2)
    assert (workspace / "calls.log").read_text() == "complete all done\n"


def test_parallel_calls_of_bundleable_tools_all_run_and_all_results_go_back(
    make_client: Any, workspace: Path
) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workers=2, workspace=workspace)
    model = ScriptedChat(
        script=[
            calls(("append_line", {"text": "a"}), ("append_line", {"text": "b"}), ids=["first", "second"]),
            say("both lines written"),
        ]
    )
    events = run(ReactAgent(model, client))

    assert sorted((workspace / "calls.log").read_text().split()) == ["a", "b"]  # both ran, in the executor
    assert [c.call_id for c in of(ToolCallEvent, events)] == ["first", "second"]
    assert [c.text for c in of(ToolCallEvent, events)] == ["append_line(text='a')", "append_line(text='b')"]
    results = of(ToolResultEvent, events)
    assert [r.call_id for r in results] == ["first", "second"] and all(r.ok for r in results)
    fed_back = tool_messages(model.received[1])
    assert [m.tool_call_id for m in fed_back] == ["first", "second"]
    # Events come in order: the calls before their results.
    kinds = [type(e).__name__ for e in events if isinstance(e, ToolCallEvent | ToolResultEvent)]
    assert kinds == ["ToolCallEvent", "ToolCallEvent", "ToolResultEvent", "ToolResultEvent"]
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.status, finished.reason, finished.summary) == ("completed", FINAL_ANSWER, "both lines written")


def test_of_parallel_calls_of_tools_not_bundleable_only_the_first_runs(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(
        script=[
            calls(("tick", {}), ("append_line", {"text": "b"}), ids=["first", "second"]),
            say("done"),
        ]
    )
    events = run(ReactAgent(model, client))
    assert (workspace / "ticks.log").read_text() == "tick\n"
    assert not (workspace / "calls.log").exists()  # append_line is bundleable, but tick is not
    assert [c.call_id for c in of(ToolCallEvent, events)] == ["first"]
    [refused] = of(Rejected, events)
    assert refused.code == "bundle" and "append_line(text='b') was not run" in refused.message
    fed_back = tool_messages(model.received[1])
    assert [m.tool_call_id for m in fed_back] == ["first", "second"]  # every call gets its answer
    assert "Send it again in a reply of its own" in str(fed_back[1].content) and fed_back[1].status == "error"
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.calls == 1


def test_a_no_repeat_tool_is_not_rerun_with_the_same_arguments_defaults_applied(
    make_client: Any, workspace: Path
) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(
        script=[
            calls(("lookup", {"key": "k"})),
            calls(("lookup", {"key": "k"})),
            calls(("lookup", {"key": "other"})),
            say("done"),
        ]
    )
    events = run(ReactAgent(model, client))
    assert (workspace / "calls.log").read_text().splitlines() == ["lookup k", "lookup other"]
    [refused] = of(Rejected, events)
    assert refused.code == "repeat" and "lookup(key='k') was not run" in refused.message
    assert "was not run" in str(tool_messages(model.received[2])[-1].content)


def test_every_step_has_its_header_tool_call_steps_included(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(script=[calls(("tick", {})), calls(("tick", {})), say("counted")])
    events = run(ReactAgent(model, client))
    assert [e.step for e in of(StepStarted, events)] == [1, 2, 3]
    first_call = next(i for i, e in enumerate(events) if isinstance(e, ToolCallEvent))
    assert any(isinstance(e, StepStarted) for e in events[:first_call])  # the header before the reply


def test_repeated_tool_call_ids_from_the_model_still_run_each_call(make_client: Any, workspace: Path) -> None:
    """Some servers number tool calls per reply ("call_0" every time): the executor must still see a
    fresh call id each time, or it would answer from its at-most-once cache instead of running."""
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(script=[calls(("tick", {})), calls(("tick", {})), say("counted")])
    events = run(ReactAgent(model, client))
    assert [r.value for r in of(ToolResultEvent, events)] == [1, 2]


def test_completion_signal_ends_the_run_without_another_model_request(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(script=[calls(("finish", {"summary": "report written"})), say("never asked")])
    events = run(ReactAgent(model, client))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.status, finished.summary) == ("completed", "report written")
    assert len(model.received) == 1


def test_exit_signal_stops_the_run(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(script=[calls(("give_up", {"reason": "no credentials"})), say("never asked")])
    finished = run(ReactAgent(model, client))[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "stopped" and "give_up asked to stop the run: no credentials" in finished.reason
    assert len(model.received) == 1


def test_notes_from_tools_become_notices(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[CIAYN_TOOLS], workspace=workspace)
    model = ScriptedChat(script=[calls(("tell", {"text": "found 3 failing tests"})), say("ok")])
    events = run(ReactAgent(model, client))
    assert "tell: found 3 failing tests" in [n.text for n in of(Notice, events)]


def test_max_steps_stops_the_run(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(script=[calls(("echo", {"value": i})) for i in range(5)])
    events = run(ReactAgent(model, client, max_steps=2))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "stopped" and "step limit (2)" in finished.reason
    assert finished.steps == 2 and finished.calls == 2 and len(model.received) == 2


def test_max_cost_stops_the_run_and_usage_is_counted(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(script=[calls(("echo", {"value": i}), tokens=100) for i in range(5)])
    agent = ReactAgent(model, client, max_cost=0.025, price=lambda message: 0.01)
    events = run(agent)
    usage = of(Usage, events)
    assert [u.prompt_tokens for u in usage] == [100, 100, 100]
    assert usage[-1].total_prompt_tokens == 300 and usage[-1].total_completion_tokens == 15
    assert usage[-1].total_cost == pytest.approx(0.03)
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "stopped" and "cost limit" in finished.reason
    assert finished.tokens == 315 and finished.cost == pytest.approx(0.03)


def test_an_unavailable_executor_ends_the_run(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])

    def executor_goes_away(messages: list[BaseMessage]) -> AIMessage:
        client.close()  # from here on, every call is answered `unavailable`
        return calls(("echo", {"value": 2}))

    model = ScriptedChat(script=[calls(("echo", {"value": 1})), executor_goes_away, say("never asked")])
    events = run(ReactAgent(model, client))
    results = of(ToolResultEvent, events)
    assert [(r.ok, r.error_kind) for r in results] == [(True, None), (False, "unavailable")]
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "failed" and "the executor is unavailable" in finished.reason
    assert len(model.received) == 2


def test_stop_during_a_model_request_sends_no_calls(make_client: Any, tmp_path: Path) -> None:
    client = make_client(tools=[FAULTY])
    marker = tmp_path / "must-not-exist"
    agent: ReactAgent

    def interrupted(messages: list[BaseMessage]) -> AIMessage:
        agent.stop("interrupted by the user")  # what the CLI does on Ctrl-C
        return calls(("append_line", {"path": str(marker)}))

    agent = ReactAgent(ScriptedChat(script=[interrupted]), client)
    events = run(agent)
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.status, finished.reason) == ("stopped", "interrupted by the user")
    assert of(ToolResultEvent, events) == [] and not marker.exists()


def test_transient_model_errors_are_retried_and_a_bad_request_fails_the_run(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(
        script=[
            TransientError("rate limited"),
            calls(("echo", {"value": "once"})),
            TransientError("rate limited again"),
            BadRequest("Invalid schema for function 'echo'"),
        ]
    )
    agent = ReactAgent(model, client, retries=3, retry_base_s=0.001)
    events = run(agent)
    assert [r.value for r in of(ToolResultEvent, events)] == ["once"]  # ran once, though the step was retried
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "failed" and "Invalid schema for function 'echo'" in finished.reason
    assert "HTTP 400" in finished.reason
    assert len(model.received) == 4 and finished.steps == 2
    # The retried request was the same request: the task once, not twice.
    assert model.received[0] == model.received[1]


def test_transient_errors_give_up_after_the_retries(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(script=[TransientError("busy")] * 3)
    finished = run(ReactAgent(model, client, retries=2, retry_base_s=0.001))[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "failed" and "after 3 attempts" in finished.reason and len(model.received) == 3


def test_stop_during_a_retry_backoff_ends_the_run_without_waiting(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    agent: ReactAgent

    def busy_then_interrupted(messages: list[BaseMessage]) -> AIMessage:
        agent.stop("interrupted by the user")
        raise TransientError("busy")

    agent = ReactAgent(ScriptedChat(script=[busy_then_interrupted]), client, retry_base_s=600, retry_cap_s=600)
    finished = run(agent)[-1]  # a 600 s backoff would hit the test timeout
    assert isinstance(finished, Finished)
    assert (finished.status, finished.reason) == ("stopped", "interrupted by the user")


def test_the_create_react_agent_deprecation_warning_stays_out_of_sight(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(ReactAgent(ScriptedChat(script=[calls(("finish", {}))]), client))
    assert [w for w in caught if issubclass(w.category, LangGraphDeprecatedSinceV10)] == []


def test_unknown_tool_and_bad_arguments_are_told_to_the_model(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(
        script=[
            calls(("no_such_tool", {"x": 1}), ("echo", {"nonsense": 1})),
            say("gave up"),
        ]
    )
    events = run(ReactAgent(model, client))
    rejected = of(Rejected, events)
    assert [(r.code, r.text) for r in rejected] == [("unknown_tool", "no_such_tool(x=1)")]
    results = of(ToolResultEvent, events)
    assert [(r.tool, r.error_kind) for r in results] == [("echo", "bad_arguments")]
    fed_back = tool_messages(model.received[1])
    assert [m.status for m in fed_back] == ["error", "error"]
    assert "nonsense" in str(fed_back[1].content)


def test_unparsable_tool_call_arguments_are_rejected_and_the_run_goes_on(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    broken = AIMessage(
        content="",
        invalid_tool_calls=[
            {"name": "echo", "args": "{value: oops", "id": "bad_1", "error": "not JSON", "type": "invalid_tool_call"}
        ],
    )
    model = ScriptedChat(script=[broken, calls(("finish", {"summary": "fixed"}))])
    events = run(ReactAgent(model, client))
    assert [r.code for r in of(Rejected, events)] == ["bad_arguments"]
    assert "not run" in str(model.received[1][-1].content) and isinstance(model.received[1][-1], HumanMessage)
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.status == "completed"


def test_model_text_and_reasoning_are_reported(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(script=[AIMessage(content="<think>easy</think>The answer is 4.")])
    events = run(ReactAgent(model, client, show_reasoning=True))
    assert [(t.step, t.text, t.reasoning) for t in of(ModelText, events)] == [(1, "The answer is 4.", "easy")]


def test_history_is_trimmed_to_the_token_budget_keeping_the_task_and_whole_turns(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    big = "x" * 2000  # about 500 tokens per result
    model = ScriptedChat(script=[*(calls(("echo", {"value": big}), ids=[f"c{i}"]) for i in range(4)), say("done")])
    events = run(ReactAgent(model, client, max_input_tokens=2000), task="echo big values")
    last = model.received[-1]
    assert isinstance(last[0], HumanMessage) and str(last[0].content).startswith("echo big values")
    assert "earlier messages of this conversation were left out" in str(last[0].content)
    # Whatever was kept, each tool result follows the assistant call it answers.
    for i, m in enumerate(last):
        if isinstance(m, ToolMessage):
            previous = last[i - 1]
            assert isinstance(previous, AIMessage) and previous.tool_calls[0]["id"] == m.tool_call_id
    assert len(last) < 1 + 2 * 4 and isinstance(last[-1], ToolMessage) and last[-1].tool_call_id == "c3"
    assert sum("History trimmed" in n.text for n in of(Notice, events)) == 1


def test_create_agent_with_a_chat_model_runs_react_and_says_so(make_client: Any) -> None:
    client = make_client(tools=[FAULTY])
    model = ScriptedChat(script=[calls(("finish", {"summary": "ok"}))])
    agent = create_agent(model, client, max_steps=3, max_invalid=2)  # max_invalid is CIAYN's: ignored
    assert agent.backend == "react" and isinstance(agent.impl, ReactAgent)
    events = run(agent)
    assert isinstance(events[0], Notice) and "react" in events[0].text
    assert isinstance(events[-1], Finished) and events[-1].status == "completed"
    with pytest.raises(TypeError, match="no_such_option"):
        create_agent(model, client, no_such_option=1)
    with pytest.raises(ValueError, match="react backend"):
        create_agent(model, client, backend="ciayn")


# --- the pure parts ----------------------------------------------------------------------------


def _spec(fn: Callable[..., Any]) -> ToolSpec:
    return ToolSpec.from_function(fn)


def test_tool_proxies_carry_the_executor_json_schema() -> None:
    def write(path: str, content: str, mode: int = 0o644) -> None:
        """Write a file."""

    [tool] = make_tools([_spec(write)], ExecutorBridge(client=None))  # type: ignore[arg-type]
    schema = tool.tool_call_schema
    assert isinstance(schema, dict)
    assert set(schema["properties"]) == {"path", "content", "mode"} and schema["required"] == ["path", "content"]
    assert tool.name == "write" and tool.description == "Write a file."


def test_positional_only_arguments_move_to_args() -> None:
    def f(a: int, /, b: int, *, c: int = 0) -> None: ...

    call = call_from_arguments(_spec(f), {"a": 1, "b": 2, "c": 3})
    assert (call.args, call.kwargs) == ([1], {"b": 2, "c": 3})


def test_trimming_keeps_the_first_message_and_calls_with_their_results() -> None:
    task = HumanMessage("task")

    def turn(i: int) -> list[BaseMessage]:
        return [
            AIMessage(content="", tool_calls=[{"name": "t", "args": {"i": i}, "id": f"c{i}", "type": "tool_call"}]),
            ToolMessage(content="r" * 400, tool_call_id=f"c{i}"),
        ]

    messages = [task, *turn(0), *turn(1), *turn(2)]
    per_turn = estimate_message_tokens(turn(0))
    kept, dropped = trim_messages(messages, estimate_message_tokens([task]) + 2 * per_turn)
    assert kept == [task, *turn(1), *turn(2)] and dropped == 2
    kept, dropped = trim_messages(messages, 1)  # too small for anything: the task and the newest turn
    assert kept == [task, *turn(2)] and dropped == 4
    assert trim_messages(messages, 10**6) == (messages, 0)


def test_a_stopping_run_sends_no_more_calls() -> None:
    stopping = threading.Event()
    stopping.set()
    bridge = ExecutorBridge(client=None, stopping=stopping)  # type: ignore[arg-type]  # never reached
    text, artifact = bridge.call(_spec(lambda: None), {})
    assert artifact["ok"] is False and artifact["error"]["kind"] == "cancelled"
    assert text == "Error: The call was cancelled (the run was stopped before this call was sent)."


class RecordingClient:
    """Answers every call with its own arguments (for the pure proxy tests; no executor)."""

    def __init__(self) -> None:
        self.sent: list[Call] = []

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]:
        self.sent.append(call)
        done: Future[Result] = Future()
        done.set_result(Result(id=call.id or "", ok=True, value=call.kwargs))
        return done

    def call(self, call: Call, timeout: float | None = None) -> Result:
        return self.submit(call, timeout).result()

    def cancel(self, call_id: str) -> None:
        raise AssertionError("nothing is cancelled here")


def test_the_proxy_passes_every_argument_name_through_to_the_call() -> None:
    """Names LangChain injects into tools of its own (config, run_manager, callbacks) must reach
    the executor as ordinary arguments."""

    def deploy(config: str, run_manager: str = "", callbacks: int = 0) -> None:
        """Deploy."""

    client = RecordingClient()
    [tool] = make_tools([_spec(deploy)], ExecutorBridge(client))  # type: ignore[arg-type]
    args = {"config": "prod", "run_manager": "me", "callbacks": 2}
    message = tool.invoke({"name": "deploy", "args": args, "id": "t1", "type": "tool_call"})
    assert isinstance(message, ToolMessage) and message.tool_call_id == "t1"
    assert [c.kwargs for c in client.sent] == [args]
    assert message.artifact["ok"] is True and message.artifact["value"] == args
