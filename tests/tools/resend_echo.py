"""The tool the resend vectors (``protocol/vectors/resend.json``) call: ``echo`` takes any arguments
and returns a token of its own run, so a resend answered from the first call's result shows the
first run's token and a second run would show another."""

from __future__ import annotations

import uuid

from executor import tool


@tool
def echo(*args: object, **kwargs: object) -> str:
    """Return a fresh token for this run (the arguments are only there to be compared)."""
    return uuid.uuid4().hex
