"""The executor's side facing clients, in a pool: a link to a broker (``serve --connect BACKEND``).

The second implementation of ``executor.endpoint.ClientSide``: instead of binding a ROUTER for
clients, the executor connects a DEALER to a broker's backend and serves the calls the broker routes
to it. The supervisor cannot tell the difference, except that the link needs ``tick`` for its timers.

The link is the Paranoid Pirate worker of the ZeroMQ guide, with the timing of ``protocol.timing``:
on every (re)connection it announces itself with ``ready`` (tools, limits, capacity, and the ids of
the calls it holds, so that a restarted broker routes a resent call back here, where the call table
answers it from its cache or joins the running call); it sends a heartbeat every
``HEARTBEAT_INTERVAL``; when the broker has been silent for ``PEER_EXPIRY`` it drops the connection
and connects again after a backoff that doubles per unanswered attempt. A broker that does not know
this executor (it restarted) answers ``bye``, and the link announces itself again at once; a broker
that *refuses* it (another executor serves a tool of the same name differently) makes the executor
stop with the broker's reason.

The link reads at most ``RECV_HWM`` messages ahead and hands ZeroMQ at most ``SEND_HWM`` (the rest
wait in its bounded outbox), as the bound endpoint does, so a hostile broker cannot make the
executor buffer much.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from executor.endpoint import (
    OUTBOX_BYTES,
    OUTBOX_RETRY,
    RECV_BATCH,
    RECV_BUDGET_S,
    RECV_HWM,
    SEND_HWM,
    SHUTDOWN_LINGER_MS,
    EndpointError,
    Incoming,
)
from protocol import Bye, Heartbeat, ProtocolError, Ready, decode, encode
from protocol.timing import HEARTBEAT_INTERVAL, PEER_EXPIRY, backoff
from protocol.wire import bound_socket, recv_message

log = logging.getLogger("ciayn-executor")

BROKER = b"broker"  # the one route a linked executor answers on


class BrokerLink:
    """A DEALER connected to a broker's backend; reconnects and re-announces by itself."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, announce: Callable[[], Ready],
                 curve_server_key: bytes | None = None, curve_keys: tuple[bytes, bytes] | None = None,
                 insecure: bool = False) -> None:
        if not insecure:  # (the executor has checked, and warned, before it started)
            self.check_endpoint(endpoint, curve=curve_server_key is not None, insecure=False)
        self.endpoint = endpoint
        self.announce = announce
        self.curve = curve_server_key is not None
        self.failed = ""  # set when the broker refused us: the executor stops, saying this
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        bound_socket(sock)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)  # what a broker sends faster than we read waits on its side
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)  # beyond, our answers wait in the outbox, counted in bytes
        if curve_server_key is not None:
            from protocol.curve import secure_client

            secure_client(sock, curve_server_key, curve_keys)
        self.socket = sock
        self.outbox: collections.deque[list[bytes]] = collections.deque()
        self.outbox_bytes = 0
        self.attempt = 0  # reconnections since the broker last answered
        self.reconnect_at = 0.0  # while disconnected: when to connect again
        self.next_heartbeat = 0.0
        self.last_heard = self.announced = time.monotonic()
        self.executor = ""
        try:
            self._connect()
        except BaseException:
            sock.close(0)
            raise

    @staticmethod
    def check_endpoint(endpoint: str, *, curve: bool, insecure: bool) -> None:
        """Refuse a tcp broker without CurveZMQ unless ``insecure`` (then warn)."""
        if endpoint.startswith("tcp://") and not curve:
            problem = (f"the broker at {endpoint} without CurveZMQ: anyone who can reach that address (on loopback: "
                       "any local user) can pose as the broker and send this executor calls, or read them")
            if not insecure:
                raise EndpointError(f"refusing to connect to {problem}; use --curve-server-key (and "
                                    "--curve-secret), or pass --insecure")
            log.warning("connecting insecurely (--insecure) to %s", problem)

    def describe(self) -> str:
        return f"broker {self.endpoint} (curve: {'on' if self.curve else 'off'})"

    def _connect(self) -> None:
        try:
            self.socket.connect(self.endpoint)
        except zmq.ZMQError as e:
            raise EndpointError(f"cannot connect to the broker at {self.endpoint}: {e}") from None
        self.reconnect_at = 0.0
        self._announce(time.monotonic())

    def _announce(self, now: float) -> None:
        ready = self.announce()
        self.executor = ready.executor
        self.announced = now
        self.send(BROKER, encode(ready))

    def receive(self) -> Iterator[Incoming]:
        """Messages waiting now, at most ``RECV_BATCH`` or ``RECV_BUDGET_S`` of them (as the bound
        endpoint): a broker flooding costly bodies cannot keep the loop from its workers and deadlines."""
        until = time.monotonic() + RECV_BUDGET_S
        for _ in range(RECV_BATCH):
            if time.monotonic() > until:
                return
            frames = recv_message(self.socket)
            if frames is None:
                return
            now = time.monotonic()
            self.last_heard = now
            self.attempt = 0
            try:
                msg = decode(frames)
            except ProtocolError as e:
                yield BROKER, e  # a malformed call is still answered, with its id when readable
                continue
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Bye):
                if msg.refused:
                    self.failed = f"the broker at {self.endpoint} refused this executor: {msg.reason}"
                    log.error("%s", self.failed)
                elif now - self.announced > HEARTBEAT_INTERVAL / 2:  # not for each stale heartbeat it saw
                    log.info("the broker asks this executor to announce itself again (%s)", msg.reason)
                    self._announce(now)
                continue
            yield BROKER, msg

    def send(self, route: bytes, frames: list[bytes]) -> None:
        """Frames to the broker. While the connection's pipe is full they wait in a bounded outbox (no
        answer is dropped by a high-water mark); while disconnected they are dropped: a result then
        waits in the call table's cache for the client to resend its id through the next broker."""
        if self.reconnect_at:
            return
        if not self.outbox:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            except zmq.ZMQError:
                return
        self.outbox.append(frames)
        self.outbox_bytes += sum(len(f) for f in frames)
        if self.outbox_bytes > OUTBOX_BYTES:
            log.warning("the broker at %s does not read what this executor sends: dropped %d held messages; "
                        "results stay in the result cache for a resend", self.endpoint, len(self.outbox))
            self._clear_outbox()

    def _flush(self) -> None:
        while self.outbox:
            try:
                self.socket.send_multipart(self.outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                self._clear_outbox()
                return
            self.outbox_bytes -= sum(len(f) for f in self.outbox.popleft())

    def _clear_outbox(self) -> None:
        self.outbox.clear()
        self.outbox_bytes = 0

    def tick(self, now: float) -> float:
        """Heartbeats, the broker's liveness, reconnection. Returns seconds until it is next due."""
        if self.reconnect_at:
            if now < self.reconnect_at:
                return self.reconnect_at - now
            self.last_heard = now  # give this attempt a full PEER_EXPIRY
            self._connect()
        if now - self.last_heard > PEER_EXPIRY:
            wait = backoff(self.attempt)
            log.warning("the broker at %s has been silent for %.1f s; reconnecting in %.2f s", self.endpoint,
                        now - self.last_heard, wait)
            self.attempt += 1
            with contextlib.suppress(zmq.ZMQError):
                self.socket.disconnect(self.endpoint)  # drops what is queued for the dead connection
            self._clear_outbox()
            self.reconnect_at = now + wait
            return wait
        self._flush()
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL
            if not self.outbox:  # a full pipe is sign enough of life
                self.send(BROKER, encode(Heartbeat(executor=self.executor)))
        due = min(self.next_heartbeat, self.last_heard + PEER_EXPIRY) - now
        return max(0.0, min(due, OUTBOX_RETRY) if self.outbox else due)

    def close(self) -> None:
        if not self.reconnect_at:
            self.send(BROKER, encode(Bye(executor=self.executor, reason="shutting down")))
        self.socket.close(linger=SHUTDOWN_LINGER_MS)

