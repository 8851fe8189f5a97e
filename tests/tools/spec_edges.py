"""Tools for tests/test_spec_edges.py: a return value only its repr can carry, a run token after a
sleep, signals with an error, and the ways a module declares tools (``@tool`` with flags, a bare
``@tool``, a public function listed in ``__all__``)."""

from __future__ import annotations

import time
import uuid

from executor import signals, tool

__all__ = ["listed"]


@tool
def big_set(n: int = 50_000) -> object:
    """A set of n ints: msgpack cannot carry it, so only its (long) repr comes back."""
    return set(range(n))


@tool(idempotent=True, timeout=5, no_repeat=True, bundleable=True, name="flagged_tool")
def token_after(seconds: float = 0.0) -> str:
    """Sleep `seconds`, then return a token of this run."""
    time.sleep(seconds)
    return uuid.uuid4().hex


@tool
def signal_then_fail() -> None:
    """Raise a note and a complete signal, then fail."""
    signals.note("looked")
    signals.complete("done anyway")
    raise RuntimeError("failed after signalling")


def listed(x: int) -> int:
    """Listed in __all__, not decorated: a tool with every flag at its default."""
    return x


def _private(x: int) -> int:
    return x
