"""The CIAYN agent: the model writes one call per reply as Python text; the executor runs it.

One loop: prompt -> model -> ``protocol.parse_calls`` -> ``client.call`` for each call -> the results
fed back in plain words -> again, until a tool signals completion (or exit), a step or cost limit is
reached, or a fatal error ends the run. Nothing the model writes is ever evaluated: a reply becomes
call descriptors (plain data) or a ``CallRejected`` message for the model.

What it keeps from RA.Aid's CiaynAgent and what it fixes (see notes/raaid-behaviour.md):

- reasoning (think tags, reasoning blocks, list-shaped content) is split off and never parsed;
- an invalid reply is stored as the assistant turn and followed by the rejection, once, with real
  newlines; consecutive invalid and empty replies are capped;
- the repeat guard is per tool spec (``no_repeat``), uses ``protocol.fingerprint`` and is recorded
  only when a call succeeded, so retrying after a crash or timeout is allowed;
- a bundle runs in order and every call gets its own labelled result;
- executor faults reach the model in plain words and the run goes on; an unavailable executor ends it;
- history is trimmed by count and tokens without ever dropping the instructions or the task;
- progress is watched over the whole run, not only the last step (``controller.progress``): a call
  that gets a result it already got in this run is told so, with a next call made from what the
  run has seen but not looked at (files a listing returned that no call has read, say); when the
  grammar is built from the tool specs, calls whose answer cannot change (a settled failure, a
  call of an ``idempotent`` tool that succeeded) and calls repeated in a stall are left out of it;
  and ``max_stalled_steps`` steps in a row without a new result end the run early, saying why,
  instead of spending the rest of the step limit going round in circles;
- with ``check_completion``, a completion call is refused while the task visibly lacks something.

For small models: ``prompt_style="compact"`` sends short instructions, ``few_shot=True`` adds
example turns generated from the offered tools (``prompts.example_turns``), a grammar makes every
reply a valid call (its free text bounded by the model's reply cap, so no reply is cut off), and
``constrain_values`` narrows file names and answers to what the run has seen; once that is what the
task asks for, the model is told so, and one call later it may only finish.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from controller import prompts
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
from controller.history import TokenCounter, trim_history
from controller.models import (
    LiteLLMModel,
    Message,
    Model,
    ModelConfig,
    ModelError,
    ModelReply,
    estimate_tokens,
    split_content,
)
from controller.progress import DEFAULT_MAX_STALLED_STEPS, Progress, StepProgress
from controller.run import Abandoned, RunSkeleton
from controller.seen import SeenValues
from controller.step_grammar import StepGrammar
from controller.step_grammar import build_grammar as build_grammar
from controller.toolclient import ToolClient
from protocol import Call, CallRejected, Result, ToolSpec, fingerprint, strip_markup
from protocol.grammar import parse_reply

DEFAULT_MAX_STEPS = 30
DEFAULT_MAX_INVALID = 5
DEFAULT_MAX_EMPTY = 3
DEFAULT_MAX_HISTORY_MESSAGES = 50
PromptStyle = Literal["full", "compact"]
SMALL_MODEL_OPTIONS: Mapping[str, Any] = {
    "prompt_style": "compact",
    "few_shot": True,
    "constrain_values": True,
    "check_completion": True,
}
"""The agent options for a small local model (``ciayn run --prompt compact``, the local default)."""


def prompt_options(prompt: str) -> dict[str, Any]:
    """The agent options of a ``--prompt`` style: ``SMALL_MODEL_OPTIONS`` for ``compact``, none
    (the full prompt is the default) for ``full`` or ``auto``."""
    return dict(SMALL_MODEL_OPTIONS) if prompt == "compact" else {}


class CiaynAgent(StreamingAgent):
    """A CIAYN agent over one model and one executor client.

    ``max_steps`` bounds model requests; ``max_cost`` (dollars) stops the run once spent (only for
    models litellm has a price for); ``max_tokens_total`` stops it once that many tokens are used;
    ``max_invalid`` / ``max_empty`` bound consecutive invalid / empty replies; ``max_history_messages``
    and ``max_history_tokens`` bound the history sent each step (tokens default to the model's known
    input limit, if any). ``show_reasoning`` puts the model's reasoning into ``ModelText`` events.
    ``system_role`` is the role of the instructions message. ``repair`` asks ``repair_model`` (default:
    the same model) to rewrite a rejected reply into one valid call. ``grammar`` is a GBNF string
    sent with every request, or True to build one from the tool specs (``controller.gbnf``) and narrow
    it each step (``controller.step_grammar``). ``call_timeout`` overrides the executor's per-call
    timeout (seconds). ``prompt_style`` is ``full`` (every rule and docstring) or ``compact`` (short,
    for small models); ``few_shot`` puts example turns (task, calls, results, completion) between the
    instructions and the task; ``constrain_values`` (with ``grammar=True``) narrows path, text and
    completion arguments to the values the run has seen (``controller.seen``). ``check_completion``
    refuses a completion call while the task visibly lacks something (no tool has run; the task names a
    file to write and nothing was written: ``SeenValues.completion_missing``), telling the model what,
    and (with ``grammar=True``) keeps the completion tool out of the grammar meanwhile.
    ``max_stalled_steps`` (None: never) ends the run, ``stopped``, after that many steps in a row whose
    calls all got results the run had already seen (``controller.progress``)."""

    def __init__(
        self,
        model: Model,
        client: ToolClient,
        *,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_cost: float | None = None,
        max_tokens_total: int | None = None,
        max_invalid: int = DEFAULT_MAX_INVALID,
        max_empty: int = DEFAULT_MAX_EMPTY,
        max_history_messages: int | None = DEFAULT_MAX_HISTORY_MESSAGES,
        max_history_tokens: int | None = None,
        show_reasoning: bool = False,
        system_role: Literal["user", "system"] = "user",
        repair: bool = False,
        repair_model: Model | None = None,
        grammar: str | bool | None = None,
        call_timeout: float | None = None,
        prompt_style: PromptStyle = "full",
        few_shot: bool = False,
        constrain_values: bool = False,
        check_completion: bool = False,
        max_stalled_steps: int | None = DEFAULT_MAX_STALLED_STEPS,
    ) -> None:
        if min(max_steps, max_invalid, max_empty, 1 if max_stalled_steps is None else max_stalled_steps) < 1:
            raise ValueError("max_steps, max_invalid, max_empty and max_stalled_steps must each be at least 1")
        if system_role not in ("user", "system"):
            raise ValueError(f"system_role must be 'user' or 'system', not {system_role!r}")
        if prompt_style not in ("full", "compact"):
            raise ValueError(f"prompt_style must be 'full' or 'compact', not {prompt_style!r}")
        self.model = model
        self.client = client
        self.max_steps = max_steps
        self.max_cost = max_cost
        self.max_tokens_total = max_tokens_total
        self.max_invalid = max_invalid
        self.max_empty = max_empty
        self.max_history_messages = max_history_messages
        self.max_history_tokens = max_history_tokens
        self.show_reasoning = show_reasoning
        self.system_role = system_role
        self.repair = repair
        self.repair_model = repair_model
        self.grammar = grammar
        self.call_timeout = call_timeout
        self.prompt_style = prompt_style
        self.few_shot = few_shot
        self.constrain_values = constrain_values
        self.check_completion = check_completion
        self.max_stalled_steps = max_stalled_steps
        super().__init__()

    @classmethod
    def from_config(cls, config: ModelConfig, client: ToolClient, **options: Any) -> CiaynAgent:
        """An agent on a ``LiteLLMModel`` whose role, repair and grammar settings come from ``config``;
        ``options`` are the other constructor arguments."""
        options.setdefault("system_role", config.system_role)
        options.setdefault("repair", config.repair)
        options.setdefault("grammar", True if config.use_grammar else None)
        if config.repair_model and "repair_model" not in options:
            options["repair_model"] = LiteLLMModel(config.for_repair())
        return cls(LiteLLMModel(config), client, **options)

    def _events(self, task: str | Sequence[Message]) -> Iterator[StepEvent]:
        return _Run(self, task).events()


def _merge_roles(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Merge consecutive user messages: some chat templates insist that roles alternate."""
    out: list[dict[str, Any]] = []
    for m in messages:
        previous = out[-1] if out else None
        if (
            previous is not None
            and m.get("role") == "user" == previous.get("role")
            and isinstance(m.get("content"), str)
            and isinstance(previous.get("content"), str)
        ):
            out[-1] = {**previous, "content": f"{previous['content']}\n\n{m['content']}"}
        else:
            out.append(dict(m))
    return out


@dataclass
class _Run(RunSkeleton):
    """The state of one ``stream``: kept apart from the agent so runs never share it."""

    agent: CiaynAgent
    history: list[Message] = field(default_factory=list)
    initial: list[Message] = field(default_factory=list)  # instructions, examples and task: never trimmed
    count_tokens: TokenCounter = estimate_tokens  # the model's own counter, if it has one
    token_limit: int | None = None  # of the messages sent each step
    grammars: StepGrammar = field(init=False, repr=False)  # set up by ``_start``
    step_grammar: str | None = None  # of this step's request: the run's grammar, or a narrower one
    only_finish: bool = False  # the next reply may only finish (it has the answer and goes round in circles)
    answer_step: int | None = None  # the step after which the run had seen what the task asks for
    seen: SeenValues | None = None  # what the run has seen (for a task given as text)
    narrow_values: bool = False  # whether the grammar is narrowed to ``seen``
    progress: Progress | None = None
    invalid: int = 0
    empty: int = 0
    trim_noticed: bool = False

    def events(self) -> Generator[StepEvent, None, None]:
        """The run: set it up, then one model turn per step until a turn or a limit ends it."""
        ready = yield from self._start()
        if not ready:
            return
        while True:
            finished = self.limit_reached()
            if finished is not None:
                yield finished
                return
            started = self.begin_step()
            yield started
            finished = yield from self._turn(started.step)
            if finished is not None:
                yield finished
                return

    def _start(self) -> Generator[StepEvent, None, bool]:
        """Set the run up: its tools, grammar, what it watches and the messages it never trims; False
        when the executor cannot list its tools (the run has ended, saying so)."""
        a = self.agent
        failed = self.list_tools()
        if failed is not None:
            yield failed
            return False
        warning = self.no_completion_tool()
        if warning is not None:
            yield warning
        self.grammars = StepGrammar(a.model)
        yield from self.grammars.resolve(a.grammar, self.specs)
        if isinstance(self.task, str):
            self.seen = SeenValues.from_task(self.task)
            self.narrow_values = a.constrain_values and a.grammar is True
        self.progress = Progress(self.tools)
        self.initial = _initial_messages(a, self.specs, self.task)
        self.count_tokens = getattr(a.model, "count_tokens", None) or estimate_tokens
        self.token_limit = a.max_history_tokens
        if self.token_limit is None and callable(getattr(a.model, "max_input_tokens", None)):
            self.token_limit = a.model.max_input_tokens()  # type: ignore[attr-defined]
        return True

    def _turn(self, step: int) -> Generator[StepEvent, None, Finished | None]:
        """One model turn: ask, check the reply, run its calls and feed their results back; a
        ``Finished`` when the turn ends the run."""
        reply = yield from self._ask_model(step)
        if isinstance(reply, Finished):
            return reply
        text, reasoning = _reply_text(reply)
        yield ModelText(step=step, text=text, reasoning=reasoning if self.agent.show_reasoning else "")
        yield self.tally.add_usage(step, reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.cost)
        if not strip_markup(text):
            return self._empty_reply()
        self.empty = 0
        try:
            calls, call_text = parse_reply(text, self.tools)
        except CallRejected as e:
            repaired = yield from self._rejected(step, text, e)
            if not isinstance(repaired, tuple):
                return repaired
            calls, call_text = repaired
        self.invalid = 0
        self.history.append({"role": "assistant", "content": call_text})
        outcome = yield from self._execute(step, calls)
        if isinstance(outcome, Finished):
            return outcome
        return (yield from self._feedback(step, outcome))

    def _ask_model(self, step: int) -> Generator[StepEvent, None, ModelReply | Finished]:
        """Send the history, trimmed to the limits, with this step's grammar; the model's reply, or the
        run's end when the request failed or the run was stopped meanwhile."""
        a = self.agent
        messages, dropped = trim_history(
            self.initial,
            self.history,
            max_messages=a.max_history_messages,
            max_tokens=self.token_limit,
            count_tokens=self.count_tokens,
        )
        if dropped and not self.trim_noticed:
            self.trim_noticed = True
            yield Notice(f"History trimmed to fit the limits: {dropped} older messages left out.")
        self.step_grammar, self.only_finish = self._step_grammar(), False
        request = _merge_roles(messages)
        try:
            request_fn = functools.partial(a.model.complete, request, grammar=self.step_grammar)
            reply = yield from self.await_model(step, request_fn)
        except ModelError as e:
            return self.tally.finished("failed", str(e))
        if isinstance(reply, Abandoned):
            return self.stopped()
        return reply

    def _empty_reply(self) -> Finished | None:
        """Count an empty reply: after ``max_empty`` in a row the run fails; before, the model is told
        and asked again."""
        self.empty += 1
        if self.empty >= self.agent.max_empty:
            return self.tally.finished(
                "failed",
                f"the model returned {self.empty} empty replies in a row (nothing but whitespace, "
                "markup or reasoning); it may not follow this prompt format, or its reply was cut "
                "off by the token limit",
            )
        self.history.append({"role": "user", "content": prompts.empty_reply(self.specs)})
        return None

    def _rejected(
        self, step: int, text: str, error: CallRejected
    ) -> Generator[StepEvent, None, tuple[list[Call], str] | Finished | None]:
        """A reply that did not parse, reported: its repair (calls and their text) when ``repair``
        rewrote it; else counted and answered with the rejection (None), and after ``max_invalid`` in a
        row the run's end."""
        yield Rejected(step=step, text=text, message=str(error), code=error.code)
        repaired = yield from self._repair(step, text, error)
        if repaired is not None:
            return repaired
        self.invalid += 1
        self.history.append({"role": "assistant", "content": text})
        self.history.append({"role": "user", "content": prompts.rejected(str(error))})
        if self.invalid >= self.agent.max_invalid:
            return self.tally.finished(
                "failed",
                f"the model sent {self.invalid} invalid replies in a row; the last was rejected because: {error}",
            )
        return None

    def _feedback(
        self, step: int, outcome: list[tuple[Call, Result | str]]
    ) -> Generator[StepEvent, None, Finished | None]:
        """Tell the model what its calls returned, with what the run's progress and ``seen`` add; the
        run's end when it has gone ``max_stalled_steps`` steps without a new result."""
        assert self.progress is not None
        text = prompts.feedback(outcome)
        report = self.progress.record(step, outcome)
        if report.repeats or report.kept_out:
            note, notice = self._progress_note(report, [call for call, _ in outcome])
            if note:
                text = f"{text}\n\n{note}"
                yield Notice(notice)
        ready = self._answer_seen(step)
        if ready:
            text = f"{text}\n\n{ready}"
        self.history.append({"role": "user", "content": text})
        stall_limit = self.agent.max_stalled_steps
        if stall_limit is not None and report.stalled >= stall_limit:
            repeated = list(self.progress.repeated_in_stall.values())
            reason = _stall_reason(report.stalled, repeated, self.agent.max_steps - self.tally.steps)
            return self.tally.finished("stopped", reason)
        return None

    def _progress_note(self, report: StepProgress, calls: list[Call]) -> tuple[str, str]:
        """What the model reads after a step that repeated results or kept calls out, and the notice
        for the transcript. With the answer seen (``controller.seen``) the next reply may only finish."""
        assert self.progress is not None
        finishers = set(prompts.completion_tools(self.specs))
        narrowable = self.grammars.narrowable
        ready = self.narrow_values and self.seen is not None and self.seen.answer_ready()
        self.only_finish = bool(report.repeats and ready and finishers and narrowable)
        made = {fingerprint(c, self.tools.get(c.tool)) for c in calls}
        kept_out = [] if not narrowable or self.only_finish else [
            c for c in self.progress.kept_out() if fingerprint(c, self.tools.get(c.tool)) in made
        ]
        named = _named(self.seen)
        unexplored = [] if self.only_finish else self.progress.unexplored(named)
        note = prompts.progress_note(
            self.specs,
            repeated=[(r.call, r.first_step) for r in report.repeats],
            kept_out=kept_out,
            unexplored=unexplored,
            can_finish=ready or (not self.narrow_values and self._completion_missing() is None),
        )
        only = " or ".join(sorted(finishers)) if self.only_finish else ""
        if only:
            note += f" Your next reply may only call {only}."
        return note, _progress_notice(report, kept_out, unexplored, only)

    def _answer_seen(self, step: int) -> str:
        """With narrowed values: once the run has seen what the task asks for, the model is told so;
        when it makes another call instead of finishing, the next reply may only finish."""
        seen = self.seen
        finishers = sorted(prompts.completion_tools(self.specs))
        if not (self.narrow_values and seen is not None and finishers and seen.answer_ready()):
            return ""
        if self.answer_step is None:
            self.answer_step = step
            return prompts.ANSWER_SEEN.format(finish=" or ".join(finishers))
        self.only_finish = True
        return f"Your next reply may only call {' or '.join(finishers)}."

    def _completion_missing(self) -> str | None:
        """With ``check_completion``: what the task still lacks before a completion call may run."""
        if not self.agent.check_completion or self.seen is None:
            return None
        return self.seen.completion_missing()

    def _completion_refusal(self, call: Call) -> str | None:
        """Why a completion call is not run yet (``check_completion``), in words for the model."""
        if call.tool not in prompts.completion_tools(self.specs):
            return None
        missing = self._completion_missing()
        if missing is None:
            return None
        seen = self.seen
        assert seen is not None and self.progress is not None
        target = seen.write_target() if seen.succeeded and seen.needs_writing() else ""
        return prompts.incomplete(call, missing, self.specs, target, self.progress.unexplored(_named(self.seen)))

    def _step_grammar(self) -> str | None:
        """This step's reply grammar (``StepGrammar.for_step``), from what the run knows now: the calls
        kept out, whether the next reply may only finish or the task is unfinished, what it has seen."""
        return self.grammars.for_step(
            self.specs,
            self.tools,
            kept_out=[] if self.progress is None else self.progress.kept_out(),
            only_finish=self.only_finish,
            unfinished=self._completion_missing() is not None,
            seen=self.seen if self.narrow_values else None,
        )

    def _repair(
        self, step: int, text: str, error: CallRejected
    ) -> Generator[StepEvent, None, tuple[list[Call], str] | None]:
        """Ask the repair model to rewrite a rejected reply; the calls and their text, or None."""
        a = self.agent
        if not a.repair:
            return None
        model = a.repair_model or a.model
        request = [{"role": "user", "content": prompts.repair_prompt(self.specs, text, str(error))}]
        try:
            reply = yield from self.await_model(step, lambda: model.complete(request, grammar=self.step_grammar))
        except ModelError as e:
            yield Notice(f"Repair of the rejected reply failed: {e}")
            return None
        if isinstance(reply, Abandoned):
            return None
        yield self.tally.add_usage(step, reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.cost)
        fixed, _ = _reply_text(reply)
        try:
            calls, fixed = parse_reply(fixed, self.tools)
        except CallRejected as e:
            yield Notice(f"Repair of the rejected reply failed: the rewrite was rejected too ({e})")
            return None
        yield Notice(f"Repaired the rejected reply as: {fixed}")
        return calls, fixed

    def _execute(
        self, step: int, calls: list[Call]
    ) -> Generator[StepEvent, None, list[tuple[Call, Result | str]] | Finished]:
        """Run the calls in order; their outcomes for the feedback, or the run's end."""
        outcomes: list[tuple[Call, Result | str]] = []
        for call in calls:
            if self.stopping.is_set():
                return self.stopped()
            refusal, code = self.repeat_refusal(call), "repeat"
            if refusal is None:
                refusal, code = self._completion_refusal(call), "incomplete"
            if refusal is not None:
                yield Rejected(step=step, text=prompts.format_call(call), message=refusal, code=code)
                outcomes.append((call, refusal))
                continue
            sent = self.with_id(call)
            yield _call_event(step, sent)
            result = yield from self.send_call(sent)
            self.tally.add_result(result)
            if self.seen is not None:
                self.seen.add_result(result, call)
            yield ToolResultEvent.from_result(step, sent.tool, result)
            self.record(call, result)
            yield from self.notes(sent.tool, result)
            ending = self.tally.ending(sent.tool, result)
            if ending is not None:
                return ending
            if self.stopping.is_set():
                return self.stopped()
            outcomes.append((call, result))
        return outcomes


def _initial_messages(agent: CiaynAgent, specs: Sequence[ToolSpec], task: str | Sequence[Message]) -> list[Message]:
    """What every request starts with and trimming never drops: the instructions (in the agent's
    prompt style), the example turns with ``few_shot``, and the task."""
    text = prompts.compact_instructions(specs) if agent.prompt_style == "compact" else prompts.instructions(specs)
    messages: list[Message] = [{"role": agent.system_role, "content": text}]
    if agent.few_shot:
        messages += prompts.example_turns(specs)
    if isinstance(task, str):
        return [*messages, {"role": "user", "content": prompts.TASK.format(task=task)}]
    return [*messages, *(dict(m) for m in task)]


def _progress_notice(report: StepProgress, kept_out: Sequence[Call], unexplored: Sequence[str], only: str) -> str:
    """The transcript's account of a progress note: what the step repeated, what the next reply may
    (``only``: the tools it may only call, if so) or may not call, what was suggested, the stall."""
    said = []
    if report.repeats:
        repeats = (f"{prompts.format_call(r.call)} (same result as at step {r.first_step})" for r in report.repeats)
        said.append("the model repeated " + ", ".join(repeats))
    if only:
        said.append(f"its next reply may only call {only}")
    elif kept_out:
        said.append(f"its next reply may not call {', '.join(prompts.format_call(c) for c in kept_out)}")
    if unexplored:
        said.append(f"suggested what it has not looked at ({', '.join(unexplored[:prompts.MAX_NAMED])})")
    if report.stalled:
        said.append(f"{report.stalled} step{'s' if report.stalled > 1 else ''} in a row without a new result")
    return "Progress: " + "; ".join(said) + "."


def _named(seen: SeenValues | None) -> list[str]:
    """What the task names to look at: its files, and its directories (as ``name/``)."""
    if seen is None:
        return []
    return [*seen.task_names, *(f"{d}/" for d in seen.task_dirs)]


def _stall_reason(stalled: int, repeated: Sequence[Call], left: int) -> str:
    """Why a stalled run ended: how long it stalled, the last calls it repeated, the steps it saved."""
    calls = ", ".join(prompts.format_call(c) for c in list(repeated)[-4:])
    return (
        f"no progress: {stalled} steps in a row got only results this run had already seen"
        + (f" ({calls})" if calls else "")
        + f"; stopped early instead of spending the other {left} steps of the limit"
    )


def _call_event(step: int, call: Call) -> ToolCallEvent:
    """The event of ``call`` (its id set) about to be sent to the executor."""
    return ToolCallEvent(
        step=step,
        call_id=call.id or "",
        tool=call.tool,
        args=list(call.args),
        kwargs=dict(call.kwargs),
        text=prompts.format_call(call),
    )


def _reply_text(reply: ModelReply) -> tuple[str, str]:
    """The reply's text and reasoning, whatever shape a ``Model`` returned them in (a custom model may
    pass list-shaped content or inline think tags through)."""
    cleaned, inline = split_content(reply.text)
    reasoning = "\n\n".join(p for p in (reply.reasoning.strip(), inline) if p)
    return cleaned, reasoning
