"""The broker's two bound ROUTERs: the frontend (controllers) and the backend (executors), each with
the executor's endpoint rules (``executor.clientside.router``: private ipc, CurveZMQ on tcp unless
``--insecure``, no answer dropped by a high-water mark), and the one encoder for what the broker
sends (``frames_of``: a message too large to encode becomes its ``output_limit`` answer).
"""

from __future__ import annotations

from typing import Any

import zmq

from executor.clientside.base import EndpointError
from executor.clientside.router import RouterEndpoint
from protocol import ProtocolError, Result, encode
from protocol.errors import CiaynError


class BrokerError(CiaynError):
    """The broker cannot start (endpoint in use, bad keys, an unusable state directory)."""


class Sockets:
    """The frontend and the backend, bound by ``open``; sending takes a message or frames already
    encoded (a cached answer)."""

    def __init__(self, frontend: str, backend: str, *, curve_secret: str | None = None,
                 curve_clients: str | None = None, curve_executors: str | None = None,
                 insecure: bool = False) -> None:
        self.frontend_endpoint = frontend
        self.backend_endpoint = backend
        self.curve_secret = curve_secret
        self.curve_clients = curve_clients
        self.curve_executors = curve_executors
        self.insecure = insecure
        self.contexts: list[zmq.Context[Any]] = []
        self.sides: dict[str, RouterEndpoint] = {}

    def open(self) -> None:
        """Bind both, each in its own context: a context has one ZAP authenticator with one policy, and
        the frontend admits controllers' keys while the backend admits executors' keys."""
        for which, endpoint, allowed in (("frontend", self.frontend_endpoint, self.curve_clients),
                                         ("backend", self.backend_endpoint, self.curve_executors)):
            if allowed and not self.curve_secret:
                raise BrokerError(f"a {which} key directory needs --curve-secret (the broker's own key)")
            if which == "backend" and self.curve_secret and not allowed and not self.insecure:
                raise BrokerError("with --curve-secret the backend needs --curve-executors DIR: otherwise any key "
                                  "could join as an executor, read every call and answer it (or pass --insecure)")
            ctx: zmq.Context[Any] = zmq.Context()
            self.contexts.append(ctx)
            try:
                self.sides[which] = RouterEndpoint(ctx, endpoint, curve_secret=self.curve_secret,
                                                   curve_clients=allowed, insecure=self.insecure,
                                                   handover=which == "frontend")
            except EndpointError as e:
                raise BrokerError(f"{which}: {e}") from None

    @property
    def frontend(self) -> RouterEndpoint:
        return self.sides["frontend"]

    @property
    def backend(self) -> RouterEndpoint:
        return self.sides["backend"]

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
        self.sides = {}
        for ctx in self.contexts:
            ctx.term()
        self.contexts = []

    def describe(self) -> str:
        return f"clients on {self.frontend.describe()}, executors on {self.backend.describe()}"

    def tick(self, now: float) -> float:
        """Seconds until either side has something to do by itself (``RouterEndpoint.tick``)."""
        return min(self.frontend.tick(now), self.backend.tick(now))

    def to_client(self, route: bytes, msg: Any) -> None:
        """Held for a slow client; a client gone finds its answer in the result cache."""
        self.frontend.send(route, msg if isinstance(msg, list) else frames_of(msg))

    def to_executor(self, route: bytes, msg: Any) -> None:
        """An executor that vanished is dropped when its heartbeats stop."""
        self.backend.send(route, msg if isinstance(msg, list) else frames_of(msg))

    def key_of(self, route: bytes) -> str:
        """The CurveZMQ key the executor on ``route`` authenticated with ("" without CurveZMQ)."""
        return self.backend.key_of(route)

    def probe(self, route: bytes, msg: Any) -> bool:
        """Send ``msg`` to an executor; False if its connection is gone for certain."""
        return self.backend.probe(route, frames_of(msg))


def frames_of(msg: Any) -> list[bytes]:
    """``msg`` encoded; one too large to encode is answered ``output_limit`` instead."""
    try:
        return encode(msg)
    except ProtocolError as e:
        return encode(Result.failure(getattr(msg, "id", "") or "", "output_limit", str(e)))
