"""``Wire``: raw DEALER sockets on an executor's endpoint, what a client sends without the client."""

from __future__ import annotations

import time

import zmq

from protocol import Body, Message, Ping, Pong, decode, encode


class Wire:
    """Raw DEALER sockets on an executor's endpoint: what a client sends, without the client."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket[bytes]] = []

    def socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self.socks.append(sock)
        return sock

    @staticmethod
    def send(sock: zmq.Socket[bytes], msg: Body | list[bytes]) -> None:
        sock.send_multipart(msg if isinstance(msg, list) else encode(msg))

    @staticmethod
    def receive(sock: zmq.Socket[bytes], within: float = 5.0) -> Message | None:
        """The next message on ``sock`` within ``within`` seconds, else None."""
        if not sock.poll(int(within * 1000), zmq.POLLIN):
            return None
        return decode(sock.recv_multipart())

    def ask(self, sock: zmq.Socket[bytes], msg: Body | list[bytes], within: float = 5.0) -> Message | None:
        self.send(sock, msg)
        return self.receive(sock, within)

    def ping(self, within: float = 1.0) -> Pong:
        """Ping on a fresh socket; fail unless a pong comes back within ``within`` seconds."""
        nonce = int(time.monotonic_ns() % 2**31)
        reply = self.ask(self.socket(), Ping(nonce=nonce), within)
        assert isinstance(reply, Pong), f"no pong within {within} s (got {reply!r})"
        assert reply.nonce == nonce
        return reply

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()
