"""The executor client: thread-safe, one loop owns the DEALER socket, every call gets an answer.

Callers submit calls from any thread and get ``Future[Result]`` (``call`` runs the loop itself
while no other thread does). The loop sends them, pings
the executor every ``HEARTBEAT_INTERVAL`` whether or not calls are in flight, and follows the Lazy
Pirate pattern when the executor falls silent: it reconnects with a fresh socket under the same
routing id (so the executor's answers to calls sent before still reach it) and, once the executor
answers again as the same incarnation, resends the calls in flight under their same ids (the
executor never runs an id twice). After ``UNAVAILABLE_AFTER`` seconds of silence every call in
flight is cancelled and answered ``unavailable`` (``FIRST_CONTACT_WAIT`` before the executor's first
word: one that is loading its tools answers nothing yet). A call's deadline is a bound: it is answered by its
timeout plus ``DEADLINE_GRACE`` at the latest (``timeout``, and cancelled on the executor), whatever
the executor reports meanwhile. When the executor restarts (a new incarnation), calls that were in
flight may or may not have run: idempotent tools are resent, others are answered ``unavailable``
saying so. A call that cannot be sent (not encodable, over the size or element budget, an invalid id
or timeout) is answered at once without being sent. Nothing the executor sends can make the client
wait longer than asked or hold more than one bounded message at a time. The client never raises
on executor trouble, except ``tools()``, which has no result to carry the error and raises
``ExecutorUnavailable``.

The modules, each with one job: ``executorclient`` (the public API), ``connection`` (the loop, its I/O
thread and its socket), ``link`` (every timing constant, and the Lazy Pirate machine that says when to ping,
reconnect, resend and give up), ``inflight`` (the table of calls in flight, each answered once),
``welcome`` (what the executor said about itself). The names below are the package's API; the timing
constants are those ``protocol/SPEC.md`` states.
"""

from controller.client.executorclient import ExecutorClient, ExecutorUnavailable
from controller.client.link import (
    DEADLINE_GRACE,
    FIRST_CONTACT_WAIT,
    HEARTBEAT_INTERVAL,
    SILENCE_BEFORE_RECONNECT,
    UNAVAILABLE_AFTER,
)

__all__ = [
    "DEADLINE_GRACE",
    "FIRST_CONTACT_WAIT",
    "HEARTBEAT_INTERVAL",
    "SILENCE_BEFORE_RECONNECT",
    "UNAVAILABLE_AFTER",
    "ExecutorClient",
    "ExecutorUnavailable",
]
