"""The model layer both backends use: one config, one request path, one reply shape.

``ModelConfig`` names a litellm model and how to reach it. ``complete(config, messages)`` sends one
chat request through litellm and returns a ``ModelReply`` (text with reasoning split off, token
usage, cost), retrying transient API errors with capped exponential backoff and turning everything
else into a ``ModelError`` whose message is one paragraph for the operator.

Agents take any object with the ``Model`` protocol: ``LiteLLMModel`` (the real transport) or
``ScriptedModel`` (the mock transport of tests and demos, which never imports litellm).

litellm is imported lazily, through ``import_litellm()`` only, which first sets its offline
switches: importing litellm otherwise fetches a cost map from the network.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from protocol import split_think
from protocol.errors import CiaynError

Message = Mapping[str, Any]
"""A chat message in OpenAI form: ``{"role": "user", "content": "..."}``."""

OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_OFFLINE_MODE": "true",
    "HF_HUB_OFFLINE": "1",
}

# Transient-error retry policy (defaults of ModelConfig): attempts after the first, and the backoff.
MODEL_RETRIES = 3
RETRY_BASE_S = 1.0
RETRY_CAP_S = 20.0
ERROR_MESSAGE_CHARS = 600  # a provider's message is cut to this in a ModelError

# Status codes worth retrying; any other 4xx is the request's fault and fails at once.
_TRANSIENT_STATUS = {408, 409, 425, 429}
# Exception class names (litellm's and the openai SDK's) that mean "try again later".
_TRANSIENT_NAMES = {
    "Timeout",
    "APITimeoutError",
    "APIConnectionError",
    "RateLimitError",
    "InternalServerError",
    "ServiceUnavailableError",
    "BadGatewayError",
}
# litellm reports a missing API key as a 500; it is not transient.
_CREDENTIAL_HINTS = ("missing credentials", "api_key client option must be set", "no api key")

_CONNECTION_NAMES = {"APIConnectionError", "ConnectError", "ConnectionError", "ConnectTimeout"}
ENDPOINT_CHECK_S = 3.0  # the pre-flight request to a model server's /models

_litellm_lock = threading.Lock()
_observer = threading.local()  # the retry callback of the thread making a request (observe_retries)

RetryCallback = Callable[[int, float, str], None]
"""Called before each retry wait: ``(attempt that failed, seconds until the next, reason)``."""


@contextlib.contextmanager
def observe_retries(callback: RetryCallback) -> Iterator[None]:
    """Within the block, ``with_retries`` on this thread reports each retry to ``callback`` (the
    agents turn it into a ``ModelRetry`` event: the status line and the transcript show it)."""
    previous = getattr(_observer, "callback", None)
    _observer.callback = callback
    try:
        yield
    finally:
        _observer.callback = previous


def import_litellm() -> Any:
    """Import litellm with its network switches off (the only place litellm is imported).

    Existing environment values win, so an operator can still opt in to a live cost map."""
    with _litellm_lock:
        for key, value in OFFLINE_ENV.items():
            os.environ.setdefault(key, value)
        # litellm's lazily imported modules make pydantic warn about its own TypedDicts; not ours to fix.
        warnings.filterwarnings("ignore", message=r".*`ReadOnly` qualifier", category=UserWarning)
        import litellm

        litellm.suppress_debug_info = True  # else it prints provider lists to stdout on some errors
        return litellm


class ModelError(CiaynError):
    """A model request that failed for good. ``str()`` is one paragraph for the operator.

    ``transient`` says whether the last failure was of a retryable kind (the retries ran out);
    ``status`` is the HTTP status when the provider gave one."""

    def __init__(self, message: str, *, transient: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.status = status


@dataclass(frozen=True)
class ModelConfig:
    """How to reach one model. ``model`` is a litellm model string (``openai/gpt-4o-mini``,
    ``ollama/qwen2.5``, ``openai/<alias>`` with ``api_base`` for an OpenAI-compatible server).

    ``api_key`` defaults to None: litellm then reads the provider's usual environment variable
    (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ...). It is never shown in ``repr``.
    ``system_role`` is the role of the CIAYN instructions message ("user" by default: some models
    reject system messages). ``repair`` turns on the rewrite of rejected CIAYN replies, by
    ``repair_model`` or this model. ``use_grammar`` constrains CIAYN replies with a GBNF grammar
    built from the tool specs (for servers that accept ``grammar``, such as llama.cpp)."""

    model: str
    api_base: str | None = None
    api_key: str | None = field(default=None, repr=False)
    temperature: float | None = 0.0
    request_timeout: float = 120.0
    max_tokens: int | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    system_role: Literal["user", "system"] = "user"
    repair: bool = False
    repair_model: str | None = None
    use_grammar: bool = False
    retries: int = MODEL_RETRIES
    retry_base_s: float = RETRY_BASE_S
    retry_cap_s: float = RETRY_CAP_S

    def litellm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``litellm.completion`` (and of ``ChatLiteLLM``) for this model,
        without the messages; one mapping so both backends reach the model the same way."""
        kwargs: dict[str, Any] = {"model": self.model, "timeout": self.request_timeout}
        if self.api_base:
            kwargs["api_base"] = self.api_base
        key = self.api_key
        if key is None and self.api_base and self.model.startswith("openai/") and not os.environ.get("OPENAI_API_KEY"):
            key = "sk-no-key-required"  # local OpenAI-compatible servers ignore it; the SDK insists
        if key is not None:
            kwargs["api_key"] = key
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        kwargs.update(self.extras)
        return kwargs

    def for_repair(self) -> ModelConfig:
        """The config of the model that repairs rejected replies: ``repair_model`` or this one."""
        if not self.repair_model:
            return self
        return replace(self, model=self.repair_model, repair=False)


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ModelReply:
    """One model answer: the text to act on, the reasoning split off it, usage and cost."""

    text: str
    reasoning: str = ""
    usage: TokenUsage = field(default_factory=TokenUsage)
    cost: float = 0.0
    model: str = ""

    @classmethod
    def from_content(
        cls,
        content: Any,
        *,
        reasoning: str | None = None,
        usage: TokenUsage | None = None,
        cost: float = 0.0,
        model: str = "",
    ) -> ModelReply:
        """Build a reply from raw message content (a string or a list of content blocks) plus any
        structured reasoning the provider returned separately."""
        text, inline_reasoning = split_content(content)
        parts = [p for p in (reasoning or "", inline_reasoning) if p.strip()]
        return cls(
            text=text,
            reasoning="\n\n".join(p.strip() for p in parts),
            usage=usage or TokenUsage(),
            cost=cost,
            model=model,
        )


@runtime_checkable
class Model(Protocol):
    """What an agent needs of a model: one chat completion at a time."""

    def complete(self, messages: Sequence[Message], *, grammar: str | None = None) -> ModelReply: ...


# ---------------------------------------------------------------------------------------------
# Content normalisation: the text to act on, and the reasoning that must never be acted on.

_REASONING_BLOCKS = {"thinking", "reasoning", "redacted_thinking", "reasoning_content"}
_TEXT_BLOCKS = {"text", "output_text"}


def _block_field(block: Any, *names: str) -> Any:
    for name in names:
        value = block.get(name) if isinstance(block, Mapping) else getattr(block, name, None)
        if value:
            return value
    return None


def split_content(content: Any) -> tuple[str, str]:
    """Message content in any shape providers use -> ``(text, reasoning)``.

    Accepts None, a string, or a list of strings and content blocks (dicts or objects with a
    ``type``): ``text`` blocks are the answer, ``thinking``/``reasoning`` blocks are reasoning,
    other blocks (images, tool use) are ignored. Think tags inside the text are split off too."""
    if content is None:
        return "", ""
    if isinstance(content, str):
        return split_think(content)
    texts: list[str] = []
    thoughts: list[str] = []
    items: Iterable[Any] = content if isinstance(content, list | tuple) else [content]
    for block in items:
        if isinstance(block, str):
            texts.append(block)
            continue
        kind = _block_field(block, "type")
        if kind in _REASONING_BLOCKS:
            value = _block_field(block, "thinking", "reasoning", "reasoning_content", "text")
            if isinstance(value, str):
                thoughts.append(value)
        elif kind in _TEXT_BLOCKS or kind is None:
            value = _block_field(block, "text")
            if isinstance(value, str):
                texts.append(value)
    text, inline = split_think("\n".join(t for t in texts if t.strip()))
    reasoning = "\n\n".join(t.strip() for t in [*thoughts, inline] if t.strip())
    return text, reasoning


def estimate_tokens(messages: Sequence[Message]) -> int:
    """A model-independent token estimate: UTF-8 bytes / 4, plus a few tokens per message."""
    total = 0
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else repr(content)
        total += len(text.encode("utf-8")) // 4 + 4
    return total


# ---------------------------------------------------------------------------------------------
# Errors and retries


def is_transient(exc: BaseException) -> bool:
    """Whether a model API error is worth retrying: rate limits, timeouts, lost connections, 5xx.

    Judged by status code and exception class name, so it covers litellm's and the openai SDK's
    exceptions without importing either."""
    text = str(exc).lower()
    if any(hint in text for hint in _CREDENTIAL_HINTS):
        return False
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 500:
        return status in _TRANSIENT_STATUS
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    return isinstance(status, int) and status >= 500


def _refused(exc: BaseException) -> bool:
    """Whether a connection was refused outright, anywhere in the exception's chain: litellm says
    "Connection error" over the openai SDK's error, over httpx's, over the ``ConnectionRefusedError``."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain is a few links; a cycle or a very long one ends here
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or "connection refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _one_paragraph(text: str) -> str:
    text = " ".join(text.split())
    text = re.sub(r"^(litellm\.\w+:\s*)+", "", text)
    if len(text) > ERROR_MESSAGE_CHARS:
        text = text[: ERROR_MESSAGE_CHARS - 3].rstrip() + "..."
    return text


def _is_connection_error(exc: BaseException, detail: str) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _CONNECTION_NAMES) or "connection error" in detail.lower()


def model_error(exc: BaseException, model: str, *, attempts: int = 1, api_base: str | None = None) -> ModelError:
    """A ``ModelError`` explaining ``exc`` (a provider or litellm exception) to the operator, naming
    the server's URL (``api_base``) when the request went to one."""
    status = getattr(exc, "status_code", None)
    status = status if isinstance(status, int) else None
    detail = _one_paragraph(str(exc)) or type(exc).__name__
    name = type(exc).__name__
    lowered = detail.lower()
    hint = ""
    credentials = any(h in lowered for h in _CREDENTIAL_HINTS)
    if credentials or name in ("AuthenticationError", "PermissionDeniedError"):
        if credentials:
            status, name = None, "missing API key"  # litellm reports it as a 500: it is not the server's
        hint = (
            " Set the provider's API key in its usual environment variable (for example OPENAI_API_KEY "
            "or ANTHROPIC_API_KEY) or pass an API key explicitly."
        )
    elif _is_connection_error(exc, detail):
        where = f"the model server at {api_base}" if api_base else f"the provider of {model}"
        hint = (
            f" Could not connect to {where}: check that it is running and that the URL is right "
            "(--api-base, CIAYN_API_BASE)."
        )
        if status == 500:
            status = None  # litellm wraps a refused connection as a 500; no server answered
    elif name == "NotFoundError" or "provider not provided" in lowered or "not mapped" in lowered:
        hint = (
            " Check the model name: litellm expects 'provider/model', for example openai/gpt-4o-mini, "
            "or openai/<name> together with an API base URL for an OpenAI-compatible server."
        )
    elif name == "ContextWindowExceededError":
        hint = " The conversation no longer fits the model's context; lower the history limits."
    transient = is_transient(exc)
    where = f"HTTP {status}, " if status else ""
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    url = f" to {api_base}" if api_base else ""
    return ModelError(
        f"The model {model!r} request{url} failed{tries} ({where}{name}): {detail}{hint}",
        transient=transient,
        status=status,
    )


def with_retries(
    request: Callable[[], Any],
    *,
    model: str,
    retries: int = MODEL_RETRIES,
    base_s: float = RETRY_BASE_S,
    cap_s: float = RETRY_CAP_S,
    sleep: Callable[[float], None] = time.sleep,
    api_base: str | None = None,
) -> Any:
    """Run ``request``; on a transient error wait ``min(cap, base * 2**n)`` (plus up to 10% jitter)
    and try again, at most ``retries`` more times. Anything else, or the last transient error,
    raises ``ModelError``. A ``ModelError`` raised by ``request`` passes through unchanged. A
    connection that is refused outright is retried once at most: a server that is down stays down
    for the seconds a backoff waits. Each retry is reported to ``observe_retries``' callback."""
    attempt = 0
    while True:
        try:
            return request()
        except ModelError:
            raise
        except Exception as e:
            attempt += 1
            refused = _refused(e)
            if not is_transient(e) or attempt > (min(retries, 1) if refused else retries):
                raise model_error(e, model, attempts=attempt, api_base=api_base) from e
            delay = min(cap_s, base_s * 2 ** (attempt - 1)) * (1 + random.random() / 10)
            callback = getattr(_observer, "callback", None)
            if callback is not None:
                callback(attempt, delay, _one_paragraph(f"{type(e).__name__}: {e}")[:200])
            sleep(delay)


# ---------------------------------------------------------------------------------------------
# The litellm transport


def _reply_from_response(litellm: Any, response: Any, model: str) -> ModelReply:
    choices = getattr(response, "choices", None) or []
    if not choices:
        raise ModelError(f"The model {model!r} returned no choices in its response.")
    message = choices[0].message
    reasoning = getattr(message, "reasoning_content", None) or None
    blocks = getattr(message, "thinking_blocks", None) or []
    if not reasoning and blocks:
        reasoning = split_content(list(blocks))[1] or None
    raw_usage = getattr(response, "usage", None)
    usage = TokenUsage(
        prompt_tokens=int(getattr(raw_usage, "prompt_tokens", 0) or 0),
        completion_tokens=int(getattr(raw_usage, "completion_tokens", 0) or 0),
    )
    try:
        cost = float(litellm.completion_cost(completion_response=response) or 0.0)
    except Exception:  # litellm does not know this model's price (local aliases): free
        cost = 0.0
    return ModelReply.from_content(message.content, reasoning=reasoning, usage=usage, cost=cost, model=model)


def complete(
    config: ModelConfig,
    messages: Sequence[Message],
    *,
    grammar: str | None = None,
    stop: Sequence[str] | None = None,
) -> ModelReply:
    """One chat completion through litellm, with transient-error retries. Raises ``ModelError``.

    ``grammar`` (GBNF) is sent as ``extra_body={"grammar": ...}``, which OpenAI-compatible servers
    such as llama.cpp's honour; other providers ignore or reject it."""
    litellm = import_litellm()
    kwargs = config.litellm_kwargs()
    kwargs["messages"] = [dict(m) for m in messages]
    kwargs.setdefault("max_retries", 0)  # retries are ours: one policy, one place
    if stop:
        kwargs["stop"] = list(stop)
    if grammar is not None:
        extra = dict(kwargs.get("extra_body") or {})
        extra["grammar"] = grammar
        kwargs["extra_body"] = extra

    def request() -> ModelReply:
        response = litellm.completion(**kwargs)
        return _reply_from_response(litellm, response, config.model)

    reply: ModelReply = with_retries(
        request,
        model=config.model,
        retries=config.retries,
        base_s=config.retry_base_s,
        cap_s=config.retry_cap_s,
        api_base=config.api_base,
    )
    return reply


# ---------------------------------------------------------------------------------------------
# Pre-flight checks: find a wrong URL, a server that is down or a missing key before the first step


def check_endpoint(config: ModelConfig, timeout: float = ENDPOINT_CHECK_S) -> str | None:
    """A paragraph saying why ``config``'s model cannot be reached, or None when it looks reachable.

    With an ``api_base``: ``GET <api_base>/models`` must answer within ``timeout`` (any HTTP answer
    means a server is there; an authentication failure is reported). Without one: the provider's
    API key must be in the environment (litellm's offline ``validate_environment``). Never raises."""
    if config.api_base:
        import httpx

        url = config.api_base.rstrip("/") + "/models"
        headers = {}
        key = config.litellm_kwargs().get("api_key")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            response = httpx.get(url, timeout=timeout, headers=headers)
        except httpx.HTTPError as e:
            reason = _one_paragraph(str(e)) or type(e).__name__
            return (
                f"The model server at {config.api_base} cannot be reached ({type(e).__name__}: {reason}). "
                "Start the server, or pass the right URL with --api-base (or CIAYN_API_BASE); an "
                "OpenAI-compatible server's URL usually ends in /v1."
            )
        except Exception as e:  # a URL httpx refuses outright
            return f"The model server URL {config.api_base!r} cannot be used: {e}. It looks like http://host:port/v1."
        if response.status_code in (401, 403):
            return (
                f"The model server at {config.api_base} refused the API key (HTTP {response.status_code}). "
                "Pass the key it expects (OPENAI_API_KEY for an openai/ model)."
            )
        return None
    if config.api_key:
        return None
    try:
        found = import_litellm().validate_environment(model=config.model)
    except Exception:
        return None  # litellm cannot tell for this provider: let the request say
    missing = [str(k) for k in found.get("missing_keys") or []]
    if found.get("keys_in_environment") or not missing:
        return None
    return (
        f"The model {config.model!r} needs {' and '.join(missing)} in the environment, which is not set. "
        f"Export it (export {missing[0]}=...), or use a local server with --api-base."
    )


def price_known(model: str) -> bool:
    """Whether litellm has a price for ``model`` (else ``--max-cost`` cannot be enforced: every
    reply counts as free)."""
    try:
        info = import_litellm().get_model_info(model)
    except Exception:
        return False
    return bool(info.get("input_cost_per_token") or info.get("output_cost_per_token"))


class LiteLLMModel:
    """The real ``Model``: each ``complete`` is one litellm request for ``config``."""

    def __init__(self, config: ModelConfig, *, stop: Sequence[str] | None = None) -> None:
        self.config = config
        self.stop = list(stop) if stop else None

    @property
    def name(self) -> str:
        return self.config.model

    def complete(self, messages: Sequence[Message], *, grammar: str | None = None) -> ModelReply:
        return complete(self.config, messages, grammar=grammar, stop=self.stop)

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """litellm's token counter for this model (offline tokenizers), else the byte estimate."""
        try:
            litellm = import_litellm()
            return int(litellm.token_counter(model=self.config.model, messages=[dict(m) for m in messages]))
        except Exception:
            return estimate_tokens(messages)

    def max_input_tokens(self) -> int | None:
        """The model's input limit from litellm's bundled model map, or None if it is not known."""
        try:
            info = import_litellm().get_model_info(self.config.model)
        except Exception:
            return None
        limit = info.get("max_input_tokens") or info.get("max_tokens")
        return int(limit) if limit else None

    def __repr__(self) -> str:
        return f"LiteLLMModel({self.config!r})"


# ---------------------------------------------------------------------------------------------
# The scripted transport

ScriptedReply = str | list[Any] | ModelReply | BaseException | Callable[[list[dict[str, Any]]], Any]


class ScriptedModel:
    """A ``Model`` that answers from a script, for tests and demos (litellm is never imported).

    Each entry is used once, in order: a string (the reply text), a list (content blocks, as some
    providers return), a ``ModelReply`` (used as is), an exception (raised), or a callable that
    receives the messages and returns any of those. Every request's messages (deep copies) and
    grammar are recorded in ``requests`` and ``grammars``. Each reply reports ``prompt_tokens``
    (default: the byte estimate of the messages), ``completion_tokens`` (default: the estimate of
    the text) and ``cost_per_call``. Running out of script raises ``ModelError``."""

    def __init__(
        self,
        replies: Iterable[ScriptedReply],
        *,
        cost_per_call: float = 0.0,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        name: str = "scripted",
    ) -> None:
        self.replies = list(replies)
        self.cost_per_call = cost_per_call
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.name = name
        self.requests: list[list[dict[str, Any]]] = []
        self.grammars: list[str | None] = []
        self._lock = threading.Lock()

    @property
    def remaining(self) -> int:
        return len(self.replies) - len(self.requests)

    def complete(self, messages: Sequence[Message], *, grammar: str | None = None) -> ModelReply:
        with self._lock:
            received = [copy.deepcopy(dict(m)) for m in messages]
            index = len(self.requests)
            self.requests.append(received)
            self.grammars.append(grammar)
            if index >= len(self.replies):
                raise ModelError(
                    f"The scripted model {self.name!r} has no reply left: it was asked {index + 1} times "
                    f"but holds {len(self.replies)} replies."
                )
            entry: Any = self.replies[index]
        if callable(entry) and not isinstance(entry, BaseException | type):
            entry = entry(copy.deepcopy(received))
        if isinstance(entry, BaseException):
            raise entry
        if isinstance(entry, ModelReply):
            return entry
        if not isinstance(entry, str | list):
            raise TypeError(f"a scripted reply must be a str, a list, a ModelReply or an exception, not {entry!r}")
        reply = ModelReply.from_content(entry, model=self.name)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else estimate_tokens(received)
        out = self.completion_tokens
        if out is None:
            out = estimate_tokens([{"content": reply.text + reply.reasoning}])
        return replace(reply, usage=TokenUsage(prompt, out), cost=self.cost_per_call)
