"""End to end on the real embedded model: SmolLM2-135M behind the llama-cpp-python server drives the
CIAYN loop, and every call runs in a real executor (the built-in toolkit on a temporary workspace).

The agent is set up as ``ciayn run`` sets up the local model (``create_agent`` on the server: compact
prompt, example turns, reply cap; a test checks that both make the same agent) and as
``scripts/demo`` narrows its tools; the Python examples of the README and docs/usage.md run as
written. The model is weak, so these tests assert the form of
what it does (valid calls, calls executed, a clean end), never that it finishes the task;
``scripts/eval_local_model.py`` measures that. Needs ``scripts/setup-model``; skipped without it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.agent import create_agent
from controller.ciayn import CiaynAgent
from controller.events import Finished, ModelText, StepEvent, ToolResultEvent
from controller.local_model import LOCAL_MAX_TOKENS, LocalModelServer
from controller.models import ModelConfig
from protocol import CallRejected, parse_calls
from tests.support.embedded_model import needs_model

ROOT = Path(__file__).resolve().parent.parent
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
    agent = create_agent(server, client, backend="ciayn", max_steps=MAX_STEPS, allow_tools=TOOLS, use_grammar=grammar)
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


def python_examples(doc: Path) -> list[str]:
    """The Python code blocks of ``doc`` that use the embedded model through ``create_agent("local", ...)``."""
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL)
    return [b for b in blocks if 'create_agent("local"' in b]


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_the_documented_local_model_example_runs_as_written(doc: str, tmp_path: Path) -> None:
    [example] = python_examples(ROOT / doc)
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("hello from the workspace\n")  # the README tour's file
    ran = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert ran.returncode == 0, ran.stderr
    last = ran.stdout.strip().splitlines()[-1]
    status = json.loads(last)["status"] if last.startswith("{") else last
    assert status in ("completed", "stopped", "failed"), ran.stdout


def test_ciayn_run_and_create_agent_local_make_the_same_agent(
    server: LocalModelServer, client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller import cli

    made: list[Any] = []
    real = cli._make_agent
    monkeypatch.setattr(cli, "_make_agent", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    ws = tmp_path / "cli-ws"
    ws.mkdir()
    cli.main(["run", "List the workspace", "--workspace", str(ws), "--max-steps", "1", "--json"])
    [from_cli] = made
    ours = create_agent(server, client, max_steps=1)
    assert type(from_cli.impl) is type(ours.impl) is CiaynAgent

    def settings(agent: Any) -> dict[str, Any]:
        names = [n for n in inspect.signature(CiaynAgent).parameters if n not in ("model", "client")]
        config = dataclasses.replace(agent.impl.model.config, api_base=None)  # each its own server's port
        return {"config": config, **{n: getattr(agent.impl, n) for n in names}}

    assert settings(from_cli) == settings(ours)
    expected = ModelConfig(model=server.ciayn_model, use_grammar=True, max_tokens=LOCAL_MAX_TOKENS)
    assert settings(ours)["config"] == expected
