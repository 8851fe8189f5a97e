"""Signals a tool raises for the controller; they travel back in the call's ``Result.signals``.

    from executor import signals
    signals.complete("wrote the report")   # the agent's task is done
    signals.exit("cannot continue without credentials")
    signals.note("found 3 failing tests")  # shown in the transcript

Signals are collected per call inside the worker; a call that crashes loses the ones it raised.
"""

from __future__ import annotations

from protocol import Signal

_pending: list[Signal] = []


def complete(summary: str = "") -> None:
    """Mark the agent's task completed, with a one-line summary for the user."""
    _pending.append(Signal(kind="complete", message=str(summary)))


def exit(reason: str = "") -> None:
    """Ask the controller to stop the run (not a success)."""
    _pending.append(Signal(kind="exit", message=str(reason)))


def note(text: str) -> None:
    """Attach a note to the result, shown to the user."""
    _pending.append(Signal(kind="note", message=str(text)))


def drain() -> list[Signal]:
    """Take the signals raised since the last drain (the worker calls this around each call)."""
    out = list(_pending)
    _pending.clear()
    return out
