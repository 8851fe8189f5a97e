"""The reply grammar of each CIAYN step: the agent's own GBNF string, or one built from the tool specs
(``controller.gbnf``) and narrowed, step by step, to what the model may still usefully write.

A grammar built from the specs bounds free text values by the model's reply cap, so no call is cut
off half-way. Narrowing leaves out the calls ``controller.progress`` keeps out, offers only the
completion tools after a loop on a ready answer (and none of them while the task visibly lacks
something), and with ``constrain_values`` admits only the values the run has seen
(``controller.seen``). Each combination is built once per run; one that cannot be built falls back to
the run's grammar.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller import prompts
from controller.events import Notice
from controller.models import Model
from controller.progress import without_calls
from controller.seen import SeenValues
from protocol import Call, ToolSpec, fingerprint


def build_grammar(specs: Sequence[ToolSpec]) -> str:
    """The GBNF grammar of valid replies, from ``controller.gbnf`` (raises ImportError without it)."""
    gbnf: Any = importlib.import_module("controller.gbnf")
    grammar: str = gbnf.call_grammar(list(specs))
    return grammar


def fit_reply_cap(specs: Sequence[ToolSpec], model: Model) -> list[ToolSpec]:
    """``specs`` whose free text values fit the model's reply cap (``max_tokens`` of its config):
    at most that many characters each, so a call is not cut off half-way (a cut reply cannot
    parse). Only for caps a double-quoted string can hold (``gbnf.MAX_STRING_CHARS``)."""
    cap = getattr(getattr(model, "config", None), "max_tokens", None)
    limit: int = getattr(importlib.import_module("controller.gbnf"), "MAX_STRING_CHARS", 0)
    if not isinstance(cap, int) or isinstance(cap, bool) or not 0 < cap <= limit:
        return list(specs)
    out = []
    for spec in specs:
        properties = dict(spec.parameters.get("properties") or {})
        for name, schema in properties.items():
            free = isinstance(schema, dict) and schema.get("type") == "string"
            if free and not {"enum", "maxLength"} & set(schema):
                properties[name] = {**schema, "maxLength": cap}
        out.append(spec.model_copy(update={"parameters": {**spec.parameters, "properties": properties}}))
    return out


@dataclass
class StepGrammar:
    """One run's reply grammars: ``grammar`` is the run's (``resolve``), ``for_step`` the one a step's
    request carries."""

    model: Model  # whose reply cap bounds free text values
    grammar: str | None = None  # of the offered tools
    from_specs: bool = False  # whether the agent asked for a grammar built from the tool specs
    narrowed: dict[tuple[Any, ...], str | None] = field(default_factory=dict)

    def resolve(self, setting: str | bool | None, specs: Sequence[ToolSpec]) -> Iterator[Notice]:
        """Take the agent's ``grammar`` setting: a GBNF string as given, True built from ``specs``
        (without a grammar, and a notice saying why, when that fails), anything else none."""
        self.from_specs = setting is True
        if isinstance(setting, str):
            self.grammar = setting
        elif setting is True:
            try:
                self.grammar = build_grammar(fit_reply_cap(specs, self.model))
            except ImportError:
                yield Notice("No reply grammar: controller.gbnf is not available; replies are unconstrained.")
            except Exception as e:
                yield Notice(f"No reply grammar: building it failed ({type(e).__name__}: {e}).")

    @property
    def narrowable(self) -> bool:
        """Whether each step's grammar is built from the tool specs (and so may be narrowed)."""
        return self.from_specs and self.grammar is not None

    def for_step(
        self,
        specs: Sequence[ToolSpec],
        tools: Mapping[str, ToolSpec],
        *,
        kept_out: Sequence[Call],
        only_finish: bool,
        unfinished: bool,
        seen: SeenValues | None,
    ) -> str | None:
        """This step's reply grammar: the run's, or (when it is built from the tool specs) one without
        the ``kept_out`` calls, with only the completion tools when ``only_finish``, without them while
        the task is ``unfinished``, and (given ``seen``) its arguments narrowed to the values seen so
        far; built once per combination."""
        if not self.narrowable:
            return self.grammar
        if not kept_out and not only_finish and seen is None and not unfinished:
            return self.grammar
        marks = frozenset(fingerprint(c, tools.get(c.tool)) for c in kept_out)
        key = (marks, only_finish, unfinished, seen.version if seen is not None else -1)
        if key not in self.narrowed:
            offered = list(specs)
            finishers = set(prompts.completion_tools(offered))
            if only_finish:
                offered = [s for s in offered if s.name in finishers]
            elif unfinished and set(tools) - finishers:
                offered = [s for s in offered if s.name not in finishers]
            if seen is not None:
                offered = seen.constrain(offered)
            offered = without_calls(offered, kept_out)
            try:
                self.narrowed[key] = build_grammar(fit_reply_cap(offered, self.model))
            except Exception:
                self.narrowed[key] = self.grammar
        return self.narrowed[key]
