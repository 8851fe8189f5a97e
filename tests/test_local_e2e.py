"""End to end on the real embedded model: SmolLM2-135M behind the llama-cpp-python server drives the
CIAYN loop, and every call runs in a real executor (the built-in toolkit on a temporary workspace).

The agent is set up as ``ciayn run`` sets up the local model (compact prompt, example turns, reply
cap) and as ``scripts/demo`` narrows its tools. The model is weak, so these tests assert the form of
what it does (valid calls, calls executed, a clean end), never that it finishes the task;
``scripts/eval_local_model.py`` measures that. Needs ``scripts/setup-model``; skipped without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_local_model import needs_model

from controller.agent import create_agent
from controller.ciayn import SMALL_MODEL_OPTIONS
from controller.cli import LOCAL_MAX_TOKENS
from controller.events import Finished, ModelText, StepEvent, ToolResultEvent
from controller.local_model import LocalModelServer
from controller.models import ModelConfig
from protocol import CallRejected, parse_calls

MAX_STEPS = 6
TOOLS = ["list_dir", "read_file", "complete_task"]
TASK = "List the workspace, read notes.txt, then call complete_task with the launch code from it."


pytestmark = needs_model  # skipped, saying why, without llama-cpp-python or the GGUF


@pytest.fixture(scope="module")
def server() -> Iterator[LocalModelServer]:
    with LocalModelServer() as running:
        yield running


@pytest.fixture
def client(make_client: Callable[..., Any], tmp_path: Path) -> Any:
    ws = tmp_path / "ws"
    (ws / "docs").mkdir(parents=True)
    (ws / "notes.txt").write_text("The launch code is BLUE-HARBOR-42.\nRemember to water the plants.\n")
    (ws / "docs" / "README.md").write_text("# Demo docs\n")
    return make_client(tools=["executor.toolkits.builtin"], workspace=ws)


def agent_run(server: LocalModelServer, client: Any, *, grammar: bool) -> list[StepEvent]:
    config = ModelConfig(
        model=server.ciayn_model, api_base=server.api_base, use_grammar=grammar, max_tokens=LOCAL_MAX_TOKENS
    )
    agent = create_agent(config, client, backend="ciayn", max_steps=MAX_STEPS, allow_tools=TOOLS, **SMALL_MODEL_OPTIONS)
    return list(agent.stream(TASK))


def valid_replies(events: list[StepEvent], client: Any) -> list[bool]:
    tools = {s.name: s for s in client.tools() if s.name in TOOLS}
    verdicts = []
    for event in events:
        if isinstance(event, ModelText):
            try:
                parse_calls(event.text, tools)
                verdicts.append(True)
            except CallRejected:
                verdicts.append(False)
    return verdicts


def test_under_the_grammar_every_reply_is_a_valid_call_that_runs_in_the_executor(
    server: LocalModelServer, client: Any
) -> None:
    events = agent_run(server, client, grammar=True)
    finished = events[-1]
    assert isinstance(finished, Finished) and sum(isinstance(e, Finished) for e in events) == 1
    verdicts = valid_replies(events, client)
    texts = [e.text for e in events if isinstance(e, ModelText)]
    assert verdicts and all(verdicts), f"replies the grammar should have made valid: {texts}"
    results = [e for e in events if isinstance(e, ToolResultEvent)]
    assert results, "no call reached the executor"
    assert all(r.worker_pid is not None and r.worker_pid != os.getpid() for r in results)
    assert finished.steps <= MAX_STEPS and finished.calls == len(results)
    assert finished.status in ("completed", "stopped"), finished.reason


def test_without_the_grammar_the_run_ends_cleanly(
    server: LocalModelServer, client: Any, record_property: Callable[[str, object], None]
) -> None:
    events = agent_run(server, client, grammar=False)
    assert isinstance(events[-1], Finished) and sum(isinstance(e, Finished) for e in events) == 1
    verdicts = valid_replies(events, client)
    rate = sum(verdicts) / len(verdicts) if verdicts else 0.0
    record_property("valid_call_rate_without_grammar", f"{sum(verdicts)}/{len(verdicts)}")
    print(f"valid calls without the grammar: {sum(verdicts)}/{len(verdicts)} ({rate:.0%}); {events[-1].reason}")
