"""Structured step events: what an agent run yields, whatever its backend.

Both backends (CIAYN and ReAct) yield these, so the CLI renders one transcript, ``--json`` prints one
JSON object per line (``event.to_json()``, with an ``"event"`` field naming the kind), and tests
assert on the same values. ``Tally`` keeps a run's counters and makes the ``Usage`` and ``Finished``
events, so both backends count steps, calls, errors, tokens and cost the same way.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

from protocol import Result

FinishStatus = Literal["completed", "failed", "stopped"]
SUMMARY_CHARS = 160  # a one-line summary of a value or error in a ToolResultEvent


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return repr(value)


@dataclass(frozen=True)
class Event:
    """Base of every step event. ``KIND`` names it in JSON; ``at`` is when it happened (Unix
    seconds; JSON shows it as an ISO 8601 UTC timestamp ``ts``). ``at`` is not compared."""

    KIND: ClassVar[str] = "event"
    at: float = field(default_factory=time.time, kw_only=True, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "at"}
        stamp = datetime.fromtimestamp(self.at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return {"event": self.KIND, "ts": stamp, **fields}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_json_default, ensure_ascii=False)


@dataclass(frozen=True)
class StepStarted(Event):
    """A step begins: its model request is about to be sent (the transcript's step header)."""

    KIND: ClassVar[str] = "step"
    step: int


@dataclass(frozen=True)
class ModelRetry(Event):
    """A model request failed in a way worth retrying; the next attempt follows after ``delay_s``."""

    KIND: ClassVar[str] = "model_retry"
    step: int
    attempt: int
    delay_s: float
    reason: str


@dataclass(frozen=True)
class ModelText(Event):
    """The model's reply in a step, without its reasoning; ``reasoning`` is filled only when the
    agent was asked to show it."""

    KIND: ClassVar[str] = "model_text"
    step: int
    text: str
    reasoning: str = ""


@dataclass(frozen=True)
class ToolCallEvent(Event):
    """A call descriptor about to be sent to the executor. ``text`` is the call as Python text."""

    KIND: ClassVar[str] = "tool_call"
    step: int
    call_id: str
    tool: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    text: str = ""


@dataclass(frozen=True)
class ToolResultEvent(Event):
    """The executor's answer to one call, with the worker's cost of running it."""

    KIND: ClassVar[str] = "tool_result"
    step: int
    call_id: str
    tool: str
    ok: bool
    summary: str = ""
    error_kind: str | None = None
    error_message: str | None = None
    worker_pid: int | None = None
    worker_restarted: bool = False
    wall_s: float | None = None
    peak_rss_kb: int | None = None
    value: Any = None
    value_is_repr: bool = False  # the tool returned an object that is not data: ``value`` is its repr()

    @classmethod
    def from_result(cls, step: int, tool: str, result: Result) -> ToolResultEvent:
        worker = result.worker
        stats = result.stats
        error = result.error
        return cls(
            step=step,
            call_id=result.id,
            tool=tool,
            ok=result.ok,
            summary=summarize(result),
            error_kind=error.kind if error else None,
            error_message=error.message if error else None,
            worker_pid=worker.pid if worker else None,
            worker_restarted=bool(worker and worker.restarted),
            wall_s=stats.wall_s if stats else None,
            peak_rss_kb=stats.peak_rss_kb if stats else None,
            value=result.value,
            value_is_repr=result.value_is_repr,
        )


@dataclass(frozen=True)
class Rejected(Event):
    """A reply (or one call of it) the agent refused before it reached the executor: it did not
    parse as a valid call, or it repeated a call that had just succeeded. ``message`` is what the
    model was told; ``code`` is the short reason (``syntax``, ``unknown_tool``, ``repeat``, ...)."""

    KIND: ClassVar[str] = "rejected"
    step: int
    text: str
    message: str
    code: str = ""


@dataclass(frozen=True)
class Usage(Event):
    """Tokens and cost of one step's model requests, and the run's totals so far."""

    KIND: ClassVar[str] = "usage"
    step: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    total_prompt_tokens: int
    total_completion_tokens: int
    total_cost: float


@dataclass(frozen=True)
class Notice(Event):
    """Something the user should know that is not a step (a note from a tool, a repair, a limit)."""

    KIND: ClassVar[str] = "notice"
    text: str


@dataclass(frozen=True)
class Finished(Event):
    """The last event of every run. ``status`` is ``completed`` when a tool signalled completion
    (``summary`` is its message), ``stopped`` for a limit or an exit signal, ``failed`` otherwise;
    ``reason`` says why in plain words."""

    KIND: ClassVar[str] = "finished"
    status: FinishStatus
    reason: str
    summary: str = ""
    steps: int = 0
    calls: int = 0
    tool_errors: int = 0
    worker_restarts: int = 0
    tokens: int = 0
    cost: float = 0.0


StepEvent = (
    StepStarted | ModelRetry | ModelText | ToolCallEvent | ToolResultEvent | Rejected | Usage | Notice | Finished
)


def summarize(result: Result) -> str:
    """One line: the start of the value, or the error's kind and message."""
    if result.ok:
        value = result.value
        if value is None:
            text = "(no value)"
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value, default=_json_default, ensure_ascii=False)
    else:
        error = result.error
        text = f"{error.kind}: {error.message}" if error else "error"
    text = " ".join(text.split())
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 3] + "..."


@dataclass
class Tally:
    """A run's counters, updated as it goes; makes the ``Usage`` and ``Finished`` events."""

    steps: int = 0
    calls: int = 0
    tool_errors: int = 0
    worker_restarts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add_usage(self, step: int, prompt_tokens: int, completion_tokens: int, cost: float) -> Usage:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cost += cost
        return Usage(
            step=step,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cost=cost,
            total_prompt_tokens=self.prompt_tokens,
            total_completion_tokens=self.completion_tokens,
            total_cost=self.cost,
        )

    def add_result(self, result: Result) -> None:
        self.calls += 1
        if not result.ok:
            self.tool_errors += 1
        if result.worker is not None and result.worker.restarted:
            self.worker_restarts += 1

    def finished(self, status: FinishStatus, reason: str, summary: str = "") -> Finished:
        return Finished(
            status=status,
            reason=reason,
            summary=summary,
            steps=self.steps,
            calls=self.calls,
            tool_errors=self.tool_errors,
            worker_restarts=self.worker_restarts,
            tokens=self.tokens,
            cost=self.cost,
        )

    # Run endings both backends share, so a limit or a signal reads the same whatever the backend.

    def limit_reached(
        self, max_steps: int, max_cost: float | None, max_tokens_total: int | None = None
    ) -> Finished | None:
        """The ``Finished`` event for a step, cost or token limit reached before the next model request."""
        if self.steps >= max_steps:
            return self.finished("stopped", f"the step limit ({max_steps}) was reached before the task was completed")
        if max_cost is not None and self.cost >= max_cost:
            return self.finished("stopped", f"the cost limit (${max_cost:.4f}) was reached: ${self.cost:.4f} spent")
        if max_tokens_total is not None and self.tokens >= max_tokens_total:
            return self.finished(
                "stopped", f"the token limit ({max_tokens_total}) was reached: {self.tokens} tokens used"
            )
        return None

    def ending(self, tool: str, result: Result) -> Finished | None:
        """The ``Finished`` event a call's result ends the run with (an unavailable executor, a
        ``complete`` or ``exit`` signal), or None when the run goes on."""
        if result.error is not None and result.error.kind == "unavailable":
            reason = f"the executor is unavailable ({result.error.message}); the run cannot go on"
            return self.finished("failed", reason)
        for signal in result.signals:
            if signal.kind == "complete":
                return self.finished("completed", "a tool reported the task complete", signal.message)
            if signal.kind == "exit":
                reason = f"{tool} asked to stop the run" + (f": {signal.message}" if signal.message else "")
                return self.finished("stopped", reason, signal.message)
        return None


def final_event(events: Iterable[StepEvent]) -> Finished:
    """Run a stream of step events to its end and return its ``Finished`` event."""
    finished: Finished | None = None
    for event in events:
        if isinstance(event, Finished):
            finished = event
    if finished is None:
        raise RuntimeError("the run ended without a Finished event")
    return finished


class StreamingAgent:
    """What both backends share: a thread-safe stop flag, and ``stream``/``run`` over the run's
    step events. A backend implements ``_events(task)``; ``controller.run.RunSkeleton`` checks
    ``_stop`` between steps and while a model request or a tool call is in flight."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._stop_reason = ""

    def stop(self, reason: str = "stopped by the user") -> None:
        """Ask a running ``stream`` to end (thread-safe): the model request in flight is abandoned,
        the tool call in flight is cancelled at the executor, calls not yet sent are not sent, and
        the run finishes with status ``stopped``. A stop that arrives before ``stream`` starts is
        kept: that run ends at once (RA.Aid cleared it, losing a stop from another thread)."""
        self._stop_reason = reason
        self._stop.set()

    def stream(self, task: Any) -> Iterator[StepEvent]:
        """Run ``task`` (text, or initial messages) and yield step events; the last is ``Finished``."""
        return self._consume_stop(self._events(task))

    def _consume_stop(self, events: Iterator[StepEvent]) -> Iterator[StepEvent]:
        for event in events:
            if isinstance(event, Finished) and event.status == "stopped" and self._stop.is_set():
                self._stop.clear()  # this run honoured it; the next one starts afresh
            yield event

    def run(self, task: Any) -> Finished:
        """Run to the end and return the ``Finished`` event."""
        return final_event(self.stream(task))

    def _events(self, task: Any) -> Iterator[StepEvent]:
        raise NotImplementedError
