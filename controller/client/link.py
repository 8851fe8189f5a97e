"""The client's link to its executor: every timing constant of the client, and the Lazy Pirate machine.

The machine (``protocol/SPEC.md``, "Heartbeats and reconnection") knows only time and what was heard;
the client's loop (``connection.py``) acts on what it says. A ``ping`` goes every ``HEARTBEAT_INTERVAL``;
after ``SILENCE_BEFORE_RECONNECT`` of silence the link is ``RECONNECTED``: a fresh socket, and the
calls in flight go again under their same ids once the same incarnation answers (it never runs an id
twice), at most one reconnect per that much time. After ``UNAVAILABLE_AFTER`` of silence calls in flight
are given up, ``FIRST_CONTACT_WAIT`` while the link is at ``FIRST_CONTACT`` (nothing heard yet: an
executor loading its tools answers nothing). A new incarnation means the executor restarted: the link
asks for its welcome again, at most one ``hello`` a beat.
"""

from __future__ import annotations

import enum
import math

from protocol.messages import MAX_TIMEOUT_S

HEARTBEAT_INTERVAL = 0.5  # seconds between pings
SILENCE_BEFORE_RECONNECT = 2.0  # no message for this long: new socket, resend calls in flight
UNAVAILABLE_AFTER = 6.0  # no message for this long: calls in flight are answered `unavailable`
FIRST_CONTACT_WAIT = 65.0  # the same, before the executor's first word: it may be loading its tools (60 s)
DEADLINE_GRACE = 2.0  # added to a call's timeout before the client answers `timeout` itself
MAX_APPLY_GRACE = 120.0  # the most an executor's welcome can add to that (its apply_grace_s)
DEFAULT_TIMEOUT = 30.0  # a call's timeout when neither the call, the tool nor the executor says (validly)
RECV_BUDGET_S = 0.02  # seconds spent taking messages per turn of the I/O loop
RECV_HWM = 4  # messages ZeroMQ takes off the connection ahead of the loop (each up to 128 MiB)


def valid_timeout(timeout: object) -> bool:
    """Whether ``timeout`` is a call timeout the wire allows: seconds in (0, ``MAX_TIMEOUT_S``]."""
    return isinstance(timeout, int | float) and not isinstance(timeout, bool) and math.isfinite(timeout) \
        and 0 < timeout <= MAX_TIMEOUT_S


class LinkState(enum.Enum):
    """Where the link is. Whether the executor was ever heard from (``Link.heard_once``) is apart: a
    link can reconnect before the executor's first word, and the first word may come before a
    reconnect's resend is due."""

    FIRST_CONTACT = "first contact"  # the first socket, nothing heard on it yet
    CONNECTED = "connected"  # the executor has spoken; calls in flight are where they were sent
    RECONNECTED = "reconnected"  # a fresh socket after silence: calls in flight go again once it says who it is


class Step(enum.Enum):
    """What the link asks the loop to do in one turn (``Link.tick``), in this order."""

    HELLO = "ask the restarted executor for its welcome"
    PING = "send a ping"
    RECONNECT = "open a fresh socket under the same routing id, then say hello"
    GIVE_UP = "answer every call in flight `unavailable`"


class Meeting(enum.Enum):
    """What an incarnation the executor reports means for the calls in flight (``Link.meet``)."""

    SAME = "the executor known so far: nothing to do"
    RESEND = "the executor known so far, after a reconnect: resend every call in flight under its id"
    RESTARTED = "a new incarnation: calls sent to the old one may or may not have run"


class Link:
    """The Lazy Pirate state of one client; used by the loop only, but ``answering``."""

    def __init__(self, endpoint: str, now: float) -> None:
        self.endpoint = endpoint
        self.state = LinkState.FIRST_CONTACT
        self.heard_once = False  # anything from the executor yet (before, it may be loading its tools)
        self.last_heard = now
        self.alive = False  # heard from on the current socket
        self.incarnation: int | None = None
        self.welcome_due = False  # the executor restarted: ask for its tools again (one hello at a time)
        self.last_hello = -math.inf
        self.next_ping = 0.0
        self.last_reconnect = now

    def answering(self, now: float) -> bool:
        """Whether the executor answered within the last few heartbeats (read from any thread)."""
        return self.alive and now - self.last_heard < SILENCE_BEFORE_RECONNECT

    def heard(self, now: float) -> None:
        """Any message from the executor, readable or not, is a sign of life."""
        self.last_heard = now
        self.alive = self.heard_once = True
        if self.state is LinkState.FIRST_CONTACT:
            self.state = LinkState.CONNECTED

    def unavailable_after(self) -> float:
        """Silence after which calls in flight are given up: an executor never heard from may still
        be loading its tools (SPEC.md section 1, start-up), so it gets that long first."""
        return UNAVAILABLE_AFTER if self.heard_once else FIRST_CONTACT_WAIT

    def silence(self, now: float) -> str:
        """Why calls are given up, for the caller."""
        seconds = now - self.last_heard
        if self.heard_once:
            return f"the executor at {self.endpoint} has not answered for {seconds:.0f} s"
        return (f"nothing has answered at {self.endpoint} in {seconds:.0f} s (no executor there, or one that "
                "could not load its tools)")

    def deadline(self, now: float, timeout: float) -> float:
        """When the client answers a call sent now ``timeout`` itself; sooner if the executor is known
        dead: the caller need not wait a full timeout for that."""
        deadline = now + timeout + DEADLINE_GRACE
        if now - self.last_heard > self.unavailable_after():
            deadline = min(deadline, now + SILENCE_BEFORE_RECONNECT + 0.5)
        return deadline

    def tick(self, now: float, in_flight: bool) -> list[Step]:
        """The steps due now; a ``RECONNECT`` is taken to be done (``reconnected``) or refused."""
        steps = []
        if self.welcome_due and now - self.last_hello >= HEARTBEAT_INTERVAL:
            self.last_hello = now  # an executor announcing a new incarnation per pong gets one a beat
            steps.append(Step.HELLO)
        if now >= self.next_ping:
            self.next_ping = now + HEARTBEAT_INTERVAL
            steps.append(Step.PING)
        silence = now - self.last_heard
        if silence > SILENCE_BEFORE_RECONNECT and now - self.last_reconnect > SILENCE_BEFORE_RECONNECT:
            self.last_reconnect = now
            steps.append(Step.RECONNECT)
        if silence > self.unavailable_after() and in_flight:
            steps.append(Step.GIVE_UP)
        return steps

    def reconnected(self) -> None:
        """A fresh socket is open: the same calls go again under the same ids once the same executor
        answers (``meet``); a new one behind the endpoint must not get calls the old one may have run."""
        self.alive = False
        self.state = LinkState.RECONNECTED

    def meet(self, incarnation: int) -> Meeting:
        """The executor says which incarnation it is (every ``pong`` and ``welcome``)."""
        if self.incarnation is None:
            self.incarnation = incarnation
        resend = self.state is LinkState.RECONNECTED
        self.state = LinkState.CONNECTED
        if incarnation == self.incarnation:
            return Meeting.RESEND if resend else Meeting.SAME
        self.incarnation = incarnation
        self.welcome_due = True  # refresh the tool specs
        return Meeting.RESTARTED
