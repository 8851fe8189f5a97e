"""How calls reach the supervisor: the one small interface both sides facing clients implement.

An executor either binds a ROUTER that clients connect to (``executor.clientside.router``) or, in a
pool, connects to a broker (``executor.clientside.brokerlink``). Both look the same to the
supervisor (``ClientSide``): a socket to poll, messages in as ``(route, message)`` pairs, frames out
to a route, and ``tick`` for timers. Nothing here knows about workers or the call table. The
constants below bound what either side reads ahead and holds for a peer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import zmq

from protocol import Message, ProtocolError
from protocol.errors import CiaynError

SHUTDOWN_LINGER_MS = 500
RECV_BATCH = 1000  # messages taken per wake-up, so deadlines and workers are served in between...
RECV_BUDGET_S = 0.02  # ...and seconds spent taking them (a decode costs up to tens of milliseconds)
SEND_HWM = 64  # messages libzmq queues for one client; beyond, answers wait in its outbox (counted in bytes)
RECV_HWM = 4  # messages libzmq reads ahead from one connection (each up to 128 MiB); the rest wait in the peer
OUTBOX_BYTES = 256 * 1024 * 1024  # answers held for one client (its outbox and ZeroMQ's pipe to it), at most
OUTBOX_RETRY = 0.01  # seconds between attempts to send held answers
MAX_KNOWN_CONNECTIONS = 65536  # clients whose connection (or key, or drop) is remembered, oldest forgotten first


class EndpointError(CiaynError):
    """The endpoint cannot be opened (in use, bad address, bad keys)."""


Incoming = tuple[bytes, Message | ProtocolError]


class ClientSide(Protocol):
    """What the supervisor needs from the side that faces clients."""

    socket: zmq.Socket[bytes]
    failed: str  # set when this side cannot go on: the executor stops (a broker's refusal is not that: it retries)

    def receive(self) -> Iterator[Incoming]:
        """Messages waiting now, each with the route to answer on; a malformed one comes as the
        ``ProtocolError`` that already knows its reply."""
        ...

    def send(self, route: bytes, frames: list[bytes]) -> None: ...

    def describe(self) -> str: ...

    def start(self) -> None:
        """The tools are known: begin (a link announces itself to its broker now, not at connection)."""
        ...

    def tick(self, now: float) -> float:
        """Timers of this side (a link's heartbeats and reconnection); seconds until it is next due."""
        ...

    def close(self) -> None: ...
