"""Which backend runs a model: ReAct (native tool calling) or CIAYN (one line of Python per step).

The answer comes from, in order:

1. the user's choice (``--backend react|ciayn``), which always wins;
2. a per-model table of backends known to work (the caller's table first, then ``KNOWN_BACKENDS``);
3. the caller's declaration ``supports_function_calling`` for this model;
4. litellm's ``supports_function_calling``, read from its bundled model map (offline).

litellm's map is a default, not an oracle: it drops retired model names (``claude-3-5-sonnet-20241022``
reads as no tool calling), knows nothing of local aliases (``openai/<alias>`` on an OpenAI-compatible
server reads as no tool calling), and for an ``ollama_chat/<model>`` it does not know it asks a local
Ollama server over HTTP; such names are never passed to it. When the lookup itself fails, the choice
is CIAYN, which works with any model that can write a line of code, and the choice says so.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from controller.models import import_litellm

Backend = Literal["react", "ciayn"]
BACKENDS: tuple[Backend, ...] = ("react", "ciayn")

KNOWN_BACKENDS: dict[str, Backend] = {
    # Local aliases of the embedded model (controller.local_model): one GGUF served twice.
    "openai/smollm2": "ciayn",
    "openai/smollm2-tools": "react",
    # Hosted models whose native tool calling is known to work; several are missing from (or
    # retired in) litellm's map. A pattern without "/" matches the name after the provider prefix.
    "gpt-4o*": "react",
    "gpt-4.1*": "react",
    "claude-3-5*": "react",
    "claude-3-7*": "react",
    "claude-sonnet-4*": "react",
    "claude-opus-4*": "react",
}

_NOT_ASKED_PREFIXES = ("ollama_chat/",)  # litellm would make an HTTP call to find out


@dataclass(frozen=True)
class BackendChoice:
    """The backend for a model, why (one clause, for the transcript), and a ``notice`` when the user
    should know something went wrong in choosing (the lookup failed)."""

    backend: Backend
    reason: str
    notice: str | None = None

    def describe(self) -> str:
        """One sentence for the transcript."""
        return self.notice or f"Backend: {self.backend} ({self.reason})."


def _check_backend(value: object, where: str) -> Backend:
    if value not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(BACKENDS)} (or 'auto'), not {value!r}")
    return value


def table_backend(model: str, table: Mapping[str, str] | None = None) -> Backend | None:
    """The backend ``table`` (then ``KNOWN_BACKENDS``) gives ``model``, or None if no entry matches.

    An entry with a "/" matches the whole model name; one without matches the name after its
    provider prefix too (``gpt-4o*`` matches ``openai/gpt-4o-mini``). Case-insensitive."""
    name = model.strip().lower()
    bare = name.rsplit("/", 1)[-1]
    for source in (table or {}, KNOWN_BACKENDS):
        for pattern, backend in source.items():
            pattern = pattern.lower()
            if fnmatch.fnmatchcase(name, pattern) or ("/" not in pattern and fnmatch.fnmatchcase(bare, pattern)):
                return _check_backend(backend, f"the backend for {pattern!r}")
    return None


def choose_backend(model: str, requested: str = "auto", config: Mapping[str, Any] | None = None) -> BackendChoice:
    """Choose the backend for ``model`` (a litellm model string).

    ``requested`` is the user's ``--backend`` (``auto``, ``react`` or ``ciayn``). ``config`` may hold
    ``backend`` (used when ``requested`` is ``auto``), ``backends`` (a table of model patterns to
    backends, consulted before ``KNOWN_BACKENDS``) and ``supports_function_calling`` (the user's word
    for this model). Never raises for a failed lookup: that gives CIAYN with a notice."""
    config = config or {}
    if requested == "auto":
        requested = config.get("backend") or "auto"
    if requested != "auto":
        return BackendChoice(_check_backend(requested, "backend"), "chosen by the user")

    known = table_backend(model, config.get("backends"))
    if known is not None:
        return BackendChoice(known, f"{model} is listed as working with the {known} backend")

    declared = config.get("supports_function_calling")
    if declared is not None:
        backend: Backend = "react" if declared else "ciayn"
        says = "supports" if declared else "does not support"
        return BackendChoice(backend, f"the configuration says {model} {says} native tool calling")

    if model.strip().lower().startswith(_NOT_ASKED_PREFIXES):
        return BackendChoice(
            "ciayn",
            f"whether {model} calls tools natively is unknown (litellm would ask a local Ollama server); "
            "CIAYN works with any model. Pass --backend react to use native tool calling",
        )

    try:
        supported = bool(import_litellm().supports_function_calling(model=model))
    except Exception as e:
        reason = f"could not tell whether {model} supports native tool calling ({type(e).__name__}: {e})"
        return BackendChoice(
            "ciayn",
            reason,
            notice=(
                f"Backend: ciayn. Backend detection failed: {reason}. Falling back to the CIAYN backend, which "
                "works with any model that can write a line of code; pass --backend react to override."
            ),
        )
    if supported:
        return BackendChoice("react", f"litellm lists native tool calling for {model}")
    return BackendChoice(
        "ciayn",
        f"litellm does not list native tool calling for {model} (its map lacks local aliases and retired "
        "names; pass --backend react to override)",
    )


def should_use_react_agent(model: str, config: Mapping[str, Any] | None = None) -> bool:
    """Whether ``model`` should run on the ReAct backend; see ``choose_backend`` for ``config``."""
    return choose_backend(model, "auto", config).backend == "react"
