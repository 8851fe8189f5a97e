"""The ReAct backend: LangGraph's ``create_react_agent`` for models with native tool calling, with
every tool call sent to the executor as a call descriptor.

The model sees one LangChain tool per executor ``ToolSpec`` (``ExecutorTool``: the spec's name,
docstring and JSON Schema). The tool's body turns the model's arguments into a ``protocol.Call``,
sends it through the executor client and returns the result in plain words for the model, with the
executor's ``Result`` as the message's artifact. A failed call becomes a ``ToolMessage`` with
``status="error"`` ("the tool timed out after 5 s and its worker was restarted; tool state was
reset", the same words CIAYN uses); the run goes on. Nothing the model sends runs in this process.

The graph pauses before and after its ``tools`` node (``interrupt_before``/``interrupt_after``), so
one step of ``ReactAgent.stream`` is: resume the graph for one model request (retried on transient
API errors; a 400-class error fails the run with the provider's message), report the reply and its
calls, resume again to run the calls, report each result. Between steps the loop checks completion
signals from tools (``complete`` -> completed, ``exit`` -> stopped), an unavailable executor (->
failed), the step and cost limits and the stop flag (Ctrl-C). Before each model request the history
is trimmed to a token budget: the first message (the task) is always kept, and an assistant message
with tool calls is kept or dropped together with its tool results. Steps, calls, tokens and cost
are counted by ``events.Tally``, as in CIAYN, and the events are the same.

This module imports LangChain and LangGraph; ``controller.agent`` imports it only when a ReAct agent
is made, so ``import controller`` stays light.
"""

from __future__ import annotations

import collections
import json
import threading
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    ToolMessage,
    convert_to_messages,
    convert_to_openai_messages,
)
from langchain_core.tools import BaseTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import ToolNode, create_react_agent
from langgraph.warnings import LangGraphDeprecatedSinceV10

from controller import prompts
from controller.ciayn import DEFAULT_MAX_STEPS
from controller.events import (
    Finished,
    ModelText,
    Notice,
    Rejected,
    StepEvent,
    StreamingAgent,
    ToolCallEvent,
    ToolResultEvent,
)
from controller.history import TOKEN_HEADROOM, TRIM_NOTE
from controller.models import (
    MODEL_RETRIES,
    RETRY_BASE_S,
    RETRY_CAP_S,
    LiteLLMModel,
    ModelConfig,
    ModelError,
    estimate_tokens,
    import_litellm,
    split_content,
    with_retries,
)
from controller.run import Abandoned, RunSkeleton, call_until_stopped
from controller.toolclient import ToolClient
from protocol import Call, Result, ToolSpec, fingerprint

TokenCounter = Callable[[Sequence[BaseMessage]], int]
Pricer = Callable[[AIMessage], float]

FINAL_ANSWER = "the model gave its final answer without calling a tool"
TASK_HINT = "When the task is done, call {tools} to report it."

UNKNOWN_MODEL_INPUT_TOKENS = 8192  # history budget when litellm does not know the model's context


# ---------------------------------------------------------------------------------------------
# Tool proxies


def call_from_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> Call:
    """The call descriptor for a model's tool-call arguments (a JSON object, by parameter name).

    Positional-only parameters cannot be passed by name, so their values move to ``args``."""
    kwargs = dict(arguments)
    args: list[Any] = []
    for p in spec.params:
        if p.kind != "positional_only":
            break
        if p.name not in kwargs:
            break
        args.append(kwargs.pop(p.name))
    return Call(tool=spec.name, args=args, kwargs=kwargs)


def tool_message_text(result: Result) -> str:
    """What the model reads for a result: the value (and printed output), or the failure in plain
    words (``prompts.describe_failure``, shared with CIAYN)."""
    if result.ok:
        return prompts.render_value(result)
    text = prompts.describe_failure(result)
    return f"Error: {text[:1].upper()}{text[1:]}."


def _plan_key(tool: str, arguments: Mapping[str, Any]) -> str:
    return json.dumps([tool, arguments], sort_keys=True, default=repr)


class ExecutorBridge:
    """The per-run link from tool proxies to the executor: gives every call a fresh id from the run
    (a call id runs at most once, so ids must never repeat, whatever ids the model gives its tool
    calls), applies the call timeout, refuses the calls the run decided not to run (``refuse``), and
    cancels a call in flight when the run is stopped. Thread-safe: LangGraph runs the calls of one
    step in parallel threads."""

    def __init__(
        self,
        client: ToolClient,
        run: RunSkeleton | None = None,
        *,
        call_timeout: float | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.client = client
        self.run = run or RunSkeleton(agent=None, task=None)  # a bridge of its own: ids only
        self.call_timeout = call_timeout
        self.stopping = stopping or threading.Event()
        self._refusals: dict[str, collections.deque[str | None]] = {}
        self._lock = threading.Lock()

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def plan(self, decisions: Sequence[tuple[str, Mapping[str, Any], str | None]]) -> None:
        """This step's calls, in order: ``(tool, arguments, refusal or None)``. A proxy whose call
        matches a refused entry answers with the refusal instead of running it."""
        with self._lock:
            self._refusals = {}
            for tool, arguments, refusal in decisions:
                self._refusals.setdefault(_plan_key(tool, arguments), collections.deque()).append(refusal)

    def _refusal(self, tool: str, arguments: Mapping[str, Any]) -> str | None:
        with self._lock:
            queue = self._refusals.get(_plan_key(tool, arguments))
            return queue.popleft() if queue else None

    def call(self, spec: ToolSpec, arguments: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """Run one tool call in the executor: ``(text for the model, the Result as a plain dict)``."""
        call = self.run.with_id(call_from_arguments(spec, arguments))
        refusal = self._refusal(spec.name, arguments)
        if refusal is not None:
            return refusal, Result.failure(call.id or "", "rejected", refusal).model_dump()
        result = call_until_stopped(self.client, call, self.call_timeout, self.stopping)
        return tool_message_text(result), result.model_dump()


class ExecutorTool(BaseTool):
    """A LangChain tool for one executor ``ToolSpec``: the model sees the spec's name, docstring and
    JSON Schema; the body sends a call descriptor to the executor. The ``ToolMessage`` it makes carries
    the executor's ``Result`` (as a dict) in ``artifact``."""

    spec: ToolSpec
    bridge: ExecutorBridge
    response_format: str = "content_and_artifact"  # type: ignore[assignment]

    def _run(self, *args: Any, **arguments: Any) -> tuple[str, dict[str, Any]]:
        # ``arguments`` is the model's JSON object as is: a dict args_schema is not validated by
        # LangChain, and this signature asks for no injected config or callbacks, so no argument
        # name (not even "config") is taken away. The executor binds and checks the arguments.
        return self.bridge.call(self.spec, arguments)


def make_tools(specs: Sequence[ToolSpec], bridge: ExecutorBridge) -> list[ExecutorTool]:
    """One ``ExecutorTool`` per spec."""
    return [
        ExecutorTool(name=s.name, description=s.doc, args_schema=s.parameters, spec=s, bridge=bridge) for s in specs
    ]


def result_of(message: ToolMessage) -> Result | None:
    """The executor's ``Result`` a tool message carries, or None (LangGraph's own messages, such
    as the one for a tool name that does not exist, carry none)."""
    artifact = message.artifact
    if isinstance(artifact, Result):
        return artifact
    if isinstance(artifact, Mapping) and "id" in artifact and "ok" in artifact:
        return Result.model_validate(dict(artifact))
    return None


def _mark_failures(request: Any, execute: Callable[[Any], Any]) -> Any:
    """ToolNode call wrapper: a tool message whose executor result failed gets ``status="error"``
    (a ``content_and_artifact`` tool has no other way to say so without losing its artifact)."""
    message = execute(request)
    if isinstance(message, ToolMessage):
        result = result_of(message)
        if result is not None and not result.ok:
            message.status = "error"
    return message


# ---------------------------------------------------------------------------------------------
# History trimming


def estimate_message_tokens(messages: Sequence[BaseMessage]) -> int:
    """The byte estimate of ``models.estimate_tokens``, counting tool calls and their arguments."""
    plain: list[dict[str, Any]] = []
    for m in messages:
        text = m.content if isinstance(m.content, str) else json.dumps(m.content, default=str)
        calls = getattr(m, "tool_calls", None)
        if calls:
            text += json.dumps(calls, default=str)
        plain.append({"content": text})
    return estimate_tokens(plain)


def litellm_token_counter(config: ModelConfig) -> TokenCounter:
    """A counter using litellm's tokenizer for the model (offline), else the byte estimate."""
    model = LiteLLMModel(config)
    return lambda messages: model.count_tokens(convert_to_openai_messages(list(messages)))


def _opens_calls(message: BaseMessage) -> bool:
    return isinstance(message, AIMessage) and bool(message.tool_calls)


def trim_messages(
    messages: Sequence[BaseMessage], max_tokens: int, count: TokenCounter = estimate_message_tokens
) -> tuple[list[BaseMessage], int]:
    """``(kept, dropped)``: the first message, then the newest turns that fit ``max_tokens``.

    An assistant message with tool calls and the tool results after it form one turn, kept or dropped
    whole, so a result never arrives without its call (providers reject that). The newest turn is
    kept even when it alone is over budget. Nothing is mutated."""
    if len(messages) <= 1:
        return list(messages), 0
    first, rest = messages[0], list(messages[1:])
    turns: list[list[BaseMessage]] = []
    for m in rest:
        if isinstance(m, ToolMessage) and turns and _opens_calls(turns[-1][0]):
            turns[-1].append(m)
        else:
            turns.append([m])
    budget = max_tokens - count([first])
    kept: list[list[BaseMessage]] = []
    for turn in reversed(turns):
        size = count(turn)
        if kept and size > budget:
            break
        kept.append(turn)
        budget -= size
    flat = [m for turn in reversed(kept) for m in turn]
    return [first, *flat], len(rest) - len(flat)


def _with_trim_note(first: BaseMessage, dropped: int) -> list[BaseMessage]:
    note = TRIM_NOTE.format(dropped=dropped)
    if isinstance(first, HumanMessage) and isinstance(first.content, str):
        # One user message, not two in a row: some chat templates insist that roles alternate.
        return [first.model_copy(update={"content": f"{first.content}\n\n{note}"})]
    return [first, HumanMessage(note)]


# ---------------------------------------------------------------------------------------------
# The chat model


def chat_model(config: ModelConfig) -> BaseChatModel:
    """A ``ChatLiteLLM`` for ``config`` (the same ``litellm_kwargs`` as CIAYN's requests). Retries
    are the agent's (one policy, one place), so neither LangChain nor the OpenAI SDK retries."""
    import_litellm()  # the offline switches, before langchain_litellm imports litellm
    from langchain_litellm import ChatLiteLLM

    extra = config.litellm_kwargs()
    params: dict[str, Any] = {
        "model": extra.pop("model"),
        "request_timeout": extra.pop("timeout", None),
        "max_retries": 1,  # attempts, for ChatLiteLLM's tenacity decorator: no retry
    }
    for name in ("api_base", "api_key", "temperature", "max_tokens"):
        if name in extra:
            params[name] = extra.pop(name)
    extra.setdefault("max_retries", 0)  # the OpenAI SDK's own retries, passed on by litellm
    return ChatLiteLLM(**params, model_kwargs=extra)


def _model_name(chat: Any) -> str:
    for attr in ("model_name", "model"):
        value = getattr(chat, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(chat).__name__


def reply_cost(message: AIMessage) -> float | None:
    """The price litellm put on a reply (``ChatLiteLLM`` records it), or None if it did not."""
    cost = message.response_metadata.get("response_cost")
    return float(cost) if isinstance(cost, int | float) else None


# ---------------------------------------------------------------------------------------------
# The agent


class _StopRequested(Exception):
    """Raised from the retry backoff when the run is asked to stop while waiting."""


class ReactAgent(StreamingAgent):
    """A ReAct agent over one LangChain chat model (with tool calling) and one executor client.

    ``max_steps`` bounds model requests; ``max_cost`` (dollars) stops the run once spent (only for
    models litellm has a price for); ``max_tokens_total`` stops it once that many tokens are used.
    Tools flagged ``no_repeat`` are not run again with the arguments of the last successful call, and
    of several calls in one reply only the first runs unless all are ``bundleable`` (as in CIAYN).
    ``max_input_tokens`` is the token budget of the messages sent to the model (None: no trimming);
    ``count_tokens`` counts it (default: a byte estimate). ``call_timeout`` overrides the executor's
    per-call timeout (seconds). ``tool_choice`` is passed to ``bind_tools`` (e.g. ``"required"`` for
    a weak model that otherwise answers in prose). Transient model errors are retried ``retries``
    times, waiting ``min(retry_cap_s, retry_base_s * 2**n)``. ``price`` prices a reply litellm did
    not price (default: free). ``show_reasoning`` puts the model's reasoning into ``ModelText``."""

    def __init__(
        self,
        chat_model: BaseChatModel,
        client: ToolClient,
        *,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_cost: float | None = None,
        max_tokens_total: int | None = None,
        max_input_tokens: int | None = None,
        count_tokens: TokenCounter | None = None,
        call_timeout: float | None = None,
        tool_choice: str | None = None,
        retries: int = MODEL_RETRIES,
        retry_base_s: float = RETRY_BASE_S,
        retry_cap_s: float = RETRY_CAP_S,
        price: Pricer | None = None,
        show_reasoning: bool = False,
        model_name: str | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        self.chat_model = chat_model
        self.client = client
        self.max_steps = max_steps
        self.max_cost = max_cost
        self.max_tokens_total = max_tokens_total
        self.max_input_tokens = max_input_tokens
        self.count_tokens = count_tokens or estimate_message_tokens
        self.call_timeout = call_timeout
        self.tool_choice = tool_choice
        self.retries = retries
        self.retry_base_s = retry_base_s
        self.retry_cap_s = retry_cap_s
        self.price = price
        self.show_reasoning = show_reasoning
        self.model_name = model_name or _model_name(chat_model)
        super().__init__()

    @classmethod
    def from_config(cls, config: ModelConfig, client: ToolClient, **options: Any) -> ReactAgent:
        """An agent on a ``ChatLiteLLM`` for ``config``: its retry policy, litellm's tokenizer and
        input limit for the model (when litellm knows it); ``options`` are the other arguments."""
        options.setdefault("retries", config.retries)
        options.setdefault("retry_base_s", config.retry_base_s)
        options.setdefault("retry_cap_s", config.retry_cap_s)
        options.setdefault("model_name", config.model)
        if "max_input_tokens" not in options:
            # A model litellm does not know (a local alias) still gets a budget: history must not
            # grow without bound. The embedded model's context is 4096 tokens.
            options["max_input_tokens"] = LiteLLMModel(config).max_input_tokens() or UNKNOWN_MODEL_INPUT_TOKENS
        if options.get("count_tokens") is None:
            options["count_tokens"] = litellm_token_counter(config)
        return cls(chat_model(config), client, **options)

    def _events(self, task: str | Sequence[Any]) -> Iterator[StepEvent]:
        return _ReactRun(self, task).events()


@dataclass
class _ReactRun(RunSkeleton):
    """The state of one ``stream``: kept apart from the agent so runs never share it."""

    agent: ReactAgent
    budget: int | None = None
    dropped: int = 0  # messages left out of the latest model request
    trim_noticed: bool = False
    pending_input: dict[str, Any] | None = None
    pending_note: str | None = None  # feedback on calls not run, added after the step's results
    calls: list[Any] = field(default_factory=list)  # the tool calls of the latest reply
    graph: Any = None
    config: dict[str, Any] = field(default_factory=dict)
    bridge: ExecutorBridge | None = None

    def events(self) -> Generator[StepEvent, None, None]:
        a = self.agent
        failed = self.list_tools()
        if failed is not None:
            yield failed
            return
        specs = self.specs
        self.bridge = ExecutorBridge(a.client, self, call_timeout=a.call_timeout, stopping=a._stop)
        tools = make_tools(specs, self.bridge)
        if a.max_input_tokens is not None:
            schemas = [{"content": json.dumps(s.parameters) + s.doc + s.name} for s in specs]
            self.budget = int(a.max_input_tokens * (1.0 - TOKEN_HEADROOM)) - estimate_tokens(schemas)
        self.graph = self._build_graph(tools)
        self.config = {"configurable": {"thread_id": f"react-{self.run_id}"}}
        self.pending_input = {"messages": self._initial_messages(specs)}

        while True:
            finished = self.limit_reached()
            if finished is not None:
                yield finished
                return
            started = self.begin_step()
            step = started.step
            yield started
            outcome = yield from self._model_step(step)
            if outcome is not None:
                yield outcome
                return
            if a._stop.is_set():  # asked to stop while the model was answering: send nothing
                yield self.stopped()
                return
            if "tools" in self.graph.get_state(self.config).next:
                outcome = yield from self._tools_step(step)
                if outcome is not None:
                    yield outcome
                    return
                if a._stop.is_set():
                    yield self.stopped()
                    return

    # ------------------------------------------------------------------ set-up

    def _build_graph(self, tools: list[ExecutorTool]) -> Any:
        a = self.agent
        model: Any = a.chat_model
        if a.tool_choice is not None:
            model = model.bind_tools(tools, tool_choice=a.tool_choice)
        node = ToolNode(tools, wrap_tool_call=_mark_failures, handle_tool_errors=False)
        with warnings.catch_warnings():
            # create_react_agent warns (LangGraphDeprecatedSinceV10) that it moved to
            # langchain.agents.create_agent. That is the migration target once the `langchain`
            # package is a dependency; the prebuilt graph works, and users need not see the warning.
            warnings.simplefilter("ignore", LangGraphDeprecatedSinceV10)
            return create_react_agent(
                model,
                node,
                prompt=self._prompt,
                checkpointer=InMemorySaver(),
                # Pause before the calls, to report them and honour a stop; and after them, to
                # check completion signals and limits before the next model request.
                interrupt_before=["tools"],
                interrupt_after=["tools"],
                name="ciayn-react",
            )

    def _initial_messages(self, specs: Sequence[ToolSpec]) -> list[BaseMessage]:
        if not isinstance(self.task, str):
            return list(convert_to_messages(list(self.task)))
        finishers = prompts.completion_tools(specs)
        text = self.task
        if finishers:
            text += "\n\n" + TASK_HINT.format(tools=" or ".join(finishers))
        return [HumanMessage(text)]

    def _prompt(self, state: Any) -> list[BaseMessage]:
        """The messages of the next model request: the state's messages, trimmed to the budget."""
        messages: list[BaseMessage] = list(state["messages"] if isinstance(state, Mapping) else state.messages)
        if self.budget is None:
            self.dropped = 0
            return messages
        kept, self.dropped = trim_messages(messages, self.budget, self.agent.count_tokens)
        if self.dropped:
            kept = [*_with_trim_note(kept[0], self.dropped), *kept[1:]]
        return kept

    # ------------------------------------------------------------------ one step

    def _segment(self) -> list[dict[str, Any]]:
        """Resume the graph until its next pause. The task goes in once; after a failed attempt the
        graph resumes from its checkpoint, so a retry repeats only the model request."""
        graph_input, self.pending_input = self.pending_input, None
        return list(self.graph.stream(graph_input, self.config, stream_mode="updates"))

    def _backoff(self, delay: float) -> None:
        if self.agent._stop.wait(delay):
            raise _StopRequested

    def _model_step(self, step: int) -> Generator[StepEvent, None, Finished | None]:
        """One model request: its text, usage and calls as events; a Finished when the run ends."""
        reply = yield from self._ask_model(step)
        if isinstance(reply, Finished):
            return reply
        self.calls = list(reply.tool_calls)
        if self.dropped and not self.trim_noticed:
            self.trim_noticed = True
            yield Notice(f"History trimmed to fit the token budget: {self.dropped} older messages left out.")
        text = yield from self._report_reply(step, reply)
        yield from self._plan_calls(step, reply)
        if reply.invalid_tool_calls:
            note = yield from self._reject_invalid_calls(step, reply)
            if not reply.tool_calls:
                self.graph.update_state(self.config, {"messages": [HumanMessage(note)]}, as_node="tools")
                return None
            self.pending_note = note
        if not reply.tool_calls:
            if not text:
                return self.tally.finished("failed", "the model replied with neither text nor a tool call")
            return self.tally.finished("completed", FINAL_ANSWER, text)
        return None

    def _ask_model(self, step: int) -> Generator[StepEvent, None, AIMessage | Finished]:
        """Resume the graph for one model request, retried on transient API errors; the model's reply,
        or the run's end when the request failed, brought no message or the run was stopped."""
        a = self.agent
        try:
            updates = yield from self.await_model(
                step,
                lambda: with_retries(
                    self._segment,
                    model=a.model_name,
                    retries=a.retries,
                    base_s=a.retry_base_s,
                    cap_s=a.retry_cap_s,
                    sleep=self._backoff,
                ),
            )
        except _StopRequested:
            return self.stopped()
        except ModelError as e:
            return self.tally.finished("failed", str(e))
        if isinstance(updates, Abandoned):
            return self.stopped()
        replies = [m for m in _messages(updates, "agent") if isinstance(m, AIMessage)]
        if not replies:
            return self.tally.finished("failed", f"the model {a.model_name!r} returned no message")
        return replies[-1]

    def _report_reply(self, step: int, reply: AIMessage) -> Generator[StepEvent, None, str]:
        """The reply's text (with its reasoning under ``show_reasoning``) and its usage and cost as
        events; its text."""
        a = self.agent
        text, reasoning = split_content(reply.content)
        extra_reasoning = reply.additional_kwargs.get("reasoning_content")
        if isinstance(extra_reasoning, str) and extra_reasoning.strip():
            reasoning = "\n\n".join(p for p in (extra_reasoning.strip(), reasoning) if p)
        shown = reasoning if a.show_reasoning else ""
        if text or shown:
            yield ModelText(step=step, text=text, reasoning=shown)
        usage: Mapping[str, Any] = reply.usage_metadata or {}
        cost = reply_cost(reply)
        if cost is None:
            cost = a.price(reply) if a.price is not None else 0.0
        yield self.tally.add_usage(step, int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0)), cost)
        return text

    def _plan_calls(self, step: int, reply: AIMessage) -> Generator[StepEvent, None, None]:
        """Decide which of the reply's tool calls run and report each: a call of an unknown tool, one
        bundled against the rules or a ``no_repeat`` repeat is rejected; the bridge is told which."""
        decisions: list[tuple[str, Mapping[str, Any], str | None]] = []
        planned: list[Call] = []
        for tc in reply.tool_calls:
            spec = self.tools.get(tc["name"])
            if spec is None:
                call = Call(tool=tc["name"], kwargs=dict(tc["args"]))
                yield Rejected(
                    step=step,
                    text=prompts.format_call(call),
                    message=f"there is no tool named {tc['name']!r}; the tools are: {', '.join(self.tools)}",
                    code="unknown_tool",
                )
                continue
            call = call_from_arguments(spec, tc["args"])
            planned.append(call)
            refusal = self.bundle_refusals(planned).get(len(planned) - 1)
            code = "bundle"
            if refusal is None:
                refusal = self.repeat_refusal(call)
                if refusal is None and spec.no_repeat and any(
                    prior.tool == call.tool and fingerprint(prior, spec) == fingerprint(call, spec)
                    for prior in planned[:-1]
                ):
                    refusal = prompts.repeat(call)
                code = "repeat"
            decisions.append((tc["name"], tc["args"], refusal))
            if refusal is not None:
                yield Rejected(step=step, text=prompts.format_call(call), message=refusal, code=code)
                continue
            yield ToolCallEvent(
                step=step,
                call_id=tc.get("id") or "",
                tool=call.tool,
                args=list(call.args),
                kwargs=dict(call.kwargs),
                text=prompts.format_call(call),
            )
        assert self.bridge is not None
        self.bridge.plan(decisions)

    def _reject_invalid_calls(self, step: int, reply: AIMessage) -> Generator[StepEvent, None, str]:
        """Report the reply's calls whose arguments did not parse (they were never dispatched, and are
        not sent back to the provider); the note that asks the model, in a user message, to try again."""
        problems = []
        for bad in reply.invalid_tool_calls:
            name = bad.get("name") or "(no name)"
            message = f"the arguments of this {name} call are not a valid JSON object: {bad.get('error') or ''}"
            yield Rejected(
                step=step, text=f"{name}({bad.get('args') or ''})", message=message.strip(), code="bad_arguments"
            )
            problems.append(f"- {message.strip()}")
        return "These tool calls were not run:\n" + "\n".join(problems) + "\nSend them again with valid arguments."

    def _tools_step(self, step: int) -> Generator[StepEvent, None, Finished | None]:
        """Run the step's calls in the executor (in parallel); their results as events; a Finished when
        a result ends the run (completion or exit signal, unavailable executor)."""
        order = {tc.get("id"): i for i, tc in enumerate(self.calls)}
        try:
            updates = self._segment()
        except Exception as e:  # not a tool's failure (those are results): a fault of this process
            return self.tally.finished("failed", f"running the tool calls failed: {type(e).__name__}: {e}")
        messages = [m for m in _messages(updates, "tools") if isinstance(m, ToolMessage)]
        messages.sort(key=lambda m: order.get(m.tool_call_id, len(order)))
        ending: Finished | None = None
        for message in messages:
            result = result_of(message)
            if result is None or (result.error is not None and result.error.kind == "rejected"):
                continue  # an unknown tool name, or a call the run refused: already reported as Rejected
            self.tally.add_result(result)
            yield replace(ToolResultEvent.from_result(step, message.name or "", result), call_id=message.tool_call_id)
            spec = self.tools.get(message.name or "")
            if spec is not None:
                sent = (tc["args"] for tc in self.calls if tc.get("id") == message.tool_call_id)
                args: Mapping[str, Any] = next(sent, {})
                self.record(call_from_arguments(spec, args), result)
            if self.stopping.is_set() and result.error is not None and result.error.kind == "cancelled":
                yield Notice(f"Cancelled {message.name} (call {result.id}) at the executor.")
            yield from self.notes(message.name or "", result)
            if ending is None:
                ending = self.tally.ending(message.name or "", result)
        if self.pending_note is not None:
            note, self.pending_note = self.pending_note, None
            self.graph.update_state(self.config, {"messages": [HumanMessage(note)]}, as_node="tools")
        return ending


def _messages(updates: Sequence[Mapping[str, Any]], node: str) -> list[Any]:
    """The messages node ``node`` added, from ``stream_mode="updates"`` chunks."""
    out: list[Any] = []
    for update in updates:
        value = update.get(node)
        if isinstance(value, Mapping):
            out.extend(value.get("messages") or [])
    return out
