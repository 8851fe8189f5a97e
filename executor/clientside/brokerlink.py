"""The executor's side facing clients, in a pool: a link to a broker (``serve --connect BACKEND``),
the second ``executor.clientside.base.ClientSide``. ``BrokerLink`` connects a DEALER to the broker's
backend and serves the calls routed to it: it announces itself (``ready``) on every (re)connection,
heartbeats, reconnects with backoff after ``PEER_EXPIRY`` of silence, and names the call it is
``applying``, with the timing of ``protocol.timing``. A broker's refusal never makes it stop: it
announces itself again, backing off. It reads at most ``RECV_HWM`` ahead and holds a bounded outbox,
so a hostile broker cannot make the executor buffer much.
Why and how: docs/executor.md#the-side-facing-a-broker.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import zmq

from executor.clientside.base import (
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
from protocol import Bye, Heartbeat, Message, ProtocolError, Ready, decode, encode
from protocol.messages import MAX_CAPACITY
from protocol.timing import (
    HEARTBEAT_INTERVAL,
    PEER_EXPIRY,
    REFUSED_RETRY_INITIAL,
    REFUSED_RETRY_MAX,
    backoff,
)
from protocol.wire import LogBudget, bound_socket, recv_message

log = logging.getLogger("ciayn-executor")

BROKER = b"broker"  # the one route a linked executor answers on


class BrokerLink:
    """A DEALER connected to a broker's backend; reconnects and re-announces by itself."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, announce: Callable[[], Ready],
                 applying: Callable[[], Collection[str]] | None = None, curve_server_key: bytes | None = None,
                 curve_keys: tuple[bytes, bytes] | None = None, insecure: bool = False) -> None:
        """``announce`` builds the ``ready`` sent on every (re)connection; ``applying`` (optional) names
        the calls whose workspace writes are being applied now."""
        self.check_endpoint(endpoint, curve=curve_server_key is not None, insecure=insecure)
        self.endpoint = endpoint
        self.announce = announce
        self.applying = applying
        self.told_applying: frozenset[str] = frozenset()  # what the last heartbeat said
        self.curve = curve_server_key is not None
        self.failed = ""  # never set by a link: a refusal is retried (ClientSide's contract allows it)
        self.refusals = 0  # refusals since the broker last took this executor in
        self.retry_at = 0.0  # while refused: when to announce again
        self.refusal_log = LogBudget(log, "refusals by the broker")
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
        self.started = False  # it announces itself only once ``start`` says the tools are known
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
        if self.started:
            self._announce(time.monotonic())

    def start(self) -> None:
        self.started = True
        self.last_heard = now = time.monotonic()  # a full PEER_EXPIRY for the broker to answer
        self._announce(now)

    def _announce(self, now: float) -> None:
        ready = self.announce()
        self.executor = ready.executor
        self.announced = now
        self.send(BROKER, encode(ready))

    def receive(self) -> Iterator[Incoming]:
        """Messages waiting now, at most ``RECV_BATCH`` of them or ``RECV_BUDGET_S`` of receiving and
        decoding (as the bound endpoint, whose ``receive`` says why only this generator's own time
        counts): a broker flooding costly bodies cannot keep the loop from its workers and deadlines."""
        spent = 0.0
        for _ in range(RECV_BATCH):
            if spent > RECV_BUDGET_S:
                return
            started = time.monotonic()
            frames = recv_message(self.socket)
            if frames is None:
                return
            self.last_heard = started
            self.attempt = 0
            try:
                msg: Message | ProtocolError = decode(frames)
            except ProtocolError as e:
                msg = e  # a malformed call is still answered, with its id when readable
            spent += time.monotonic() - started
            if isinstance(msg, Heartbeat):
                if not self.retry_at:
                    self.refusals = 0  # a broker heartbeats its members only: it took us in
                continue
            if isinstance(msg, Bye):
                if msg.refused:
                    self._refused(started, msg.reason)
                elif self.retry_at:
                    pass  # refused: we announce again when the wait is over, not sooner
                elif started - self.announced > HEARTBEAT_INTERVAL / 2:  # not for each stale heartbeat it saw
                    log.info("the broker asks this executor to announce itself again (%s)", _printable(msg.reason))
                    self._announce(started)
                continue
            yield BROKER, msg

    def _refused(self, now: float, reason: str) -> None:
        """The broker will not take us in now: wait, then announce again (never stop for it)."""
        if self.retry_at:
            return  # already waiting: a second refusal (a stale or a hostile one) changes nothing
        wait = backoff(self.refusals, REFUSED_RETRY_INITIAL, REFUSED_RETRY_MAX)
        self.refusals += 1
        self.retry_at = now + wait
        self.refusal_log.warning("the broker at %s refused this executor (refusal %d): %s; it announces itself "
                                 "again in %.0f s and joins once that conflict is gone", self.endpoint,
                                 self.refusals, _printable(reason), wait)

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
        """Heartbeats, the broker's liveness, reconnection, announcing again after a refusal. Returns
        seconds until it is next due."""
        self.refusal_log.flush(now)
        if self.reconnect_at:
            if now < self.reconnect_at:
                return self.reconnect_at - now
            self.last_heard = now  # give this attempt a full PEER_EXPIRY
            self._connect()
        if self.retry_at:
            if now < self.retry_at:  # refused: quiet (the broker does not heartbeat us either)
                self._flush()
                return min(self.retry_at - now, OUTBOX_RETRY) if self.outbox else self.retry_at - now
            self.retry_at = 0.0
            self.last_heard = now  # a full PEER_EXPIRY for the broker to answer
            self._announce(now)
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
        applying = frozenset(self.applying()) if self.applying is not None else frozenset()
        news = not applying <= self.told_applying  # a call started applying: tell the broker now
        if now >= self.next_heartbeat or news:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL
            if not self.outbox or news:  # a full pipe is sign enough of life
                self.told_applying = applying
                self.send(BROKER, encode(Heartbeat(executor=self.executor, applying=sorted(applying)[:MAX_CAPACITY])))
        due = min(self.next_heartbeat, self.last_heard + PEER_EXPIRY) - now
        return max(0.0, min(due, OUTBOX_RETRY) if self.outbox else due)

    def close(self) -> None:
        if self.started and not self.reconnect_at:
            self.send(BROKER, encode(Bye(executor=self.executor, reason="shutting down")))
        self.socket.close(linger=SHUTDOWN_LINGER_MS)


def _printable(text: str) -> str:
    """``text`` (from the broker, naming other executors) with control characters escaped: it cannot
    forge a line of our log."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
