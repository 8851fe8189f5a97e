"""``create_agent``: one entry point and one agent type for both backends.

    agent = create_agent("openai/gpt-4o-mini", client, max_steps=20)
    for event in agent.stream("list the workspace"):   # the same step events, whatever the backend
        ...

``model`` is a litellm model string, a ``ModelConfig``, ``"local"`` (the embedded model, started for
the agent and driven exactly as ``ciayn run`` drives it: ``controller.local_model.LocalSettings``), a
running ``LocalModelServer`` (the same settings, on a server the caller owns), or (mostly for tests
and embedding) a ready model object: a CIAYN ``Model`` (``ScriptedModel``, ``LiteLLMModel``) or a
LangChain chat model with tool calling. The backend is chosen by ``controller.backend.choose_backend``
for names and configs, and by the object's kind for ready models. LangChain and LangGraph are
imported only when a ReAct agent is made.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from controller.allowlist import AllowedTools
from controller.backend import Backend, BackendChoice, choose_backend
from controller.ciayn import CiaynAgent
from controller.events import Finished, Notice, StepEvent, final_event
from controller.local_model import LOCAL_MODEL, LocalModelServer, LocalSettings
from controller.models import Model, ModelConfig
from controller.toolclient import ToolClient

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"model"}
_CHOICE_KEYS = ("backends", "supports_function_calling")


class BackendAgent(Protocol):
    """What both backends' agents offer (``CiaynAgent``, ``ReactAgent``)."""

    def stream(self, task: str | Sequence[Any]) -> Iterator[StepEvent]: ...

    def stop(self, reason: str = ...) -> None: ...


class Agent:
    """An agent of either backend. ``stream(task)`` yields a ``Notice`` saying which backend runs and
    why, then the backend's step events (``ModelText``, ``ToolCallEvent``, ``ToolResultEvent``,
    ``Rejected``, ``Usage``, ``Notice``), and last a ``Finished``. ``stop()`` is thread-safe (the CLI
    calls it on Ctrl-C). ``impl`` is the backend's own agent. An agent that started something for
    itself (``create_agent("local", ...)`` starts the model server) stops it on ``close()``, at the
    end of a ``with`` block, when it is garbage-collected, or at the latest when the interpreter
    exits."""

    def __init__(self, impl: BackendAgent, choice: BackendChoice) -> None:
        self.impl = impl
        self.choice = choice
        self._closers: list[weakref.finalize[Any, Any]] = []

    def own(self, stop: Callable[[], None]) -> None:
        """Have ``close()`` call ``stop`` (once, in reverse order of ``own``)."""
        self._closers.append(weakref.finalize(self, stop))

    def close(self) -> None:
        """Stop what the agent started for itself (idempotent)."""
        while self._closers:
            self._closers.pop()()

    def __enter__(self) -> Agent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def backend(self) -> Backend:
        return self.choice.backend

    def stream(self, task: str | Sequence[Any]) -> Iterator[StepEvent]:
        yield Notice(self.choice.describe())
        yield from self.impl.stream(task)

    def run(self, task: str | Sequence[Any]) -> Finished:
        """Run to the end and return the ``Finished`` event."""
        return final_event(self.stream(task))

    def stop(self, reason: str = "stopped by the user") -> None:
        self.impl.stop(reason)

    def __repr__(self) -> str:
        return f"Agent(backend={self.backend!r}, impl={type(self.impl).__name__})"


def _accepted(cls: type) -> set[str]:
    return {name for name, p in inspect.signature(cls).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _options_for(backend: Backend, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the chosen backend takes. An option only the other backend takes is left out (the
    caller may not know in advance which backend runs); one that neither takes is an error."""

    def react_agent() -> type:
        from controller.react import ReactAgent  # LangChain, only when needed

        return ReactAgent

    mine = _accepted(react_agent() if backend == "react" else CiaynAgent)
    rest = set(options) - mine
    if rest:
        unknown = sorted(rest - _accepted(CiaynAgent if backend == "react" else react_agent()))
        if unknown:
            raise TypeError(f"create_agent() got unknown option(s): {', '.join(unknown)}")
    return {k: v for k, v in options.items() if k in mine}


def _local_agent(model: Any, client: ToolClient, backend: str, config: dict[str, Any]) -> Agent:
    """``create_agent`` for the embedded model: ``LocalSettings`` under the caller's ``config``."""
    server = model if isinstance(model, LocalModelServer) else LocalModelServer().start()
    try:
        settings = {**LocalSettings().agent_settings(server, backend), **config}
        agent = create_agent(settings.pop("model"), client, backend=backend, **settings)
    except BaseException:
        if server is not model:
            server.stop()
        raise
    if server is not model:
        agent.own(server.stop)
    return agent


def create_agent(
    model: str | ModelConfig | Model | Any,
    client: ToolClient,
    *,
    backend: str = "auto",
    **config: Any,
) -> Agent:
    """An agent for ``model`` over the executor ``client`` (any ``controller.toolclient.ToolClient``:
    an ``ExecutorClient``, a started ``LocalExecutor``, an in-process fake).

    ``backend`` is ``auto`` (see ``controller.backend.choose_backend``), ``react`` or ``ciayn``.
    ``config`` mixes model settings (the fields of ``ModelConfig``: ``api_base``, ``temperature``,
    ``request_timeout``, ...; for a model name or a ``ModelConfig``), backend-choice settings
    (``backends``: a table of model patterns to backends; ``supports_function_calling``) and agent
    options (``max_steps``, ``max_cost``, ``call_timeout``, ``show_reasoning``, and each backend's
    own; an option only the other backend takes is ignored). ``allow_tools`` (names) offers the
    agent only those tools of the executor, whatever the backend (``controller.allowlist``).

    ``create_agent("local", client)`` starts the embedded model (``LocalModelServer``; raises
    ``ModelNotInstalled`` without ``scripts/setup-model``) and gives it the settings ``ciayn run``
    does; ``config`` overrides any of them (``temperature=0.7``, ``max_tokens=64``). The agent stops
    the server on ``close()`` (or as a context manager). A running ``LocalModelServer`` passed as
    ``model`` gets the same settings and stays the caller's."""
    if backend not in ("auto", "react", "ciayn"):
        raise ValueError(f"backend must be 'auto', 'react' or 'ciayn', not {backend!r}")
    if isinstance(model, LocalModelServer) or (isinstance(model, str) and model == LOCAL_MODEL):
        return _local_agent(model, client, backend, config)
    choice_config = {k: config.pop(k) for k in _CHOICE_KEYS if k in config}
    allow_tools = config.pop("allow_tools", None)
    if allow_tools is not None:
        client = AllowedTools(client, allow_tools)  # a ToolClient too
    model = _with_settings(model, {k: config.pop(k) for k in list(config) if k in _MODEL_FIELDS})
    if isinstance(model, ModelConfig):
        choice = choose_backend(model.model, backend, choice_config)
        options = _options_for(choice.backend, config)
        if choice.backend == "react":
            from controller.react import ReactAgent

            return Agent(ReactAgent.from_config(model, client, **options), choice)
        return Agent(CiaynAgent.from_config(model, client, **options), choice)
    return _ready_model_agent(model, client, backend, config)


def _with_settings(model: Any, settings: dict[str, Any]) -> Any:
    """``model`` with ``settings`` (fields of ``ModelConfig``) applied: a model name becomes a
    ``ModelConfig``, a ``ModelConfig`` a copy; a ready model object takes none (a TypeError)."""
    if isinstance(model, str):
        return ModelConfig(model=model, **settings)
    if not settings:
        return model
    if not isinstance(model, ModelConfig):
        raise TypeError(
            f"model settings ({', '.join(sorted(settings))}) apply to a model name or a ModelConfig, "
            f"not to a ready {type(model).__name__}"
        )
    return dataclasses.replace(model, **settings)


def _ready_model_agent(model: Any, client: ToolClient, backend: str, config: dict[str, Any]) -> Agent:
    """``create_agent`` for a ready model object: a CIAYN ``Model`` runs the ciayn backend, a LangChain
    chat model the react one; asking for the other backend, or passing anything else, is an error."""
    if isinstance(model, Model):
        if backend == "react":
            raise ValueError(f"a {type(model).__name__} answers in text and cannot run the react backend")
        choice = BackendChoice("ciayn", f"a {type(model).__name__} model object was given")
        return Agent(CiaynAgent(model, client, **_options_for("ciayn", config)), choice)

    from langchain_core.language_models import BaseChatModel

    if isinstance(model, BaseChatModel):
        if backend == "ciayn":
            raise ValueError(
                "a LangChain chat model runs the react backend; for CIAYN pass a model name, a ModelConfig "
                "or a controller.models.Model"
            )
        from controller.react import ReactAgent

        choice = BackendChoice("react", f"a LangChain chat model ({type(model).__name__}) was given")
        return Agent(ReactAgent(model, client, **_options_for("react", config)), choice)
    raise TypeError(
        "model must be a litellm model name, a ModelConfig, a controller.models.Model or a LangChain chat "
        f"model, not {type(model).__name__}"
    )
