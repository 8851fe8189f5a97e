"""The executor client: thread-safe, one I/O thread owns the DEALER socket, every call gets an answer.

Callers submit calls from any thread and get ``Future[Result]``. The I/O thread sends them, pings
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
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
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
from protocol.codec import valid_id
from protocol.errors import CiaynError
from protocol.messages import ID_PATTERN, MAX_TIMEOUT_S
from protocol.wire import LogBudget, bound_socket, ipc_owner_problem, ipc_path, recv_message

log = logging.getLogger("ciayn.client")

HEARTBEAT_INTERVAL = 0.5  # seconds between pings
SILENCE_BEFORE_RECONNECT = 2.0  # no message for this long: new socket, resend calls in flight
UNAVAILABLE_AFTER = 6.0  # no message for this long: calls in flight are answered `unavailable`
FIRST_CONTACT_WAIT = 65.0  # the same, before the executor's first word: it may be loading its tools (60 s)
DEADLINE_GRACE = 2.0  # added to a call's timeout before the client answers `timeout` itself
MAX_APPLY_GRACE = 120.0  # the most an executor's welcome can add to that (its apply_grace_s)
DEFAULT_TIMEOUT = 30.0  # a call's timeout when neither the call, the tool nor the executor says (validly)
RECV_BUDGET_S = 0.02  # seconds spent taking messages per turn of the I/O loop
RECV_HWM = 4  # messages ZeroMQ takes off the connection ahead of the I/O thread (each up to 128 MiB)


class ExecutorUnavailable(CiaynError):
    """No executor answered in time (only ``tools()`` raises it; calls get a result instead)."""


@dataclass
class _Pending:
    call: Call
    future: Future[Result]
    deadline: float
    sent_incarnation: int | None
    sent: bool = False  # handed to the socket at least once: the executor may have it


def _valid_timeout(timeout: object) -> bool:
    return isinstance(timeout, int | float) and not isinstance(timeout, bool) and math.isfinite(timeout) \
        and 0 < timeout <= MAX_TIMEOUT_S


class ExecutorClient:
    """Client of one executor or broker endpoint. Thread-safe; a context manager.

    ``insecure=True`` allows an abstract ``ipc://@name`` endpoint, whose owner cannot be checked (any
    local user can bind one first); an ``ipc://`` socket file owned by another user (not root) is
    always refused (SPEC.md, Transport)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float | None = None,
        curve_server_key: bytes | None = None,
        curve_keys: tuple[bytes, bytes] | None = None,
        connect_timeout: float = 10.0,
        insecure: bool = False,
    ) -> None:
        if timeout is not None and not _valid_timeout(timeout):
            raise ValueError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, not {timeout!r}")
        if endpoint.startswith("ipc://@") and not insecure:
            raise ValueError(f"cannot use executor endpoint {endpoint!r}: an abstract ipc socket has no owner to "
                             "check (any local user may bind it first); use an ipc path in a private directory, "
                             "or pass insecure=True")
        self.endpoint = endpoint
        self.default_timeout = timeout  # None: the executor's (or the tool's) own default
        self.connect_timeout = connect_timeout
        self._curve_server_key = curve_server_key
        self._curve_keys = curve_keys
        # One routing id for every socket this client opens: after a reconnect the executor (ROUTER
        # with handover) sends the answers to calls made on the old socket to the new one.
        self._routing_id = b"c" + uuid.uuid4().bytes
        self._ctx = zmq.Context()
        try:  # an endpoint or key zmq refuses is the caller's error: say so here, not in the I/O thread
            self._new_socket().close(0)
        except (zmq.ZMQError, ValueError, TypeError) as e:
            self._ctx.term()
            raise ValueError(f"cannot use executor endpoint {endpoint!r}: {e}") from None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._outbox: collections.deque[tuple[list[bytes], str | None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._welcome: Welcome | None = None
        self._welcome_event = threading.Event()
        self._bad_welcome = ""  # why the last welcome could not be decoded
        self._incarnation: int | None = None
        self._resend_due = False  # reconnected: resend calls in flight once the executor is known
        self._welcome_due = False  # the executor restarted: ask for its tools again (one hello at a time)
        self._last_hello = -math.inf
        # What the executor sends goes to the caller's log at a bounded rate, whatever it sends.
        self._complaints = LogBudget(log, "complaints about messages from the executor")
        self._last_heard = time.monotonic()
        self._heard_once = False  # anything from the executor yet (before, it may be loading its tools)
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
            if self._bad_welcome:
                raise ExecutorUnavailable(f"the executor at {self.endpoint} answered with a welcome this client "
                                          f"cannot use: {self._bad_welcome}")
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
        """Send a call; the future always resolves to a Result (never an exception). A call with an
        invalid id or timeout is answered at once (``protocol``, ``bad_arguments``), never sent."""
        future: Future[Result] = Future()
        if call.id and valid_id(call.id) is None:
            future.set_result(Result.failure("", "protocol", f"the call was not sent: its id {call.id[:40]!r} is "
                                             f"not a valid call id ({ID_PATTERN})"))
            return future
        cid = call.id or uuid.uuid4().hex
        call = call.model_copy(update={"id": cid})
        if timeout is not None:
            call.timeout = timeout
        elif call.timeout is None and self.default_timeout is not None:
            call.timeout = self.default_timeout
        if call.timeout is not None and not _valid_timeout(call.timeout):
            future.set_result(Result.failure(cid, "bad_arguments", f"the call was not sent: its timeout "
                                             f"{call.timeout!r} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]"))
            return future
        if self._closed:
            future.set_result(Result.failure(cid, "unavailable", "the client is closed"))
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
        """Ask the executor to stop a call this client sent; it is answered ``cancelled``."""
        if valid_id(call_id) is not None:
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

    def _endpoint_problem(self) -> str:
        """Why the endpoint must not be trusted right now ("" if it may): an ipc socket file of
        another user, or in a directory others can write to."""
        path = ipc_path(self.endpoint)
        return ipc_owner_problem(path) if path else ""

    def _new_socket(self) -> zmq.Socket[bytes]:
        problem = self._endpoint_problem()
        if problem:
            raise ValueError(problem)
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
            sock.setsockopt(zmq.SNDHWM, 0)  # the outbox below bounds nothing away: calls are the caller's
            sock.setsockopt(zmq.RCVHWM, RECV_HWM)  # what an executor sends waits on its side, not in our memory
            bound_socket(sock)
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
                        why = self._failed or "the client is closed"
                        future.set_result(Result.failure(call.id or "", "unavailable", why))

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
                    wait = min(wait, p.deadline + self._apply_grace() - now)
                poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0))
                events = dict(poller.poll(max(0, int(wait * 1000) + 1)))
                now = time.monotonic()
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if not self._drain_inbox(pending, now):
                    break
                if sock in events and events[sock] & zmq.POLLIN:
                    self._receive(sock, pending)
                if self._welcome_due and now - self._last_hello >= HEARTBEAT_INTERVAL:
                    self._last_hello = now  # an executor announcing a new incarnation per pong gets one a beat
                    self._queue(Hello(client="ciayn"))
                self._complaints.flush(now)
                if now >= next_ping:
                    self._queue(Ping(nonce=int(now * 1000)))
                    next_ping = now + HEARTBEAT_INTERVAL
                silence = now - self._last_heard
                if silence > SILENCE_BEFORE_RECONNECT and now - last_reconnect > SILENCE_BEFORE_RECONNECT:
                    last_reconnect = now
                    problem = self._endpoint_problem()
                    if problem:  # someone else's socket now sits at the endpoint: do not talk to it
                        log.error("%s", problem)
                        self._give_up(pending, problem)
                    else:
                        # Lazy Pirate: a fresh socket (same routing id), then the same calls again under
                        # the same ids once the same executor answers (_check_incarnation): a new one behind
                        # the endpoint must not get calls the old one may have run, unless idempotent.
                        self._alive = False
                        poller.unregister(sock)
                        sock.close(0)
                        sock = self._new_socket()
                        poller.register(sock, zmq.POLLIN)
                        log.info("executor at %s silent for %.1fs; reconnected", self.endpoint, silence)
                        self._resend_due = True
                        self._queue(Hello(client="ciayn"))
                if silence > self._unavailable_after() and pending:
                    self._give_up(pending, self._silence(silence))
                apply_grace = self._apply_grace()
                for cid, p in list(pending.items()):
                    if now >= p.deadline + apply_grace and not self._heard_once:  # nothing ever answered
                        self._give_up_one(pending, cid, self._silence(silence))
                    elif now >= p.deadline + apply_grace:
                        self._queue(Cancel(id=cid))
                        self._resolve(pending, cid, Result.failure(
                            cid, "timeout",
                            f"no answer from the executor within the call's timeout plus {DEADLINE_GRACE:g} s; "
                            + ("it was cancelled there" if p.sent else "it was never sent")))
                self._flush(sock, pending)
        finally:
            for cid in list(pending):
                self._resolve(pending, cid, Result.failure(cid, "cancelled", "the client was closed"))
            sock.close(0)

    def _unavailable_after(self) -> float:
        """Silence after which calls in flight are given up: an executor never heard from may still
        be loading its tools (SPEC.md section 1, start-up), so it gets that long first."""
        return UNAVAILABLE_AFTER if self._heard_once else FIRST_CONTACT_WAIT

    def _silence(self, seconds: float) -> str:
        if self._heard_once:
            return f"the executor at {self.endpoint} has not answered for {seconds:.0f} s"
        return (f"nothing has answered at {self.endpoint} in {seconds:.0f} s (no executor there, or one that "
                "could not load its tools)")

    def _give_up(self, pending: dict[str, _Pending], why: str) -> None:
        """Answer every call in flight ``unavailable`` and cancel those the executor may hold, so that
        none of them runs later unseen."""
        for cid in list(pending):
            self._give_up_one(pending, cid, why)

    def _give_up_one(self, pending: dict[str, _Pending], cid: str, why: str) -> None:
        if pending[cid].sent:
            self._queue(Cancel(id=cid))
            message = f"{why}; the call may or may not have run (a cancel was sent)"
        else:
            message = f"{why}; the call was never sent"
        self._resolve(pending, cid, Result.failure(cid, "unavailable", message))

    def _drain_inbox(self, pending: dict[str, _Pending], now: float) -> bool:
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if op == "call":
                call, future = arg
                cid = call.id or ""  # submit() gave it one
                if cid in pending:  # a caller reused an id: answer the newcomer from the same call
                    pending[cid].future.add_done_callback(_forward_to(future))
                    continue
                timeout = call.timeout or self._tool_timeout(call.tool)
                silent_for = now - self._last_heard
                deadline = now + timeout + DEADLINE_GRACE
                if silent_for > self._unavailable_after():  # known dead: do not make the caller wait a full timeout
                    deadline = min(deadline, now + SILENCE_BEFORE_RECONNECT + 0.5)
                try:
                    frames = encode(call)
                except ProtocolError as e:  # it can never be sent: say so now, not after the deadline
                    future.set_result(Result.failure(cid, "protocol", f"the call was not sent: {e}"))
                    continue
                pending[cid] = _Pending(call, future, deadline, self._incarnation)
                self._outbox.append((frames, cid))
            elif op == "cancel":
                self._queue(Cancel(id=arg))
            elif op == "hello":
                self._queue(Hello(client="ciayn"))
            elif op == "close":
                return False

    def _apply_grace(self) -> float:
        """How much longer than its deadline a call may take because the executor applies its
        workspace writes after it answered (its welcome's ``apply_grace_s``, hardened
        ``--workspace-rw``): a cancel then would throw away the writes of a call that answered in
        time. At most ``MAX_APPLY_GRACE``, whatever an executor says."""
        welcome = self._welcome
        return min(welcome.apply_grace_s, MAX_APPLY_GRACE) if welcome is not None else 0.0

    def _tool_timeout(self, tool: str) -> float:
        """The timeout the executor applies to a call that gives none: the tool's, else the
        executor's default; a value a (hostile or broken) executor sends outside (0, MAX_TIMEOUT_S]
        counts as not given, so the client's bound stays finite and sane."""
        welcome = self._welcome
        if welcome is None:
            return DEFAULT_TIMEOUT
        spec = next((s for s in welcome.tools if s.name == tool), None)
        if spec is not None and spec.timeout and _valid_timeout(spec.timeout):
            return spec.timeout
        timeout = welcome.limits.timeout_s
        return timeout if _valid_timeout(timeout) else DEFAULT_TIMEOUT

    def _queue(self, msg: Any) -> None:
        try:
            self._outbox.append((encode(msg), None))
        except ProtocolError as e:
            log.error("cannot send %s: %s", msg.KIND, e)

    def _flush(self, sock: zmq.Socket[bytes], pending: dict[str, _Pending]) -> None:
        """Send what is queued, in order, until the socket would block; the rest waits for POLLOUT
        (nothing is dropped: ``zmq.Again`` only means later). A call answered meanwhile is skipped."""
        while self._outbox:
            frames, call_id = self._outbox[0]
            p = pending.get(call_id) if call_id is not None else None
            if call_id is not None and p is None:
                self._outbox.popleft()
                continue
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()
            if p is not None:
                p.sent = True

    def _receive(self, sock: zmq.Socket[bytes], pending: dict[str, _Pending]) -> None:
        """Take what the executor sent, for at most ``RECV_BUDGET_S`` per turn, so that a flood of
        costly messages cannot keep the loop from deadlines."""
        until = time.monotonic() + RECV_BUDGET_S
        while time.monotonic() < until:
            frames = recv_message(sock)
            if frames is None:
                return
            self._last_heard = time.monotonic()
            self._alive = self._heard_once = True
            try:
                msg = decode(frames)
            except ProtocolError as e:
                self._complaints.warning("malformed message from the executor: %s", e)
                if e.about == "welcome":
                    self._bad_welcome = str(e)
                if e.about == "result" and e.call_id in pending:  # it answers that call, unreadably
                    self._resolve(pending, e.call_id, Result.failure(
                        e.call_id, "protocol", f"the executor's answer could not be read: {e}"))
                continue
            if isinstance(msg, Result):
                if msg.id in pending:
                    self._resolve(pending, msg.id, self._checked(msg))
                elif msg.error is not None and msg.error.kind == "protocol":
                    self._complaints.warning("the executor rejected a message: %s", msg.error.message)
            elif isinstance(msg, Pong):
                if msg.error is not None:
                    self._complaints.warning("the executor rejected a ping: %s", msg.error.message)
                self._check_incarnation(msg.incarnation, pending)
            elif isinstance(msg, Welcome):
                self._check_incarnation(msg.incarnation, pending)
                self._welcome = msg
                self._welcome_due = False
                self._welcome_event.set()

    def _checked(self, result: Result) -> Result:
        """``result``, unless it contradicts itself: ``error`` is set exactly when ``ok`` is false
        (SPEC.md section 5), and callers rely on it (``result.error.kind`` after ``not result.ok``).
        Such an answer is ``protocol``, like any other answer that cannot be read."""
        if result.ok != (result.error is not None):
            return result
        problem = "ok is true but an error is given" if result.ok else "ok is false but no error is given"
        self._complaints.warning("malformed result from the executor for call %s: %s", result.id, problem)
        return Result.failure(result.id, "protocol", f"the executor's answer could not be read: {problem}")

    def _check_incarnation(self, incarnation: int, pending: dict[str, _Pending]) -> None:
        if self._incarnation is None:
            self._incarnation = incarnation
            for p in pending.values():
                p.sent_incarnation = incarnation
        if incarnation == self._incarnation:
            if self._resend_due:  # Lazy Pirate: the same executor never runs an id twice
                self._resend_due = False
                for cid, p in pending.items():
                    self._resend(cid, p)
            return
        self._resend_due = False
        self._complaints.warning("the executor at %s restarted (incarnation %s -> %s)", self.endpoint,
                                 self._incarnation, incarnation)
        self._incarnation = incarnation
        self._welcome_due = True  # refresh the tool specs
        for cid, p in list(pending.items()):
            if p.sent_incarnation == incarnation:
                continue
            spec = next((s for s in self._welcome.tools if s.name == p.call.tool), None) if self._welcome else None
            if spec is not None and spec.idempotent:
                p.sent_incarnation = incarnation
                self._resend(cid, p)
            else:
                self._resolve(pending, cid, Result.failure(
                    cid, "unavailable",
                    "the executor restarted while the call was in flight; it may or may not have run, and "
                    "the tool is not idempotent, so it was not resent"))

    def _resend(self, cid: str, p: _Pending) -> None:
        if not any(queued_id == cid for _, queued_id in self._outbox):
            self._outbox.append((encode(p.call), cid))

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
