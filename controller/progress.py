"""Whether a run gets anywhere: calls that got a result the run had already seen, calls kept out of
the reply grammar, and what the run has seen but not looked at.

``Progress`` watches every call of a CIAYN run with its arguments (``protocol.fingerprint``, defaults
applied) and its outcome. A step *makes progress* when one of its calls got an outcome the run had
not seen for that call before; a step that does not is *stalled*. Weak models go round in cycles
(A A B B, A B A B) that a guard comparing a step with the one before never ends; this sees every
repeat in the run:

- a call whose answer cannot change is kept out of the grammar for the rest of the run, or until a
  tool that may change what calls find (one not flagged ``idempotent``) succeeds: a call of an
  ``idempotent`` tool that succeeded (its result is in the conversation already), and a call that
  failed in a way that does not depend on chance (``tool_error``, ``bad_arguments``, ...; other
  failures once they repeat);
- while the run is stalled, every call that repeated in the stall is kept out too, so the next
  reply must try something else; progress lets them back in;
- ``unexplored`` names what the run has seen but no successful call has used: the files the task
  names and the entries listings returned, for a suggestion the model reads (``prompts.progress_note``);
- the agent ends a run after ``max_stalled_steps`` stalled steps in a row (``CiaynAgent``).

``without_calls`` applies the kept-out calls to tool specs before the grammar is built from them
(``controller.gbnf``): a call's first text argument loses the value it had (an ``enum`` drops it, a
free string gets ``"not"``), a tool without parameters is left out. It narrows what the model may
write and never widens what the parser accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol import Call, Result, ToolSpec, fingerprint
from protocol.spec import BindError, Param

DEFAULT_MAX_STALLED_STEPS = 4
# Error kinds whose answer does not depend on chance: the same call on the same workspace gets it again.
SETTLED_FAILURES = frozenset({"tool_error", "bad_arguments", "unknown_tool", "rejected", "unserializable"})


def outcome_key(outcome: Result | str) -> str:
    """What a call's outcome looks like to the model (value, output, error; not ids or timings); a
    ``str`` is a call the agent refused, by the reason it gave."""
    if isinstance(outcome, str):
        return outcome
    error = outcome.error
    return repr((outcome.ok, outcome.value, outcome.stdout, outcome.stderr, error and (error.kind, error.message)))


@dataclass(frozen=True)
class Repeat:
    """A call of this step that got an outcome it had already got at ``first_step``."""

    call: Call
    first_step: int
    failed: bool


@dataclass(frozen=True)
class StepProgress:
    """What one step did for the run: its repeats, the calls it newly kept out for the rest of the
    run (they failed), and how many steps in a row, this one included, made no progress."""

    repeats: tuple[Repeat, ...] = ()
    kept_out: tuple[Call, ...] = ()
    stalled: int = 0


@dataclass
class Progress:
    """One run's calls and outcomes; ``record`` each step's, then ask what to keep out and suggest."""

    tools: Mapping[str, ToolSpec]
    stalled: int = 0  # steps in a row without progress
    first_seen: dict[tuple[str, str], int] = field(default_factory=dict)  # (call, outcome) -> step
    settled: dict[str, Call] = field(default_factory=dict)  # kept out until something may have changed
    repeated_in_stall: dict[str, Call] = field(default_factory=dict)  # kept out until progress
    listed: list[str] = field(default_factory=list)  # entries listings returned, in order
    used: set[str] = field(default_factory=set)  # text arguments of the calls that succeeded

    def record(self, step: int, outcomes: Sequence[tuple[Call, Result | str]]) -> StepProgress:
        """Take in one step's calls and outcomes (a ``str`` outcome: the agent refused the call)."""
        progressed = False
        repeats: list[Repeat] = []
        kept_out: list[Call] = []
        for call, outcome in outcomes:
            spec = self.tools.get(call.tool)
            mark = fingerprint(call, spec)
            key = (mark, outcome_key(outcome))
            ran = isinstance(outcome, Result)
            failed = ran and not outcome.ok  # type: ignore[union-attr]
            if key in self.first_seen:
                repeats.append(Repeat(call, self.first_seen[key], failed))
                if ran:
                    self.repeated_in_stall[mark] = call
            else:
                self.first_seen[key] = step
                progressed = progressed or ran
            if not isinstance(outcome, Result):
                continue
            if outcome.ok:
                self.used.update(v for v in _bound(call, spec).values() if isinstance(v, str))
                if spec is None or not spec.idempotent:
                    self.settled.clear()  # it may have changed what those calls would find
                else:
                    self.settled[mark] = call
                if isinstance(outcome.value, list):
                    entries = [e for e in outcome.value if isinstance(e, str) and e not in self.listed]
                    self.listed += entries
            elif mark not in self.settled and (self.first_seen[key] < step or _settled(outcome)):
                self.settled[mark] = call
                kept_out.append(call)
        if progressed:
            self.stalled = 0
            self.repeated_in_stall.clear()
        else:
            self.stalled += 1
        return StepProgress(tuple(repeats), tuple(kept_out), self.stalled)

    def kept_out(self) -> list[Call]:
        """The calls the next reply's grammar leaves out: those whose answer cannot change (see the
        module's docstring), and repeats of the current stall."""
        return list({**self.settled, **self.repeated_in_stall}.values())

    def unexplored(self, named: Sequence[str] = ()) -> list[str]:
        """Names the run has seen that no call has used yet: ``named`` (the files the task names)
        first, then the entries listings returned, in order."""
        names = dict.fromkeys([*named, *self.listed])
        return [n for n in names if n not in self.used and n.rstrip("/") not in self.used]


def _settled(result: Result) -> bool:
    return result.error is not None and result.error.kind in SETTLED_FAILURES


def _bound(call: Call, spec: ToolSpec | None) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied (positional ones numbered when the
    tool's signature is unknown or they do not bind)."""
    if spec is not None:
        try:
            return {**spec.defaults(), **spec.bind(call.args, call.kwargs)}
        except BindError:
            pass
    return {**{str(i): v for i, v in enumerate(call.args)}, **call.kwargs}


def without_calls(specs: Sequence[ToolSpec], calls: Iterable[Call]) -> list[ToolSpec]:
    """Copies of ``specs`` from whose grammar ``calls`` cannot be written again.

    A call of a tool without parameters leaves the tool out. Otherwise the call's first text argument
    (in the order of the signature, defaults applied) is kept from having that value: an ``enum``
    loses it, a free string gets ``"not": {"enum": [...]}``, and an optional parameter whose default
    is kept out becomes required. That is keyed on one argument, so ``read_file(path=".")`` keeps out
    ``"."`` whatever else the call gives; a call with no text argument is not kept out (the stall
    limit still ends its loop). A tool left with nothing it can be called with is left out; if that
    would leave no tool, ``specs`` are returned as they are."""
    by_tool: dict[str, dict[str, set[str]]] = {}
    dropped: set[str] = set()
    for call in calls:
        spec = next((s for s in specs if s.name == call.tool), None)
        if spec is None:
            continue
        named = [p for p in spec.params if not p.kind.startswith("var_")]
        if not named:
            dropped.add(spec.name)
            continue
        bound = _bound(call, spec)
        first = next((p.name for p in named if isinstance(bound.get(p.name), str)), None)
        if first is not None:
            by_tool.setdefault(spec.name, {}).setdefault(first, set()).add(bound[first])
    out = []
    for spec in specs:
        if spec.name in dropped:
            continue
        narrowed = _narrow(spec, by_tool.get(spec.name, {}))
        if narrowed is not None:
            out.append(narrowed)
    return out or list(specs)


def _narrow(spec: ToolSpec, values: Mapping[str, set[str]]) -> ToolSpec | None:
    """``spec`` with ``values`` kept out of its parameters, or None when it can no longer be called."""
    if not values:
        return spec
    properties = dict(spec.parameters.get("properties") or {})
    required = list(spec.parameters.get("required") or [])
    params: list[Param] = []
    defaults = spec.defaults()
    for p in spec.params:
        out = values.get(p.name)
        schema = properties.get(p.name)
        if not out or not isinstance(schema, dict):
            params.append(p)
            continue
        if isinstance(schema.get("enum"), list):
            left = [v for v in schema["enum"] if v not in out]
            if not left:
                if p.required or p.name not in defaults or defaults[p.name] in out:
                    return None  # every way to call it gives a kept-out value (or may: default unknown)
                continue  # no value of its own is left: the parameter is not offered
            schema = {**schema, "enum": left}
        elif schema.get("type") == "string":
            kept = schema.get("not", {}).get("enum", []) if isinstance(schema.get("not"), dict) else []
            schema = {**schema, "not": {"enum": sorted({*kept, *out})}}
        else:
            params.append(p)
            continue
        properties[p.name] = schema
        if not p.required and defaults.get(p.name) in out:
            p = p.model_copy(update={"required": True})
            required.append(p.name)
        params.append(p)
    parameters = {**spec.parameters, "properties": properties, "required": required}
    return spec.model_copy(update={"parameters": parameters, "params": params})
