"""Length-prefixed msgpack frames on the local stream sockets between supervisor, template and
workers. Internal to the executor (the public wire is ``protocol``); both ends are our own code, but
the worker end runs tool code, so the supervisor still bounds what it reads."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

_HEADER = struct.Struct("!I")
MAX_INTERNAL_FRAME = 128 * 1024 * 1024
_CHUNK = 1 << 16  # per recv: a larger buffer costs an allocation (an mmap) on every read


class FrameError(Exception):
    pass


def pack(obj: Any) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, obj: Any) -> None:
    sock.sendall(pack(obj))


def send_with_fds(sock: socket.socket, obj: Any, fds: list[int]) -> None:
    data = pack(obj)
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the channel")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> Any:
    """Blocking read of one frame (worker and template side)."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_INTERNAL_FRAME:
        raise FrameError(f"internal frame of {size} bytes is too large")
    return msgpack.unpackb(_recv_exact(sock, size), raw=False)


def recv_with_fds(sock: socket.socket, max_fds: int = 8) -> tuple[Any, list[int]]:
    """Blocking read of one frame that may carry file descriptors (supervisor <- template).

    The header is read alone so the descriptors (attached to the first bytes of a send) come with
    it and no byte of a following frame is consumed."""
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
    if not header:
        raise EOFError("peer closed the channel")
    if len(header) < _HEADER.size:
        header += _recv_exact(sock, _HEADER.size - len(header))
    (size,) = _HEADER.unpack(header)
    return msgpack.unpackb(_recv_exact(sock, size), raw=False), list(fds)


class Reader:
    """Non-blocking incremental reader for the supervisor's event loop."""

    def __init__(self, sock: socket.socket, limit: int = MAX_INTERNAL_FRAME) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.limit = limit

    def feed(self) -> tuple[list[Any], bool]:
        """Read what is available; return the complete frames and whether the peer closed."""
        closed = False
        try:
            while True:  # MSG_DONTWAIT: the socket stays blocking for sends
                chunk = self.sock.recv(_CHUNK, socket.MSG_DONTWAIT)
                if not chunk:
                    closed = True
                    break
                self.buf += chunk
                if len(chunk) < _CHUNK:
                    break
        except BlockingIOError:
            pass
        except OSError:
            closed = True
        frames = []
        while len(self.buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buf)
            if size > self.limit:
                raise FrameError(f"internal frame of {size} bytes is too large")
            if len(self.buf) < _HEADER.size + size:
                break
            body = bytes(self.buf[_HEADER.size : _HEADER.size + size])
            del self.buf[: _HEADER.size + size]
            try:
                frames.append(msgpack.unpackb(body, raw=False))
            except Exception as e:  # msgpack raises many types for malformed input
                raise FrameError(f"internal frame is not valid msgpack: {type(e).__name__}: {e}") from None
        return frames, closed
