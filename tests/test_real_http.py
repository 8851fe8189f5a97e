"""The ReAct backend over real HTTP: litellm's OpenAI client -> the stub server on 127.0.0.1, and the
tools in a real executor. Nothing is mocked but the model's replies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from llm_stub import LLMStub, StubError, tool_call

from controller.agent import create_agent
from controller.events import Finished, StepEvent, ToolCallEvent, ToolResultEvent, Usage
from controller.models import ModelConfig, import_litellm
from controller.react import ReactAgent

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = "executor.toolkits.builtin"
SHELL = "executor.toolkits.shell"  # run_shell: not in the default toolkit


@pytest.fixture(autouse=True)
def no_real_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def of(kind: type, events: list[StepEvent]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def test_react_run_over_http_writes_a_file_from_the_executor(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[BUILTIN], workspace=workspace)
    replies = [
        tool_call("write_file", path="out.txt", content="written by a worker"),
        [tool_call("read_file", path="out.txt"), tool_call("list_dir", path=".")],  # parallel calls
        tool_call("complete_task", summary="out.txt written"),
    ]
    with LLMStub(replies) as stub:
        agent = ReactAgent.from_config(ModelConfig(model="openai/stub", api_base=stub.api_base), client)
        events = list(agent.stream("Write out.txt"))

        # The tools ran in the executor's workers, not here.
        assert (workspace / "out.txt").read_text() == "written by a worker"
        results = of(ToolResultEvent, events)
        assert [r.tool for r in results] == ["write_file", "read_file", "list_dir", "complete_task"]
        assert all(r.ok and r.worker_pid and r.worker_pid != os.getpid() for r in results)
        assert results[1].value == "written by a worker" and "out.txt" in results[2].value

        # The model got the executor's JSON Schemas as tools, and each result under its call's id.
        tools = {t["function"]["name"]: t["function"] for t in stub.requests[0]["tools"]}
        assert set(tools) == {"read_file", "write_file", "list_dir", "emit_note", "complete_task"}
        assert tools["write_file"]["parameters"]["required"] == ["path", "content"]
        sent = stub.requests[2]["messages"]
        tool_results = {m["tool_call_id"]: m["content"] for m in sent if m["role"] == "tool"}
        call_ids = [c.call_id for c in of(ToolCallEvent, events)]
        assert set(call_ids[1:3]) <= set(tool_results) and tool_results[call_ids[1]] == "written by a worker"
        assert sent[0]["role"] == "user" and sent[0]["content"].startswith("Write out.txt")
        assert "complete_task" in sent[0]["content"]
        assert len(stub.requests) == 3

    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.status, finished.summary, finished.steps, finished.calls) == ("completed", "out.txt written", 3, 4)
    usage = of(Usage, events)
    assert len(usage) == 3 and usage[-1].total_prompt_tokens > 0 and finished.tokens > 0


def test_http_errors_retry_when_transient_and_fail_the_run_when_not(make_client: Any, workspace: Path) -> None:
    client = make_client(tools=[BUILTIN], workspace=workspace)
    replies = [
        StubError(503, "overloaded"),
        tool_call("list_dir", path="."),
        StubError(400, "Invalid 'tools[0].function.parameters': schema rejected"),
    ]
    with LLMStub(replies) as stub:
        config = ModelConfig(model="openai/stub", api_base=stub.api_base, retry_base_s=0.01)
        events = list(create_agent(config, client, backend="react").stream("list the files"))
        assert len(stub.requests) == 3
    assert len(of(ToolResultEvent, events)) == 1
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.status == "failed" and "HTTP 400" in finished.reason and "schema rejected" in finished.reason


def test_ciayn_run_cli_with_the_react_backend_completes_over_http(workspace: Path, tmp_path: Path) -> None:
    replies = [
        tool_call("write_file", path="cli.txt", content="from the CLI run"),
        tool_call("complete_task", summary="cli.txt written"),
    ]
    with LLMStub(replies) as stub:
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "controller.cli",
                "run",
                "Write cli.txt",
                "--model",
                "openai/stub",
                "--api-base",
                stub.api_base,
                "--tools",
                BUILTIN,
                "--backend",
                "react",
                "--workspace",
                str(workspace),
                "--json",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
        assert len(stub.requests) == 2
    assert (workspace / "cli.txt").read_text() == "from the CLI run"
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "finished" and events[-1]["status"] == "completed"
    assert any(e["event"] == "tool_result" and e["tool"] == "write_file" and e["ok"] for e in events)


def test_ciayn_run_cli_with_the_ciayn_backend_completes_over_http(workspace: Path) -> None:
    """The CIAYN path through the CLI: text replies parsed into calls, run in a private executor,
    and a timeout from --timeout that the executor enforces on a call."""
    replies = [
        'write_file(path="ciayn.txt", content="from a CIAYN run")',
        'run_shell(command="sleep 30")',
        'complete_task(summary="ciayn.txt written")',
    ]
    with LLMStub(replies) as stub:
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
        proc = subprocess.run(
            [sys.executable, "-m", "controller.cli", "run", "Write ciayn.txt", "--model", "openai/stub",
             "--api-base", stub.api_base, "--backend", "ciayn", "--workspace", str(workspace), "--timeout", "1",
             "--tools", BUILTIN, "--tools", SHELL, "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
        assert len(stub.requests) == 3
        assert "tools" not in stub.requests[0]  # CIAYN sends text prompts, not tool schemas
    assert (workspace / "ciayn.txt").read_text() == "from a CIAYN run"
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    shell = [e for e in events if e["event"] == "tool_result" and e["tool"] == "run_shell"]
    assert shell and shell[0]["error_kind"] == "timeout" and shell[0]["worker_restarted"]
    assert events[-1]["event"] == "finished" and events[-1]["status"] == "completed"


def test_the_stub_streams_when_asked() -> None:
    """Server-sent events, for callers that stream: text and tool calls arrive whole, usage last."""
    litellm = import_litellm()
    with LLMStub(["hello there", tool_call("list_dir", path=".")]) as stub:
        common = {"model": "openai/stub", "api_base": stub.api_base, "api_key": "x", "stream": True}
        chunks = list(litellm.completion(messages=[{"role": "user", "content": "hi"}], **common))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hello there"
        chunks = list(litellm.completion(messages=[{"role": "user", "content": "list"}], **common))
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("list_dir", {"path": "."})]
        assert all(body["stream"] is True for body in stub.requests)
