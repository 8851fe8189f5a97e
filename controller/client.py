"""The executor client: thread-safe, one I/O thread owns the DEALER socket, every call gets an answer.

Callers submit calls from any thread and get ``Future[Result]``. The I/O thread sends them, pings
the executor every ``HEARTBEAT_INTERVAL`` whether or not calls are in flight, and follows the Lazy
Pirate pattern when the executor falls silent: it reconnects with a fresh socket and, once the
executor answers again as the same incarnation, resends the calls in flight under their same ids
(the executor answers duplicates from its cache and never runs a call twice); after
``UNAVAILABLE_AFTER`` seconds of silence every call in flight is answered ``unavailable``. A call
with no answer by its deadline plus ``DEADLINE_GRACE`` is answered ``timeout`` by the client (and
cancelled on the executor). When the executor restarts (a new incarnation), calls that were in
flight may or may not have run: idempotent tools are resent, others are answered ``unavailable``
saying so. A call that cannot be encoded is answered ``protocol`` at once. The client never raises
on executor trouble, except ``tools()``, which has no result to carry the error and raises
``ExecutorUnavailable``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from protocol import (
    MAX_FRAME_BYTES,
    Call,
    CallRejected,
    Cancel,
    Hello,
    Ping,
    Pong,
    ProtocolError,
    Result,
    ToolSpec,
    Welcome,
    decode,
    encode,
    parse_call,
)

log = logging.getLogger("ciayn.client")

HEARTBEAT_INTERVAL = 0.5  # seconds between pings
SILENCE_BEFORE_RECONNECT = 2.0  # no message for this long: new socket, resend calls in flight
UNAVAILABLE_AFTER = 6.0  # no message for this long: calls in flight are answered `unavailable`
DEADLINE_GRACE = 2.0  # added to a call's timeout before the client answers `timeout` itself
DEFAULT_TIMEOUT = 30.0  # a call's timeout when neither the call, the tool nor the executor says


class ExecutorUnavailable(Exception):
    """No executor answered in time (only ``tools()`` raises it; calls get a result instead)."""


@dataclass
class _Pending:
    call: Call
    future: Future[Result]
    deadline: float
    sent_incarnation: int | None


class ExecutorClient:
    """Client of one executor or broker endpoint. Thread-safe; a context manager."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float | None = None,
        curve_server_key: bytes | None = None,
        curve_keys: tuple[bytes, bytes] | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        if timeout is not None and not (0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.endpoint = endpoint
        self.default_timeout = timeout  # None: the executor's (or the tool's) own default
        self.connect_timeout = connect_timeout
        self._curve_server_key = curve_server_key
        self._curve_keys = curve_keys
        self._ctx = zmq.Context()
        try:  # an endpoint or key zmq refuses is the caller's error: say so here, not in the I/O thread
            self._new_socket().close(0)
        except (zmq.ZMQError, ValueError, TypeError) as e:
            self._ctx.term()
            raise ValueError(f"cannot use executor endpoint {endpoint!r}: {e}") from None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._welcome: Welcome | None = None
        self._welcome_event = threading.Event()
        self._incarnation: int | None = None
        self._resend_due = False  # reconnected: resend calls in flight once the executor is known
        self._last_heard = time.monotonic()
        self._alive = False
        self._closed = False
        self._failed = ""
        self._thread = threading.Thread(target=self._run, name="ciayn-client-io", daemon=True)
        self._thread.start()
        self._post("hello", None)

    # ---------------------------------------------------------------- public API

    def tools(self, timeout: float | None = None) -> list[ToolSpec]:
        """The executor's tool specs (from its ``welcome``; refreshed after a restart)."""
        if not self._welcome_event.wait(self.connect_timeout if timeout is None else timeout):
            hint = "is `ciayn-executor serve` running there?"
            if self.endpoint.startswith("tcp://"):
                hint += (" An executor using CurveZMQ also stays silent when the keys do not match: check"
                         " the server key, and that this client's public key is in its --curve-clients dir.")
            raise ExecutorUnavailable(
                f"no executor answered at {self.endpoint} within {self.connect_timeout:g} s; {hint}"
            )
        assert self._welcome is not None
        return list(self._welcome.tools)

    @property
    def welcome(self) -> Welcome | None:
        return self._welcome

    @property
    def alive(self) -> bool:
        """Whether the executor answered within the last few heartbeats."""
        return self._alive and time.monotonic() - self._last_heard < SILENCE_BEFORE_RECONNECT

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]:
        """Send a call; the future always resolves to a Result (never an exception)."""
        future: Future[Result] = Future()
        call = call.model_copy(update={"id": call.id or uuid.uuid4().hex})
        if timeout is not None:
            call.timeout = timeout
        elif call.timeout is None and self.default_timeout is not None:
            call.timeout = self.default_timeout
        if self._closed:
            future.set_result(Result.failure(call.id or "", "unavailable", "the client is closed"))
            return future
        self._post("call", (call, future))
        return future

    def call(self, call: Call, timeout: float | None = None) -> Result:
        """Run a call and wait for its result."""
        return self.submit(call, timeout).result()

    def call_text(self, text: str, timeout: float | None = None) -> Result:
        """Parse one line of call text against the executor's tools and run it. A rejected text
        gives a ``rejected`` (or ``unknown_tool``/``bad_arguments``) result, nothing is sent."""
        try:
            specs = {s.name: s for s in self.tools()}
        except ExecutorUnavailable as e:
            return Result.failure("", "unavailable", str(e))
        try:
            call = parse_call(text, specs)
        except CallRejected as e:
            kind = e.code if e.code in ("unknown_tool", "bad_arguments") else "rejected"
            return Result.failure("", kind, str(e))  # type: ignore[arg-type]
        return self.call(call, timeout)

    def cancel(self, call_id: str) -> None:
        self._post("cancel", call_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._post("close", None)
        self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ctx.term()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- I/O thread

    def _post(self, op: str, arg: Any) -> None:
        self._inbox.put((op, arg))
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _new_socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
            if self._curve_server_key is not None:
                public, secret = self._curve_keys or zmq.curve_keypair()
                sock.curve_serverkey = self._curve_server_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            sock.connect(self.endpoint)
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a bug here must not leave callers waiting forever
            log.exception("the executor client's I/O thread failed")
            self._failed = f"the executor client failed: {type(e).__name__}: {e}"
        finally:
            self._closed = True
            while True:  # calls submitted while the loop was ending
                try:
                    op, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if op == "call":
                    call, future = arg
                    if not future.done():
                        future.set_result(Result.failure(call.id or "", "unavailable",
                                                         self._failed or "the client is closed"))

    def _loop(self) -> None:
        sock = self._new_socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        pending: dict[str, _Pending] = {}
        next_ping = 0.0
        last_reconnect = time.monotonic()
        self._last_heard = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                wait = next_ping - now
                for p in pending.values():
                    wait = min(wait, p.deadline - now)
                events = dict(poller.poll(max(0, int(wait * 1000) + 1)))
                now = time.monotonic()
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if not self._drain_inbox(sock, pending, now):
                    break
                if sock in events:
                    self._receive(sock, pending)
                if now >= next_ping:
                    self._send(sock, Ping(nonce=int(now * 1000)))
                    next_ping = now + HEARTBEAT_INTERVAL
                silence = now - self._last_heard
                if silence > SILENCE_BEFORE_RECONNECT and now - last_reconnect > SILENCE_BEFORE_RECONNECT:
                    # Lazy Pirate: a fresh socket, then the same calls again under the same ids.
                    self._alive = False
                    poller.unregister(sock)
                    sock.close(0)
                    sock = self._new_socket()
                    poller.register(sock, zmq.POLLIN)
                    last_reconnect = now
                    log.info("executor at %s silent for %.1fs; reconnected", self.endpoint, silence)
                    # The calls are resent when the first answer shows the same executor is there
                    # (_check_incarnation): a new one behind the endpoint must not get calls the old
                    # one may have run, unless they are idempotent.
                    self._resend_due = True
                    self._send(sock, Hello(client="ciayn"))
                if silence > UNAVAILABLE_AFTER:
                    for cid in list(pending):
                        self._resolve(pending, cid, Result.failure(
                            cid, "unavailable",
                            f"the executor at {self.endpoint} has not answered for {silence:.0f} s"))
                for cid, p in list(pending.items()):
                    if now >= p.deadline:
                        self._send(sock, Cancel(id=cid))
                        self._resolve(pending, cid, Result.failure(
                            cid, "timeout",
                            f"no answer from the executor within the call's timeout plus {DEADLINE_GRACE:g} s"))
        finally:
            for cid in list(pending):
                self._resolve(pending, cid, Result.failure(cid, "cancelled", "the client was closed"))
            sock.close(0)

    def _drain_inbox(self, sock: zmq.Socket[bytes], pending: dict[str, _Pending], now: float) -> bool:
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if op == "call":
                call, future = arg
                timeout = call.timeout or self._tool_timeout(call.tool) or DEFAULT_TIMEOUT
                if call.id in pending:  # a caller reused an id: answer the newcomer from the same call
                    pending[call.id].future.add_done_callback(_forward_to(future))
                    continue
                silent_for = now - self._last_heard
                deadline = now + timeout + DEADLINE_GRACE
                if silent_for > UNAVAILABLE_AFTER:  # known dead: do not make the caller wait a full timeout
                    deadline = min(deadline, now + SILENCE_BEFORE_RECONNECT + 0.5)
                try:
                    frames = encode(call)
                except ProtocolError as e:  # it can never be sent: say so now, not after the deadline
                    future.set_result(Result.failure(call.id or "", "protocol", f"the call was not sent: {e}"))
                    continue
                pending[call.id] = _Pending(call, future, deadline, self._incarnation)
                self._send_frames(sock, frames)
            elif op == "cancel":
                self._send(sock, Cancel(id=arg))
            elif op == "hello":
                self._send(sock, Hello(client="ciayn"))
            elif op == "close":
                return False

    def _tool_timeout(self, tool: str) -> float | None:
        welcome = self._welcome
        if welcome is None:
            return None
        spec = next((s for s in welcome.tools if s.name == tool), None)
        if spec is not None and spec.timeout:
            return spec.timeout
        return welcome.limits.timeout_s

    def _send(self, sock: zmq.Socket[bytes], msg: Any) -> None:
        try:
            frames = encode(msg)
        except ProtocolError as e:
            log.error("cannot send %s: %s", msg.KIND, e)
            return
        self._send_frames(sock, frames)

    @staticmethod
    def _send_frames(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # nothing connected yet; heartbeats and resends cover it

    def _receive(self, sock: zmq.Socket[bytes], pending: dict[str, _Pending]) -> None:
        for _ in range(10_000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            self._alive = True
            try:
                msg = decode(frames)
            except ProtocolError as e:
                log.warning("malformed message from the executor: %s", e)
                continue
            if isinstance(msg, Result):
                if msg.id in pending:
                    self._resolve(pending, msg.id, msg)
                elif msg.error is not None and msg.error.kind == "protocol":
                    log.warning("the executor rejected a message: %s", msg.error.message)
            elif isinstance(msg, Pong):
                self._check_incarnation(msg.incarnation, sock, pending)
                if msg.queued:
                    # Calls wait in the executor's queue before their timeout starts there; the
                    # client's backstop deadline must not run out meanwhile.
                    for p in pending.values():
                        p.deadline += HEARTBEAT_INTERVAL
            elif isinstance(msg, Welcome):
                self._check_incarnation(msg.incarnation, sock, pending)
                self._welcome = msg
                self._welcome_event.set()

    def _check_incarnation(self, incarnation: int, sock: zmq.Socket[bytes], pending: dict[str, _Pending]) -> None:
        if self._incarnation is None:
            self._incarnation = incarnation
            for p in pending.values():
                p.sent_incarnation = incarnation
        if incarnation == self._incarnation:
            if self._resend_due:  # Lazy Pirate: the same executor answers the resends from its cache
                self._resend_due = False
                for p in pending.values():
                    self._send(sock, p.call)
            return
        self._resend_due = False
        log.warning("the executor at %s restarted (incarnation %s -> %s)", self.endpoint, self._incarnation,
                    incarnation)
        self._incarnation = incarnation
        self._send(sock, Hello(client="ciayn"))  # refresh the tool specs
        for cid, p in list(pending.items()):
            if p.sent_incarnation == incarnation:
                continue
            spec = next((s for s in self._welcome.tools if s.name == p.call.tool), None) if self._welcome else None
            if spec is not None and spec.idempotent:
                p.sent_incarnation = incarnation
                self._send(sock, p.call)
            else:
                self._resolve(pending, cid, Result.failure(
                    cid, "unavailable",
                    "the executor restarted while the call was in flight; it may or may not have run, and "
                    "the tool is not idempotent, so it was not resent"))

    @staticmethod
    def _resolve(pending: dict[str, _Pending], cid: str, result: Result) -> None:
        p = pending.pop(cid, None)
        if p is not None and not p.future.done():
            p.future.set_result(result)


def _forward_to(target: Future[Result]) -> Callable[[Future[Result]], None]:
    def forward(source: Future[Result]) -> None:
        if not target.done():
            target.set_result(source.result())

    return forward
