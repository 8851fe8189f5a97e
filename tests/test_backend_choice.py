"""Backend choice: the user's --backend, the table of known models, litellm's map, and the fallback."""

from __future__ import annotations

from typing import Any

import pytest

from controller.agent import create_agent
from controller.backend import KNOWN_BACKENDS, choose_backend, should_use_react_agent, table_backend
from controller.ciayn import CiaynAgent
from controller.events import Notice
from controller.models import ScriptedModel, import_litellm
from controller.react import ReactAgent


@pytest.fixture
def litellm() -> Any:
    return import_litellm()


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4o",
        "openai/gpt-4o-mini",
        "openai/gpt-4.1-nano",
        "claude-3-5-sonnet-20241022",  # retired: litellm's map says no tool calling
        "anthropic/claude-3-7-sonnet-latest",
        "anthropic/claude-sonnet-4-20250514",
        "openai/smollm2-tools",  # the embedded model's tool-calling alias
        "mistral/mistral-large-latest",  # not in the table: litellm's map knows it
    ],
)
def test_known_tool_calling_models_use_react(model: str) -> None:
    choice = choose_backend(model)
    assert choice.backend == "react" and choice.notice is None
    assert should_use_react_agent(model) is True


@pytest.mark.parametrize(
    "model",
    [
        "openai/stub",
        "openai/smollm2",
        "openai/my-local-alias",
        "unknown-model-xyz",
        "gpt-3.5-turbo-instruct",
        "ollama/llama2",
    ],
)
def test_unknown_and_local_models_use_ciayn(model: str) -> None:
    choice = choose_backend(model)
    assert choice.backend == "ciayn" and choice.notice is None
    assert should_use_react_agent(model) is False


def test_the_table_beats_litellm_and_the_reasons_say_where_the_answer_came_from(litellm: Any) -> None:
    assert litellm.supports_function_calling(model="claude-3-5-sonnet-20241022") is False
    assert "listed" in choose_backend("claude-3-5-sonnet-20241022").reason
    assert "litellm lists" in choose_backend("mistral/mistral-large-latest").reason
    assert "litellm does not list" in choose_backend("openai/stub").reason
    assert table_backend("OpenAI/GPT-4o-2024-08-06") == "react"  # case-insensitive, bare name
    assert table_backend("openai/smollm2") == "ciayn" and table_backend("openai/smollm2-tools") == "react"
    assert table_backend("openai/my-alias") is None
    assert all(b in ("react", "ciayn") for b in KNOWN_BACKENDS.values())


def test_the_users_choice_wins() -> None:
    assert choose_backend("gpt-4o", "ciayn").backend == "ciayn"
    assert choose_backend("openai/stub", "react").backend == "react"
    assert choose_backend("openai/stub", "react").reason == "chosen by the user"
    assert should_use_react_agent("openai/stub", {"backend": "react"}) is True
    assert choose_backend("gpt-4o", "auto", {"backend": "ciayn"}).backend == "ciayn"
    assert choose_backend("gpt-4o", "ciayn", {"backend": "react"}).backend == "ciayn"  # the argument first
    with pytest.raises(ValueError, match="react, ciayn"):
        choose_backend("gpt-4o", "langgraph")


def test_the_callers_table_and_declaration_come_before_litellm() -> None:
    assert choose_backend("openai/my-alias", config={"backends": {"openai/my-*": "react"}}).backend == "react"
    assert choose_backend("gpt-4o", config={"backends": {"gpt-4o": "ciayn"}}).backend == "ciayn"
    assert should_use_react_agent("openai/my-alias", {"supports_function_calling": True}) is True
    assert should_use_react_agent("mistral/mistral-large-latest", {"supports_function_calling": False}) is False
    with pytest.raises(ValueError):
        choose_backend("x", config={"backends": {"x": "fast"}})


def test_ollama_chat_names_are_never_passed_to_litellm(litellm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm asks a local Ollama server (HTTP to localhost:11434) about an ollama_chat model it
    does not know; backend choice must not make that request."""

    def no_lookup(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("litellm.supports_function_calling was asked")

    monkeypatch.setattr(litellm, "supports_function_calling", no_lookup)
    choice = choose_backend("ollama_chat/qwen2.5")
    assert choice.backend == "ciayn" and choice.notice is None and "Ollama" in choice.reason


def test_detection_failure_falls_back_to_ciayn_with_a_notice(litellm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("model map unreadable")

    monkeypatch.setattr(litellm, "supports_function_calling", broken)
    choice = choose_backend("openai/some-model")
    assert choice.backend == "ciayn"
    assert choice.notice is not None
    assert "detection failed" in choice.notice and "model map unreadable" in choice.notice
    assert "CIAYN" in choice.notice
    assert should_use_react_agent("openai/some-model") is False
    assert choose_backend("gpt-4o").backend == "react"  # the table needs no lookup


def test_create_agent_reports_the_choice_first_in_the_stream(
    litellm: Any, monkeypatch: pytest.MonkeyPatch, make_client: Any
) -> None:
    def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("model map unreadable")

    monkeypatch.setattr(litellm, "supports_function_calling", broken)
    client = make_client()
    agent = create_agent(
        "openai/some-model", client, api_base="http://127.0.0.1:9/v1", max_steps=1, max_input_tokens=100
    )  # max_input_tokens is ReAct's: ignored by CIAYN
    assert agent.backend == "ciayn" and isinstance(agent.impl, CiaynAgent)
    assert agent.impl.model.config.api_base == "http://127.0.0.1:9/v1"  # type: ignore[attr-defined]
    first = next(iter(agent.stream("anything")))
    assert isinstance(first, Notice) and "detection failed" in first.text


def test_create_agent_builds_each_backend_from_a_name(make_client: Any) -> None:
    client = make_client()
    react = create_agent("gpt-4o-mini", client, api_key="sk-test", max_steps=4, call_timeout=2.0)
    assert react.backend == "react" and isinstance(react.impl, ReactAgent)
    assert (react.impl.max_steps, react.impl.call_timeout, react.impl.model_name) == (4, 2.0, "gpt-4o-mini")
    assert react.impl.max_input_tokens  # litellm knows gpt-4o-mini's context window
    ciayn = create_agent("openai/stub", client, backend="auto", api_base="http://127.0.0.1:9/v1")
    assert ciayn.backend == "ciayn"
    forced = create_agent("openai/stub", client, backend="react", api_base="http://127.0.0.1:9/v1")
    assert forced.backend == "react" and forced.choice.reason == "chosen by the user"
    with pytest.raises(ValueError, match="react backend"):
        create_agent(ScriptedModel([]), client, backend="react")
    assert create_agent(ScriptedModel([]), client).backend == "ciayn"
    with pytest.raises(TypeError, match="ModelConfig"):
        create_agent(ScriptedModel([]), client, api_base="http://127.0.0.1:9/v1")
