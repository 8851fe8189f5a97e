"""What the executor said about itself: its latest ``welcome``, which callers wait for on first contact.

The client's loop sets it (after every restart of the executor, too); any thread reads it. A hostile or
broken executor cannot make the client's bounds infinite through it: timeouts outside the wire's
range count as not given, and its apply grace is capped at ``MAX_APPLY_GRACE``.
"""

from __future__ import annotations

import threading

from controller.client.link import DEFAULT_TIMEOUT, MAX_APPLY_GRACE, valid_timeout
from protocol import ToolSpec, Welcome


class Introduction:
    """The executor's latest welcome, or why the last one could not be used."""

    def __init__(self) -> None:
        self.welcome: Welcome | None = None
        self.problem = ""  # why the last welcome could not be decoded
        self._event = threading.Event()

    def accept(self, welcome: Welcome) -> None:
        self.welcome = welcome
        self._event.set()

    def wait(self, timeout: float) -> Welcome | None:
        """The welcome, once the executor gave one (None if it did not within ``timeout`` seconds)."""
        return self.welcome if self._event.wait(timeout) else None

    def spec(self, tool: str) -> ToolSpec | None:
        welcome = self.welcome
        return next((s for s in welcome.tools if s.name == tool), None) if welcome is not None else None

    def idempotent(self, tool: str) -> bool:
        spec = self.spec(tool)
        return spec is not None and spec.idempotent

    def apply_grace(self) -> float:
        """How much longer than its deadline a call may take because the executor applies its
        workspace writes after it answered (its welcome's ``apply_grace_s``, hardened
        ``--workspace-rw``): a cancel then would throw away the writes of a call that answered in
        time. At most ``MAX_APPLY_GRACE``, whatever an executor says."""
        welcome = self.welcome
        return min(welcome.apply_grace_s, MAX_APPLY_GRACE) if welcome is not None else 0.0

    def tool_timeout(self, tool: str) -> float:
        """The timeout the executor applies to a call that gives none: the tool's, else the
        executor's default; a value a (hostile or broken) executor sends outside (0, MAX_TIMEOUT_S]
        counts as not given, so the client's bound stays finite and sane."""
        welcome = self.welcome
        if welcome is None:
            return DEFAULT_TIMEOUT
        spec = self.spec(tool)
        if spec is not None and spec.timeout and valid_timeout(spec.timeout):
            return spec.timeout
        timeout = welcome.limits.timeout_s
        return timeout if valid_timeout(timeout) else DEFAULT_TIMEOUT
