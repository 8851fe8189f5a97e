"""Timing that both ends of a pool link must agree on: a broker and the executors connected to it.

Kept in one place, as the ZeroMQ guide's Paranoid Pirate and Majordomo examples keep theirs, so that
a broker and an executor built from the same release never disagree about when the other is dead.
The client's own retry timing (Lazy Pirate) lives with the client: it talks to a broker exactly as to
one executor.

The link (see ``protocol/SPEC.md``, "Pool"):

- Each side sends a ``heartbeat`` every ``HEARTBEAT_INTERVAL`` seconds, whatever else it sends.
- Any message from the peer counts as a sign of life. A peer silent for
  ``HEARTBEAT_LIVENESS * HEARTBEAT_INTERVAL`` seconds (``PEER_EXPIRY``) is dead: the broker drops the
  executor (answering its calls in flight), the executor drops its connection and reconnects.
- An executor that finds the broker dead drops its connection and connects again after
  ``RECONNECT_INITIAL`` seconds, doubling the wait after each attempt that brings no answer within
  ``PEER_EXPIRY``, up to ``RECONNECT_MAX``; an answer resets it. Every (re)connection starts with a
  ``ready`` announcement; a broker that hears from an executor it does not know answers ``bye`` and
  the executor announces itself again at once.
- A broker that has just started waits ``RECOVERY_WINDOW`` seconds before it sends a call to an
  executor that has not announced holding it: executors of its previous run re-announce within that
  time (at worst one backoff wait plus a heartbeat), together with the ids of the calls they hold, so
  a call a client resends after a broker restart goes back to the executor that has it, and runs at
  most once. Meanwhile it answers no client's ping, so that clients with calls in flight reconnect and
  resend them: the window must be longer than a client's silence threshold (2 s in the Python client,
  ``SILENCE_BEFORE_RECONNECT``) plus a heartbeat, and shorter than the silence after which it gives
  calls up (6 s, ``UNAVAILABLE_AFTER``).
- ``HELD_RECENT`` bounds how many ids of recently answered calls a ``ready`` carries.
- A broker answers a call it sent an executor itself (``timeout``, may have run) when no result came
  within the call's timeout plus ``RESULT_GRACE`` (plus, once, the broker's own apply grace, by
  default ``APPLY_GRACE`` as the executor's, for a call the executor says it is applying): an
  executor answers within that, or is taken to be lying.
- A member's identity is its connection: when another connection announces the id of a member heard
  from lately, the broker asks that member to announce itself again, and lets the newcomer take the
  id only if the member neither does so nor says anything for ``CLAIM_WINDOW`` (its connection is
  gone: an executor that reconnected). Otherwise the newcomer is refused.
- A refused executor (a tool another executor serves differently, an id a live member holds) does
  not stop: it announces itself again after ``REFUSED_RETRY_INITIAL`` seconds, doubling up to
  ``REFUSED_RETRY_MAX``, and joins once the conflict is gone.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL = 0.5  # seconds between heartbeats, each way
HEARTBEAT_LIVENESS = 4  # heartbeats a peer may miss before it is taken for dead
PEER_EXPIRY = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS  # seconds of silence that mean dead
RECONNECT_INITIAL = 0.1  # first wait before an executor reconnects to a silent broker
RECONNECT_MAX = 2.0  # the wait doubles per unanswered attempt, up to this
RECOVERY_WINDOW = RECONNECT_MAX + 2 * HEARTBEAT_INTERVAL  # a fresh broker's wait for executors to re-announce
HELD_RECENT = 1024  # ids of recently answered calls announced in a `ready`
RESULT_GRACE = 2.0  # past a call's timeout, the broker stops waiting for the executor's answer
APPLY_GRACE = 60.0  # what a call applying its workspace writes gets past that (executor.pool.APPLY_GRACE)
CLAIM_WINDOW = PEER_EXPIRY  # a member's silence that lets another connection take its id (no sooner than
# the broker would drop it for that silence anyway: a claim never displaces a member liveness would keep)
REFUSED_RETRY_INITIAL = 1.0  # a refused executor announces itself again after this...
REFUSED_RETRY_MAX = 10.0  # ...doubling per refusal, up to this


def backoff(attempt: int, initial: float = RECONNECT_INITIAL, cap: float = RECONNECT_MAX) -> float:
    """Seconds to wait before reconnection attempt number ``attempt`` (0 for the first); with
    ``REFUSED_RETRY_INITIAL`` and ``REFUSED_RETRY_MAX``, before announcing again after a refusal."""
    return float(min(cap, initial * 2 ** min(attempt, 32)))
