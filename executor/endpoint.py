"""The executor's side facing clients, as one small interface.

An executor either binds a ROUTER that clients connect to (``RouterEndpoint``, this module) or, in a
pool, connects to a broker (``executor.link.BrokerLink``). Both look the same to the supervisor: a
socket to poll, messages in as ``(route, message)`` pairs, frames out to a route, and ``tick`` for
timers. Nothing here knows about workers or the call table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any, Protocol

import zmq

from protocol import MAX_FRAME_BYTES, Message, ProtocolError, decode

log = logging.getLogger("ciayn-executor")

SHUTDOWN_LINGER_MS = 500
RECV_BATCH = 1000  # messages taken per wake-up, so deadlines and workers are served in between


class EndpointError(Exception):
    """The endpoint cannot be opened (in use, bad address, bad keys)."""


Incoming = tuple[bytes, Message | ProtocolError]


class ClientSide(Protocol):
    """What the supervisor needs from the side that faces clients."""

    socket: zmq.Socket[bytes]
    failed: str  # set when this side cannot go on (a broker refused the executor): the executor stops

    def receive(self) -> Iterator[Incoming]:
        """Messages waiting now, each with the route to answer on; a malformed one comes as the
        ``ProtocolError`` that already knows its reply."""
        ...

    def send(self, route: bytes, frames: list[bytes]) -> None: ...

    def describe(self) -> str: ...

    def tick(self, now: float) -> float:
        """Timers of this side (a link's heartbeats and reconnection); seconds until it is next due."""
        ...

    def close(self) -> None: ...


class RouterEndpoint:
    """A bound ROUTER socket, optionally CurveZMQ-authenticated; owns its ipc socket file."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, curve_secret: str | None = None,
                 curve_clients: str | None = None) -> None:
        self.endpoint = endpoint
        self.curve_secret = curve_secret
        self.curve_clients = curve_clients
        self.auth: Any = None
        self.failed = ""
        self.ipc_identity: tuple[int, int] | None = None
        self.check_free(endpoint)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if curve_secret:
            from protocol.curve import CurveError, secure_server

            try:
                self.auth = secure_server(ctx, sock, curve_secret, curve_clients)
            except CurveError as e:
                sock.close(0)
                raise EndpointError(str(e)) from None
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            if self.auth is not None:
                self.auth.stop()
            raise EndpointError(f"cannot bind {endpoint}: {e}") from None
        self.socket = sock
        path = self._ipc_path()
        self.ipc_identity = _file_identity(path) if path else None
        if endpoint.startswith("tcp://") and not curve_secret and not _loopback(endpoint):
            log.warning("serving on %s without CurveZMQ: anyone who can reach this address can run these tools; "
                        "use --curve-secret (and --curve-clients) or bind to 127.0.0.1", endpoint)

    def describe(self) -> str:
        if not self.curve_secret:
            curve = "off"
        else:
            curve = f"clients in {self.curve_clients}" if self.curve_clients else "any client key"
        return f"{self.endpoint} (curve: {curve})"

    def receive(self) -> Iterator[Incoming]:
        for _ in range(RECV_BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            route, body = frames[0], frames[1:]
            try:
                yield route, decode(body)
            except ProtocolError as e:
                yield route, e

    def send(self, route: bytes, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.send_multipart([route, *frames], zmq.NOBLOCK)

    def tick(self, now: float) -> float:
        return float("inf")  # a bound ROUTER has no timers: clients ping it

    def close(self) -> None:
        self.socket.close(linger=SHUTDOWN_LINGER_MS)
        if self.auth is not None:
            self.auth.stop()
        path = self._ipc_path()
        if path and self.ipc_identity is not None and _file_identity(path) == self.ipc_identity:
            with contextlib.suppress(OSError):
                os.unlink(path)  # only our own socket file, not one a later executor bound there

    def _ipc_path(self) -> str | None:
        return _ipc_path(self.endpoint)

    @staticmethod
    def check_free(endpoint: str) -> None:
        """ZeroMQ binds an ipc path by replacing whatever file is there, so a second executor would
        silently take a live one's endpoint (and the first, stopping, would then delete the second's
        socket file). Refuse if something accepts connections there; a stale file is replaced."""
        path = _ipc_path(endpoint)
        if path is None or not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            return  # nobody listening: a file left by an executor that died
        finally:
            probe.close()
        raise EndpointError(f"cannot bind {endpoint}: another process is serving on it")


def _ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint (not of an abstract ``ipc://@name`` one)."""
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else ""
    return path if path and not path.startswith("@") else None


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
