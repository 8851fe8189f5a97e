"""The run skeleton both backends share: what a run is apart from how its model writes calls.

``RunSkeleton`` holds one run's state and does, once for CIAYN and ReAct alike: listing the tools,
the stop flag and the step/cost/token limits, call ids (unique per run: they key the executor's
shared result cache), the ``no_repeat`` guard (fingerprints normalised with defaults applied),
``bundleable`` checks of a reply's calls, notes from tools, and the two waits a person at a
terminal must be able to interrupt:

- ``await_model`` runs a model request on a helper thread, reports each retry as a ``ModelRetry``
  event while it waits, and abandons the request when the run is stopped;
- ``send_call`` / ``call_until_stopped`` submit a call and wait for its result; a stop cancels the
  call at the executor (``client.cancel``) and waits a bounded time for the ``cancelled`` answer.
"""

from __future__ import annotations

import itertools
import queue
import threading
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

from controller import prompts
from controller.events import Finished, ModelRetry, Notice, StepEvent, StepStarted, Tally
from controller.models import observe_retries
from controller.toolclient import ToolClient
from protocol import Call, Result, ToolSpec, fingerprint

POLL_S = 0.05  # how often a wait looks at the stop flag
CANCEL_WAIT_S = 5.0  # after a cancel, how long to wait for the executor's `cancelled` answer
T = TypeVar("T")


class Abandoned:
    """What ``await_model`` returns when the run was stopped while the model was answering."""


ABANDONED = Abandoned()


def call_until_stopped(
    client: ToolClient, call: Call, timeout: float | None, stopping: threading.Event
) -> Result:
    """Send ``call`` (with its id set) and wait for its result; if ``stopping`` is set meanwhile,
    cancel it at the executor and return the executor's ``cancelled`` result (or, if none comes within
    ``CANCEL_WAIT_S``, a local ``cancelled`` result saying so). Thread-safe."""
    assert call.id, "a call is sent with its id"
    if stopping.is_set():
        return Result.failure(call.id, "cancelled", "the run was stopped before this call was sent")
    future = client.submit(call, timeout=timeout)
    while True:
        try:
            return future.result(timeout=POLL_S)
        except FutureTimeout:
            if stopping.is_set():
                break
    client.cancel(call.id)
    try:
        return future.result(timeout=CANCEL_WAIT_S)
    except FutureTimeout:
        return Result.failure(
            call.id,
            "cancelled",
            f"the run was stopped; the executor did not confirm the cancellation within {CANCEL_WAIT_S:g} s",
        )


@dataclass
class RunSkeleton:
    """One run's shared state and steps. ``agent`` is the backend's agent (a ``StreamingAgent`` with
    ``client``, ``call_timeout``, ``max_steps``, ``max_cost`` and ``max_tokens_total``)."""

    agent: Any
    task: Any
    tally: Tally = field(default_factory=Tally)
    specs: list[ToolSpec] = field(default_factory=list)
    tools: dict[str, ToolSpec] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_fingerprint: str | None = None  # of the last call, if it succeeded
    _serial: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ start and end

    def list_tools(self) -> Finished | None:
        """Fetch the tool specs; a ``Finished`` (failed) when the executor cannot list them."""
        try:
            self.specs = list(self.agent.client.tools())
        except Exception as e:  # the client's own failure, explained for the operator
            return self.tally.finished("failed", f"could not list the executor's tools: {e}")
        self.tools = {s.name: s for s in self.specs}
        return None

    def stopped(self) -> Finished:
        return self.tally.finished("stopped", self.agent._stop_reason or "stopped")

    @property
    def stopping(self) -> threading.Event:
        event: threading.Event = self.agent._stop
        return event

    def limit_reached(self) -> Finished | None:
        """Before each model request: the stop flag, then the step, cost and token limits."""
        a = self.agent
        if a._stop.is_set():
            return self.stopped()
        return self.tally.limit_reached(a.max_steps, a.max_cost, getattr(a, "max_tokens_total", None))

    def begin_step(self) -> StepStarted:
        self.tally.steps += 1
        return StepStarted(step=self.tally.steps)

    # ------------------------------------------------------------------ the model

    def await_model(
        self, step: int, request: Callable[[], T]
    ) -> Generator[StepEvent, None, T | Abandoned]:
        """Run ``request`` on a helper thread; yield a ``ModelRetry`` for each retry while waiting.
        Its value, its exception (raised here), or ``ABANDONED`` when the run is stopped meanwhile
        (the request is left to finish on its own; its answer is dropped)."""
        box: dict[str, Any] = {}
        done = threading.Event()
        retries: queue.SimpleQueue[ModelRetry] = queue.SimpleQueue()

        def report(attempt: int, delay: float, reason: str) -> None:
            retries.put(ModelRetry(step=step, attempt=attempt, delay_s=round(delay, 2), reason=reason))

        def work() -> None:
            try:
                with observe_retries(report):
                    box["value"] = request()
            except BaseException as e:  # handed to the run's thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name=f"ciayn-model-{self.run_id[:8]}-{step}", daemon=True).start()
        while not done.wait(POLL_S):
            while not retries.empty():
                yield retries.get()
            if self.stopping.is_set():
                yield Notice(f"Abandoned the model request of step {step}: the run was stopped.")
                return ABANDONED
        while not retries.empty():
            yield retries.get()
        if "error" in box:
            raise box["error"]
        value: T = box["value"]
        return value

    # ------------------------------------------------------------------ calls

    def next_id(self) -> str:
        with self._lock:
            return f"{self.run_id}-{next(self._serial)}"

    def with_id(self, call: Call) -> Call:
        return call.model_copy(update={"id": self.next_id()})

    def repeat_refusal(self, call: Call) -> str | None:
        """Why ``call`` is not run, when its tool is ``no_repeat`` and it repeats the last call, which
        succeeded (same tool, same arguments once defaults are applied); else None."""
        spec = self.tools.get(call.tool)
        if spec is not None and spec.no_repeat and fingerprint(call, spec) == self.last_fingerprint:
            return prompts.repeat(call)
        return None

    def record(self, call: Call, result: Result) -> None:
        """Remember a finished call for the repeat guard (only a success counts: a retry after a
        crash or timeout is allowed)."""
        self.last_fingerprint = fingerprint(call, self.tools.get(call.tool)) if result.ok else None

    def bundle_refusals(self, calls: Sequence[Call]) -> dict[int, str]:
        """For a reply with several calls: the index of each call that may not run with the others
        (its tool is not ``bundleable``), with the reason. The first call always runs."""
        if len(calls) < 2:
            return {}
        allowed = ", ".join(sorted(n for n, s in self.tools.items() if s.bundleable)) or "(none)"
        refusals: dict[int, str] = {}
        for i, call in enumerate(calls):
            spec = self.tools.get(call.tool)
            if i > 0 and (spec is None or not spec.bundleable or not self._bundleable(calls[0])):
                refusals[i] = (
                    f"{prompts.format_call(call)} was not run: it was sent together with other calls, and "
                    f"only these tools may be: {allowed}. Send it again in a reply of its own."
                )
        return refusals

    def _bundleable(self, call: Call) -> bool:
        spec = self.tools.get(call.tool)
        return spec is not None and spec.bundleable

    def send_call(self, call: Call) -> Generator[StepEvent, None, Result]:
        """Run one call (with its id set) until it ends or the run is stopped; a stop cancels it at
        the executor and says what was cancelled."""
        a = self.agent
        result = call_until_stopped(a.client, call, a.call_timeout, self.stopping)
        if self.stopping.is_set() and result.error is not None and result.error.kind == "cancelled":
            yield Notice(f"Cancelled {prompts.format_call(call)} (call {call.id}) at the executor.")
        return result

    def notes(self, tool: str, result: Result) -> list[Notice]:
        """A tool's ``note`` signals, as notices."""
        return [Notice(f"{tool}: {s.message}") for s in result.signals if s.kind == "note"]

    def no_completion_tool(self) -> Notice | None:
        """The warning for a CIAYN run offered no tool that looks like it reports completion: such a
        run can only end at a limit."""
        if prompts.completion_tools(self.specs):
            return None
        names = ", ".join(self.tools) or "(none)"
        return Notice(
            "Warning: none of the offered tools looks like a completion tool (a name with complete, finish "
            f"or done; offered: {names}). A CIAYN run succeeds only when a tool signals completion "
            "(executor.signals.complete), so this run can only end at its step limit. Offer one, e.g. the "
            "built-in complete_task."
        )
