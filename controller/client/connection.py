"""The client's loop: the one owner of its DEALER socket.

Callers post operations (``call``, ``cancel``, ``hello``, ``close``) from any thread. Whoever holds
the loop runs it: the I/O thread while something is awaited that no caller waits for on the loop,
otherwise the caller of ``drive`` (``ExecutorClient.call``), which sends its call and takes what the
executor sends until its own answer is in, sparing each call two switches between threads. The loop
sends what is queued in order, never dropping a message (``zmq.Again`` only means later), takes what
the executor sends for a bounded time per turn (one bounded message at a time), and follows the
``Link`` (``link.py``) for pings, reconnects and giving up, and the ``InFlight`` table
(``inflight.py``) for deadlines. If the loop fails, every call it holds or is handed later is
answered ``unavailable``.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import select
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import zmq

from controller.client.inflight import InFlight
from controller.client.link import RECV_BUDGET_S, RECV_HWM, Link, Meeting, Step
from controller.client.welcome import Introduction
from protocol import Call, Cancel, Hello, Ping, Pong, ProtocolError, Result, Welcome, decode, encode
from protocol.wire import LogBudget, bound_socket, ipc_owner_problem, ipc_path, recv_message

log = logging.getLogger("ciayn.client")


class Connection:
    """The socket side of one ``ExecutorClient``: its loop, and what only the loop touches (the
    socket, the outbox, the calls in flight, the link), run by whoever holds ``_io``.

    ``__init__`` opens a socket once and closes it, so that an endpoint or key ZeroMQ refuses is the
    caller's ``ValueError`` there, not a failure in the loop; ``start`` starts the I/O thread."""

    def __init__(self, endpoint: str, curve_server_key: bytes | None, curve_keys: tuple[bytes, bytes] | None) -> None:
        self.endpoint = endpoint
        self._curve_server_key = curve_server_key
        self._curve_keys = curve_keys
        # One routing id for every socket this client opens: after a reconnect the executor (ROUTER
        # with handover) sends the answers to calls made on the old socket to the new one.
        self._routing_id = b"c" + uuid.uuid4().bytes
        self._ctx = zmq.Context()
        try:
            self._new_socket().close(0)
        except (zmq.ZMQError, ValueError, TypeError) as e:
            self._ctx.term()
            raise ValueError(f"cannot use executor endpoint {endpoint!r}: {e}") from None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._outbox: collections.deque[tuple[list[bytes], str | None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.introduction = Introduction()
        self.link = Link(endpoint, time.monotonic())
        self._in_flight = InFlight(cancel=lambda call_id: self._queue(Cancel(id=call_id)))
        # What the executor sends goes to the caller's log at a bounded rate, whatever it sends.
        self._complaints = LogBudget(log, "complaints about messages from the executor")
        self.closed = False
        self.failed = ""
        # Whoever holds ``_io`` runs the loop: the I/O thread, or a caller of ``drive`` while the
        # thread is parked (waiting on ``_parked``: posts and the next heartbeat only).
        self._io = threading.Lock()
        self._ended = False
        self._sock: zmq.Socket[bytes] | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._parked = select.poll()
        self._parked.register(self._wake_r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="ciayn-client-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, op: str, arg: Any) -> None:
        """Hand an operation to whoever runs the loop (waking it)."""
        self._inbox.put((op, arg))
        if self._ended:  # nobody will run the loop again
            self._answer_posted()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Stop the thread (calls in flight are answered ``cancelled``) and free what it used."""
        self.closed = True
        self.post("close", None)
        self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ctx.term()

    # ---------------------------------------------------------------- the socket

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

    # ---------------------------------------------------------------- who runs the loop

    def drive(self, call: Call, future: Future[Result]) -> None:
        """Run a call on the calling thread when nobody else runs the loop (``_io`` is free): it
        sends the call and takes what the executor sends until its own answer is in, sparing the
        call two switches between threads. Otherwise the call is posted to whoever runs the loop.
        Returns once ``future`` is set, or the call posted."""
        if not self._io.acquire(blocking=False):
            self.post("call", (call, future))
            return
        try:
            if self._ended:
                future.set_result(Result.failure(call.id or "", "unavailable", self.failed or "the client is closed"))
                return
            self._take_call(call, future, time.monotonic())
            if self._sock is not None:  # sent now, not after a first wait on the socket
                self._flush(self._sock)
            go_on = True
            while go_on and not future.done():
                go_on = self._turn(block=True)
            if not go_on:
                self._end()
        except Exception as e:  # a bug here must not leave callers waiting forever
            self._fail(e)
        finally:
            handover = not self._ended and self._watched()
            self._io.release()
            if handover:  # calls of other threads are in flight: the I/O thread takes them over
                self._wake()

    def _run(self) -> None:
        """The I/O thread: it runs the loop while something is awaited that no caller waits for on
        the loop (a submitted call, a call posted by a caller while another ran the loop, the
        welcome); otherwise it only wakes for heartbeats and posts, and the loop is free for
        ``drive``."""
        while True:
            with self._io:
                if self._ended:
                    return
                try:
                    go_on = self._turn(block=False)
                    while go_on and self._watched():
                        go_on = self._turn(block=True)
                    if not go_on:
                        self._end()
                        return
                except Exception as e:  # a bug here must not leave callers waiting forever
                    self._fail(e)
                    return
                wait = self._due(time.monotonic()) - time.monotonic()
            self._parked.poll(max(0, int(wait * 1000) + 1))

    def _watched(self) -> bool:
        """Whether the loop must go on watching the socket for someone who is not running it."""
        return bool(self._in_flight) or bool(self._outbox) or self.introduction.welcome is None \
            or self.link.welcome_due

    def _due(self, now: float) -> float:
        return min(self.link.next_ping, self._in_flight.next_deadline(self.introduction.apply_grace()))

    def _fail(self, e: Exception) -> None:
        log.exception("the executor client's I/O loop failed")
        self.failed = f"the executor client failed: {type(e).__name__}: {e}"
        self._end()

    def _end(self) -> None:
        """The loop is over (closed, or failed): calls in flight are answered ``cancelled``, calls
        posted since ``unavailable``; the socket is closed."""
        self.closed = self._ended = True
        self._in_flight.close()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._answer_posted()

    def _answer_posted(self) -> None:
        why = self.failed or "the client is closed"
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "call":
                call, future = arg
                if not future.done():
                    future.set_result(Result.failure(call.id or "", "unavailable", why))

    def _turn(self, block: bool) -> bool:
        """One turn of the loop, by whoever holds ``_io``: wait (``block``: until something happens
        or is due) and act on it. False once the client is closing."""
        if self._sock is None:
            self._sock = self._new_socket()
            self._poller.register(self._sock, zmq.POLLIN)
            self.link.last_heard = self.link.last_reconnect = time.monotonic()
        sock, link, in_flight = self._sock, self.link, self._in_flight
        now = time.monotonic()
        wait = self._due(now) - now if block else 0
        self._poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0))
        events = dict(self._poller.poll(max(0, int(wait * 1000) + 1) if block else 0))
        now = time.monotonic()
        if self._wake_r in events:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        if not self._drain_inbox(now):
            return False
        if sock in events and events[sock] & zmq.POLLIN:
            self._receive(sock)
        self._complaints.flush(now)
        for step in link.tick(now, bool(in_flight)):
            if step is Step.RECONNECT:
                sock = self._reconnect(sock, now)
            elif step is Step.GIVE_UP:
                in_flight.give_up_all(link.silence(now))
            elif step is Step.PING:
                self._queue(Ping(nonce=int(now * 1000)))
            else:
                self._queue(Hello(client="ciayn"))
        in_flight.expire(now, self.introduction.apply_grace(), None if link.heard_once else link.silence(now))
        self._flush(sock)
        return True

    def _reconnect(self, sock: zmq.Socket[bytes], now: float) -> zmq.Socket[bytes]:
        """Lazy Pirate: a fresh socket under the same routing id, unless someone else's socket now sits
        at the endpoint: then nothing is said to it, and every call in flight is given up."""
        problem = self._endpoint_problem()
        if problem:
            log.error("%s", problem)
            self._in_flight.give_up_all(problem)
            return sock
        self._poller.unregister(sock)
        sock.close(0)
        self._sock = sock = self._new_socket()
        self._poller.register(sock, zmq.POLLIN)
        log.info("executor at %s silent for %.1fs; reconnected", self.endpoint, now - self.link.last_heard)
        self.link.reconnected()
        self._queue(Hello(client="ciayn"))
        return sock

    def _drain_inbox(self, now: float) -> bool:
        """Take what callers posted; False once the client is closing."""
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if op == "call":
                call, future = arg
                self._take_call(call, future, now)
            elif op == "cancel":
                self._queue(Cancel(id=arg))
            elif op == "hello":
                self._queue(Hello(client="ciayn"))
            elif op == "close":
                return False

    def _take_call(self, call: Call, future: Future[Result], now: float) -> None:
        """Put a call (its id set) in flight and in the outbox."""
        if self._in_flight.join(call.id or "", future):  # a call of that id is in flight: its answer is this one's
            return
        timeout = call.timeout or self.introduction.tool_timeout(call.tool)
        try:
            frames = encode(call)
        except ProtocolError as e:  # it can never be sent: say so now, not after the deadline
            future.set_result(Result.failure(call.id or "", "protocol", f"the call was not sent: {e}"))
            return
        self._in_flight.add(call, future, self.link.deadline(now, timeout), self.link.incarnation)
        self._outbox.append((frames, call.id))

    def _queue(self, msg: Any) -> None:
        try:
            self._outbox.append((encode(msg), None))
        except ProtocolError as e:
            log.error("cannot send %s: %s", msg.KIND, e)

    def _flush(self, sock: zmq.Socket[bytes]) -> None:
        """Send what is queued, in order, until the socket would block; the rest waits for POLLOUT
        (nothing is dropped: ``zmq.Again`` only means later). A call answered meanwhile is skipped."""
        while self._outbox:
            frames, call_id = self._outbox[0]
            p = self._in_flight.get(call_id)
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

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        """Take what the executor sent, for at most ``RECV_BUDGET_S`` per turn, so that a flood of
        costly messages cannot keep the loop from deadlines."""
        until = time.monotonic() + RECV_BUDGET_S
        while time.monotonic() < until:
            frames = recv_message(sock)
            if frames is None:
                return
            self.link.heard(time.monotonic())
            try:
                msg = decode(frames)
            except ProtocolError as e:
                self._complaints.warning("malformed message from the executor: %s", e)
                if e.about == "welcome":
                    self.introduction.problem = str(e)
                if e.about == "result" and e.call_id is not None and e.call_id in self._in_flight:
                    self._in_flight.resolve(e.call_id, Result.failure(  # it answers that call, unreadably
                        e.call_id, "protocol", f"the executor's answer could not be read: {e}"))
                continue
            if isinstance(msg, Result):
                if msg.id in self._in_flight:
                    self._in_flight.resolve(msg.id, self._checked(msg))
                elif msg.error is not None and msg.error.kind == "protocol":
                    self._complaints.warning("the executor rejected a message: %s", msg.error.message)
            elif isinstance(msg, Pong):
                if msg.error is not None:
                    self._complaints.warning("the executor rejected a ping: %s", msg.error.message)
                self._meet(msg.incarnation)
            elif isinstance(msg, Welcome):
                self._meet(msg.incarnation)
                self.link.welcome_due = False
                self.introduction.accept(msg)

    def _checked(self, result: Result) -> Result:
        """``result``, unless it contradicts itself: ``error`` is set exactly when ``ok`` is false
        (SPEC.md section 5), and callers rely on it (``result.error.kind`` after ``not result.ok``).
        Such an answer is ``protocol``, like any other answer that cannot be read."""
        if result.ok != (result.error is not None):
            return result
        problem = "ok is true but an error is given" if result.ok else "ok is false but no error is given"
        self._complaints.warning("malformed result from the executor for call %s: %s", result.id, problem)
        return Result.failure(result.id, "protocol", f"the executor's answer could not be read: {problem}")

    def _meet(self, incarnation: int) -> None:
        """The executor said which incarnation it is: resend, or settle the calls a restart may have
        lost (idempotent ones go to the new incarnation)."""
        if self.link.incarnation is None:
            self._in_flight.adopt(incarnation)
        before = self.link.incarnation
        meeting = self.link.meet(incarnation)
        if meeting is Meeting.RESEND:  # Lazy Pirate: the same executor never runs an id twice
            resend = list(self._in_flight)
        elif meeting is Meeting.RESTARTED:
            self._complaints.warning("the executor at %s restarted (incarnation %s -> %s)", self.endpoint,
                                     before, incarnation)
            resend = self._in_flight.after_restart(incarnation, self.introduction.idempotent)
        else:
            return
        for cid, p in resend:
            if not any(queued_id == cid for _, queued_id in self._outbox):
                self._outbox.append((encode(p.call), cid))
