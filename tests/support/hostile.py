"""Hostile executors: one on a broker's backend (``HostileMember``, for the broker's red teams) and one
in front of a client (``HostileServer``, for the client's and the template's red teams)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from protocol import VERSION, Call, Heartbeat, Hello, Ping, Pong, Ready, decode, encode

BOUND = 15.0  # seconds for any one expected message


class HostileMember:
    """A hostile executor on a broker's backend, in a thread that owns its DEALER: it announces
    ``ready`` (raw frames or a model), heartbeats (listing ``applying`` in every heartbeat when set),
    records what the broker sends it, and sends what the test queues. It never answers a call."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, ready: Ready | list[bytes] | None,
                 name: str = "") -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.name = ready.executor if isinstance(ready, Ready) else name
        self.beating = ready is not None
        self.applying: list[str] = []
        self.received: queue.Queue[Any] = queue.Queue()
        self.outgoing: queue.Queue[list[bytes]] = queue.Queue()
        self.stop = threading.Event()
        if ready is not None:
            self.outgoing.put(ready if isinstance(ready, list) else encode(ready))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.outgoing.put(msg if isinstance(msg, list) else encode(msg))

    def _run(self) -> None:
        next_beat = 0.0
        while not self.stop.is_set():
            while not self.outgoing.empty():
                self.sock.send_multipart(self.outgoing.get())
            now = time.monotonic()
            if self.beating and now >= next_beat:
                self.sock.send_multipart(encode(Heartbeat(executor=self.name, applying=list(self.applying))))
                next_beat = now + 0.3
            if self.sock.poll(20):
                msg: Any
                try:
                    msg = decode(self.sock.recv_multipart())
                except Exception as e:  # what the broker sends is recorded, even what does not decode
                    msg = e
                if not isinstance(msg, Heartbeat):
                    self.received.put(msg)
        self.sock.close(0)

    def expect(self, kind: type, timeout: float = BOUND) -> Any:
        """The next message of ``kind`` the broker sends this executor, or None within ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.received.get(timeout=left)
            except queue.Empty:
                return None
            if isinstance(msg, kind):
                return msg
        return None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def tool_entry(**fields: Any) -> dict[str, Any]:
    """A tool as a welcome lists it, raw (a name and a signature unless ``fields`` say otherwise)."""
    return {"name": "t", "signature": "()", **fields}


class HostileServer:
    """Answers ``hello`` with ``welcome`` (tools and limits as given, raw), ``ping`` with a pong that
    always reports queued calls, and each call with the messages ``on_call`` returns (none: never)."""

    def __init__(self, endpoint: str, tools: list[dict[str, Any]], limits: dict[str, Any],
                 on_call: Callable[[Call], list[list[bytes]]]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.welcome = [VERSION, b"welcome", msgpack.packb(
            {"executor": "evil", "incarnation": 1, "tools": tools, "limits": limits})]
        self.on_call = on_call
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            route, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            if isinstance(msg, Hello):
                self.sock.send_multipart([route, *self.welcome])
            elif isinstance(msg, Ping):
                self.sock.send_multipart([route, *encode(Pong(nonce=msg.nonce, executor="evil", incarnation=1,
                                                              busy=1, queued=5))])
            elif isinstance(msg, Call):
                for reply in self.on_call(msg):
                    self.sock.send_multipart([route, *reply])
        self.sock.close(0)
        self.ctx.term()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
