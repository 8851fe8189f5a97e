"""What a bound ROUTER holds for its clients (``Outboxes``): answers their pipes cannot take yet, and
large answers ZeroMQ has not finished sending, bounded in bytes per client and for all clients
together. A client over either bound (the heaviest one, for the total) has its held answers dropped
and its connection closed, with a warning; it may come back and resend (its results stay in the
result cache). Nothing here reads or binds: ``executor.clientside.router`` owns the socket.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Container
from typing import Any, cast

import zmq

from executor.clientside.base import MAX_KNOWN_CONNECTIONS

log = logging.getLogger("ciayn-executor")

TRACK_BYTES = 64 * 1024  # answers this large go to ZeroMQ uncopied, followed until it has sent them


class Outboxes:
    """Answers held per route on ``socket`` (a ROUTER_MANDATORY one); ``connected`` says which routes
    have a known connection, ``disconnect`` closes one (True if it did)."""

    def __init__(self, socket: zmq.Socket[Any], *, limit: int, total_limit: int,
                 connected: Container[bytes], disconnect: Callable[[bytes], bool]) -> None:
        self.socket = socket
        self.limit = limit
        self.total_limit = total_limit
        self.connected = connected
        self.disconnect = disconnect
        self.boxes: dict[bytes, collections.deque[list[bytes]]] = {}
        self.box_bytes: collections.Counter[bytes] = collections.Counter()
        # Large answers handed to ZeroMQ and not sent yet (a client that does not read keeps up to
        # SEND_HWM of them in its pipe, whatever their size), and everything held, for the total bound.
        self.in_pipe: dict[bytes, collections.deque[tuple[zmq.MessageTracker, int]]] = {}
        self.pipe_bytes: collections.Counter[bytes] = collections.Counter()
        self.held_total = 0
        # Clients dropped for not reading: their answers are discarded (they stay in the result cache)
        # until they speak again, instead of filling what their closed connection still holds.
        self.dropped: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def heard(self, route: bytes) -> None:
        """``route`` spoke: answers for it are held again."""
        self.dropped.pop(route, None)

    def holds(self, route: bytes) -> bool:
        """Whether answers for ``route`` wait in its outbox."""
        return route in self.boxes

    def send(self, route: bytes, frames: list[bytes]) -> None:
        """Send now, or hold the frames for this client until its pipe has room (never dropped by a
        high-water mark). A client that is gone (no route) is not waited for: it resends its calls
        when it comes back, and they are answered from the result cache."""
        if route in self.dropped:
            log.debug("client %s was dropped for not reading; an answer for it was not sent", route.hex()[:8])
            return
        size = sum(len(f) for f in frames)
        if route in self.boxes or not self._pipe_has_room(route, size):
            self._hold(route, frames, size)
        else:
            try:
                self._push(route, frames, size)
            except zmq.Again:
                self._hold(route, frames, size)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    log.debug("client %s is gone; an answer for it was not sent", route.hex()[:8])
                else:
                    log.warning("cannot send to client %s: %s", route.hex()[:8], e)
        if self.held_total > self.total_limit:
            self._bound_total()

    def flush(self) -> None:
        """Send answers held for clients whose pipes were full, and forget large answers ZeroMQ has
        sent."""
        for route in list(self.in_pipe):
            if route not in self.boxes:
                self._pipe_has_room(route, 0)
        for route in list(self.boxes):
            box = self.boxes[route]
            while box:
                size = sum(len(f) for f in box[0])
                if not self._pipe_has_room(route, size):
                    break
                try:
                    self._push(route, box[0], size)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    box.clear()  # the client is gone
                    break
                box.popleft()
                self.box_bytes[route] -= size
                self.held_total -= size
            if not box:
                del self.boxes[route]
                self.held_total -= self.box_bytes.pop(route, 0)

    def _push(self, route: bytes, frames: list[bytes], size: int) -> None:
        """Hand an answer to ZeroMQ (``zmq.Again`` when the client's pipe is full). A large one is not
        copied, and is counted as held for the client until ZeroMQ has sent it."""
        if len(frames[-1]) < TRACK_BYTES:  # the body
            self.socket.send_multipart([route, *frames], zmq.NOBLOCK)
            return
        tracker = self.socket.send_multipart([route, *frames], zmq.NOBLOCK, copy=False, track=True)
        self.in_pipe.setdefault(route, collections.deque()).append((cast(zmq.MessageTracker, tracker), size))
        self.pipe_bytes[route] += size
        self.held_total += size

    def _pipe_has_room(self, route: bytes, size: int) -> bool:
        """Whether ZeroMQ may take ``size`` more bytes for ``route`` within its bound (an empty pipe
        always may), after forgetting the answers it has sent."""
        box = self.in_pipe.get(route)
        if box is None:
            return True
        while box and box[0][0].done:
            self.pipe_bytes[route] -= box[0][1]
            self.held_total -= box.popleft()[1]
        if not box:
            del self.in_pipe[route], self.pipe_bytes[route]
            return True
        return self.pipe_bytes[route] + size <= self.limit

    def _hold(self, route: bytes, frames: list[bytes], size: int) -> None:
        self.boxes.setdefault(route, collections.deque()).append(frames)
        self.box_bytes[route] += size
        self.held_total += size
        if self.box_bytes[route] + self.pipe_bytes.get(route, 0) > self.limit:
            self._drop(route, f"over the {self.limit // 1024} KiB it may hold")

    def _drop(self, route: bytes, why: str) -> None:
        """Drop what is held for a client that does not read, and close its connection (which frees
        what ZeroMQ holds for it)."""
        held = self.boxes.pop(route, collections.deque())
        size = self.box_bytes.pop(route, 0)
        self.held_total -= size
        self.dropped[route] = None
        while len(self.dropped) > MAX_KNOWN_CONNECTIONS:
            self.dropped.popitem(last=False)
        how = "disconnected it" if self.disconnect(route) else "it could not be disconnected"
        log.warning("client %s does not read its answers: dropped the %d held for it (%d KiB; with what ZeroMQ "
                    "holds for it, %d KiB, %s) and %s; results stay in the result cache for a resend",
                    route.hex()[:8], len(held), size // 1024, (size + self.pipe_bytes.get(route, 0)) // 1024, why,
                    how)

    def _bound_total(self) -> None:
        """All clients together hold more than ``total_limit``: drop the heaviest until they do not
        (counting what ZeroMQ holds for a disconnected client as freed: it is, once ZeroMQ notices;
        so a client that reads is never dropped for bytes another one's closed connection held)."""
        for route in list(self.in_pipe):
            self._pipe_has_room(route, 0)
        candidates = set(self.boxes) | {r for r in self.in_pipe if r in self.connected}
        releasing = sum(self.pipe_bytes[r] for r in self.in_pipe if r not in candidates)
        excess = self.held_total - releasing - self.total_limit
        for route in sorted(candidates, key=lambda r: self.box_bytes.get(r, 0) + self.pipe_bytes.get(r, 0),
                            reverse=True):
            if excess <= 0:
                break
            excess -= self.box_bytes.get(route, 0) + self.pipe_bytes.get(route, 0)
            self._drop(route, f"the heaviest while all clients' answers passed {self.total_limit // 1024} KiB")
