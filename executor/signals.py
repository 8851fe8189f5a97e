"""Signals a tool raises for the controller; they travel back in the call's ``Result.signals``.

    from executor import signals
    signals.complete("wrote the report")   # the agent's task is done
    signals.exit("cannot continue without credentials")
    signals.note("found 3 failing tests")  # shown in the transcript

Signals are collected per call inside the worker; a call that crashes loses the ones it raised.
"""

from __future__ import annotations

from typing import NamedTuple


class Raised(NamedTuple):
    """One signal a tool raised (the supervisor makes a ``protocol.Signal`` of it: the far side of the
    fork never imports pydantic)."""

    kind: str
    message: str


_pending: list[Raised] = []


def complete(summary: str = "") -> None:
    """Mark the agent's task completed, with a one-line summary for the user."""
    _pending.append(Raised("complete", str(summary)))


def exit(reason: str = "") -> None:
    """Ask the controller to stop the run (not a success)."""
    _pending.append(Raised("exit", str(reason)))


def note(text: str) -> None:
    """Attach a note to the result, shown to the user."""
    _pending.append(Raised("note", str(text)))


def drain() -> list[Raised]:
    """Take the signals raised since the last drain (the worker calls this around each call)."""
    out = list(_pending)
    _pending.clear()
    return out
