"""The model layer: content normalisation, retries and errors, the litellm path (offline, through
litellm's own ``mock_response``), and the scripted model."""

from __future__ import annotations

import os
from typing import Any

import pytest

from controller.models import (
    OFFLINE_ENV,
    LiteLLMModel,
    Model,
    ModelConfig,
    ModelError,
    ModelReply,
    ScriptedModel,
    TokenUsage,
    complete,
    import_litellm,
    is_transient,
    split_content,
    split_think,
    with_retries,
)
from tests.support.net import free_port

MESSAGES = [{"role": "user", "content": "read README.md"}]


# --- reasoning and content shapes -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rest", "reasoning"),
    [
        ("read_file('a')", "read_file('a')", ""),
        ("<think>plan</think>\nread_file('a')", "read_file('a')", "plan"),
        ("<think>a</think>read_file('a')<think>b</think>", "read_file('a')", "a\n\nb"),
        ("<THINKING>upper</THINKING> f()", "f()", "upper"),
        ("<think>still going, f(", "", "still going, f("),
        ("reasoning without an opening tag</think>\nf()", "f()", "reasoning without an opening tag"),
        ("<think></think>f()", "f()", ""),
    ],
)
def test_split_think(text: str, rest: str, reasoning: str) -> None:
    assert split_think(text) == (rest, reasoning)


def test_split_content_handles_list_shaped_content() -> None:
    blocks: list[Any] = [
        {"type": "thinking", "thinking": "first I think"},
        {"type": "text", "text": "f(1)"},
        {"type": "image_url", "image_url": {"url": "x"}},
        "g(2)",
        {"type": "reasoning", "reasoning": "more"},
    ]
    assert split_content(blocks) == ("f(1)\ng(2)", "first I think\n\nmore")
    assert split_content(None) == ("", "")
    assert split_content([]) == ("", "")
    assert split_content([{"type": "text", "text": "<think>x</think>f()"}]) == ("f()", "x")


def test_model_reply_from_content_joins_structured_and_inline_reasoning() -> None:
    reply = ModelReply.from_content("<think>inline</think>f()", reasoning="structured")
    assert (reply.text, reply.reasoning) == ("f()", "structured\n\ninline")


# --- retries and errors -----------------------------------------------------------------------


class FakeAPIError(Exception):
    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RateLimitError(FakeAPIError):
    pass


class APIConnectionError(FakeAPIError):
    pass


def test_transient_errors_are_recognised() -> None:
    assert is_transient(RateLimitError("slow down", 429))
    assert is_transient(FakeAPIError("bad gateway", 502))
    assert is_transient(APIConnectionError("refused"))
    assert not is_transient(FakeAPIError("bad request", 400))
    assert not is_transient(FakeAPIError("unauthorised", 401))
    assert not is_transient(FakeAPIError("Missing credentials. Please pass an `api_key`", 500))
    assert not is_transient(ValueError("a bug"))


def test_transient_errors_are_retried_with_capped_exponential_backoff() -> None:
    attempts: list[int] = []
    sleeps: list[float] = []

    def request() -> str:
        attempts.append(1)
        if len(attempts) < 5:
            raise RateLimitError("rate limited", 429)
        return "ok"

    assert with_retries(request, model="m", retries=4, base_s=1.0, cap_s=3.0, sleep=sleeps.append) == "ok"
    assert len(attempts) == 5
    assert [round(s) for s in sleeps] == [1, 2, 3, 3]
    assert all(s <= 3.0 * 1.1 for s in sleeps)


def test_retries_run_out_with_a_model_error() -> None:
    def request() -> str:
        raise FakeAPIError("upstream down", 503)

    with pytest.raises(ModelError) as caught:
        with_retries(request, model="m", retries=2, base_s=0, sleep=lambda s: None)
    assert caught.value.transient and caught.value.status == 503
    assert "after 3 attempts" in str(caught.value) and "upstream down" in str(caught.value)


def test_a_400_error_fails_at_once_with_the_providers_message_in_one_paragraph() -> None:
    calls: list[int] = []

    def request() -> str:
        calls.append(1)
        raise FakeAPIError("litellm.BadRequestError: the 'grammar' field\n   is not supported", 400)

    with pytest.raises(ModelError) as caught:
        with_retries(request, model="openai/x", retries=5, sleep=lambda s: None)
    assert len(calls) == 1
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        "The model 'openai/x' request failed (HTTP 400, FakeAPIError): the 'grammar' field is not supported"
    )
    assert not caught.value.transient


# --- config -----------------------------------------------------------------------------------


def test_config_hides_the_api_key_and_builds_litellm_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(model="openai/gpt-4o-mini", api_key="sk-secret", max_tokens=50, extras={"top_p": 0.5})
    assert "sk-secret" not in repr(config)
    assert config.litellm_kwargs() == {
        "model": "openai/gpt-4o-mini",
        "timeout": 120.0,
        "api_key": "sk-secret",
        "temperature": 0.0,
        "max_tokens": 50,
        "top_p": 0.5,
    }
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    local = ModelConfig(model="openai/smollm2", api_base="http://127.0.0.1:8080/v1")
    assert local.litellm_kwargs()["api_key"] == "sk-no-key-required"
    assert "api_key" not in ModelConfig(model="anthropic/claude").litellm_kwargs()  # litellm reads the env


def test_repair_config_uses_the_fallback_model() -> None:
    config = ModelConfig(model="openai/small", repair=True, repair_model="openai/big")
    assert config.for_repair().model == "openai/big"
    assert ModelConfig(model="openai/small").for_repair().model == "openai/small"


# --- the litellm path, offline ----------------------------------------------------------------


def test_import_litellm_sets_the_offline_switches_first() -> None:
    litellm = import_litellm()
    for key in OFFLINE_ENV:
        assert os.environ.get(key), key
    assert litellm.suppress_debug_info is True


def test_complete_through_litellm_returns_text_usage_and_cost() -> None:
    config = ModelConfig(model="gpt-4o", extras={"mock_response": "<think>hm</think>read_file(path='README.md')"})
    reply = complete(config, MESSAGES)
    assert reply.text == "read_file(path='README.md')"
    assert reply.reasoning == "hm"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    assert reply.cost > 0  # litellm's bundled price map knows gpt-4o
    unknown = complete(
        ModelConfig(model="openai/local-alias", api_base="http://127.0.0.1:9/v1", extras={"mock_response": "f()"}),
        MESSAGES,
    )
    assert unknown.text == "f()" and unknown.cost == 0.0


def test_grammar_and_stop_reach_litellm(monkeypatch: pytest.MonkeyPatch) -> None:
    litellm = import_litellm()
    seen: dict[str, Any] = {}
    original = litellm.completion

    def spy(**kwargs: Any) -> Any:
        seen.update(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(litellm, "completion", spy)
    config = ModelConfig(model="gpt-4o", extras={"mock_response": "f()", "extra_body": {"cache_prompt": True}})
    complete(config, MESSAGES, grammar='root ::= "f()"', stop=["\n\n"])
    assert seen["extra_body"] == {"cache_prompt": True, "grammar": 'root ::= "f()"'}
    assert seen["stop"] == ["\n\n"]
    assert seen["max_retries"] == 0  # one retry policy: ours
    assert seen["messages"] == MESSAGES and seen["messages"] is not MESSAGES


def test_litellm_rate_limits_are_retried_then_reported() -> None:
    config = ModelConfig(
        model="gpt-4o", extras={"mock_response": "litellm.RateLimitError"}, retries=2, retry_base_s=0.0
    )
    with pytest.raises(ModelError) as caught:
        complete(config, MESSAGES)
    assert caught.value.transient and caught.value.status == 429
    assert "after 3 attempts" in str(caught.value) and "RateLimitError" in str(caught.value)


def test_litellm_context_window_error_fails_at_once_with_a_hint() -> None:
    config = ModelConfig(model="gpt-4o", extras={"mock_response": "litellm.ContextWindowExceededError"})
    with pytest.raises(ModelError) as caught:
        complete(config, MESSAGES)
    assert caught.value.status == 400 and not caught.value.transient
    assert "lower the history limits" in str(caught.value)


def test_missing_api_key_is_not_retried_and_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = ModelConfig(model="gpt-4o", retries=3, retry_base_s=5.0, request_timeout=5)
    with pytest.raises(ModelError) as caught:
        complete(config, MESSAGES)
    assert not caught.value.transient
    assert "OPENAI_API_KEY" in str(caught.value)


def test_litellm_model_counts_tokens_offline_and_knows_context_limits() -> None:
    model = LiteLLMModel(ModelConfig(model="gpt-4o", extras={"mock_response": "f()"}))
    assert isinstance(model, Model)
    assert 0 < model.count_tokens(MESSAGES) < 20
    assert model.max_input_tokens() == 128000
    assert LiteLLMModel(ModelConfig(model="openai/local-alias")).max_input_tokens() is None
    assert model.complete(MESSAGES).text == "f()"


# --- the scripted model -----------------------------------------------------------------------


def test_scripted_model_replays_its_script_and_records_requests() -> None:
    seen: list[Any] = []

    def dynamic(messages: list[dict[str, Any]]) -> str:
        seen.append(messages)
        return f"echo({len(messages)})"

    script: list[Any] = ["a()", [{"type": "text", "text": "b()"}], dynamic, ModelError("down"), ModelReply(text="c()")]
    model = ScriptedModel(script, cost_per_call=0.25, prompt_tokens=7, completion_tokens=3)
    assert isinstance(model, Model)
    messages = [{"role": "user", "content": "hi"}]
    first = model.complete(messages, grammar="g")
    assert (first.text, first.usage, first.cost) == ("a()", TokenUsage(7, 3), 0.25)
    messages[0]["content"] = "changed"  # the recorded request is a copy
    assert model.requests[0] == [{"role": "user", "content": "hi"}]
    assert model.complete(messages).text == "b()"
    assert model.complete(messages).text == "echo(1)" and seen == [[{"role": "user", "content": "changed"}]]
    with pytest.raises(ModelError, match="down"):
        model.complete(messages)
    assert model.complete(messages).text == "c()"
    assert model.grammars == ["g", None, None, None, None]
    with pytest.raises(ModelError, match="no reply left"):
        model.complete(messages)


def test_scripted_model_estimates_usage_by_default() -> None:
    reply = ScriptedModel(["f(x=1)"]).complete([{"role": "user", "content": "x" * 400}])
    assert reply.usage.prompt_tokens == 104 and reply.usage.completion_tokens > 0
    assert reply.cost == 0.0


def test_litellm_model_over_real_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real OpenAI-compatible server on 127.0.0.1: a 503 is retried, the grammar travels in the
    body, reasoning is split off, and a 400 fails at once with the server's message."""
    stub_module = pytest.importorskip("llm_stub")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    replies = [
        stub_module.StubError(503, "overloaded"),
        "<think>the file</think>read_file(path='a')",
        stub_module.StubError(400, "grammar not supported"),
    ]
    with stub_module.LLMStub(replies) as stub:
        model = LiteLLMModel(ModelConfig(model="openai/stub", api_base=stub.api_base, retry_base_s=0.01))
        reply = model.complete(MESSAGES, grammar='root ::= "x"')
        assert (reply.text, reply.reasoning) == ("read_file(path='a')", "the file")
        assert reply.usage.prompt_tokens > 0 and reply.cost == 0.0
        assert len(stub.requests) == 2 and stub.requests[-1]["grammar"] == 'root ::= "x"'
        with pytest.raises(ModelError) as caught:
            model.complete(MESSAGES)
        assert caught.value.status == 400 and "grammar not supported" in str(caught.value)
        assert len(stub.requests) == 3


def test_a_connection_refused_through_litellm_is_tried_at_most_twice() -> None:
    """litellm says "Connection error"; the refusal is the ``ConnectionRefusedError`` at the end of
    the chain. A server that is down stays down for the seconds a backoff waits."""
    litellm = import_litellm()
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    attempts: list[float] = []

    def request() -> Any:
        attempts.append(1)
        return litellm.completion(model="openai/stub", api_base=url, api_key="sk-none", max_retries=0,
                                  messages=[{"role": "user", "content": "hi"}])

    with pytest.raises(ModelError):
        with_retries(request, model="openai/stub", retries=4, base_s=0, sleep=lambda s: None)
    assert len(attempts) == 2, f"{len(attempts)} attempts"
