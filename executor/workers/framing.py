"""Length-prefixed msgpack frames on the local stream sockets between supervisor, template and
workers. Internal to the executor (the public wire is ``protocol``); both ends are our own code, but
the worker end runs tool code, so the supervisor still bounds what it reads."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import msgpack

from protocol.values import unpack

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
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
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


def recv_with_fds(sock: socket.socket, max_fds: int = 8, limit: int = MAX_INTERNAL_FRAME) -> tuple[Any, list[int]]:
    """Read one frame that may carry file descriptors (supervisor <- template), of at most
    ``limit`` bytes (``FrameError`` from the header alone otherwise). It blocks as long as the
    socket's timeout allows (the caller sets one: a peer that sends half a frame must not hold it).

    The header is read alone so the descriptors (attached to the first bytes of a send) come with
    it and no byte of a following frame is consumed."""
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
    if not header:
        raise EOFError("peer closed the channel")
    if len(header) < _HEADER.size:
        header += _recv_exact(sock, _HEADER.size - len(header))
    (size,) = _HEADER.unpack(header)
    if size > limit:
        for fd in fds:
            os.close(fd)
        raise FrameError(f"internal frame of {size} bytes is over the {limit}-byte limit")
    try:
        return msgpack.unpackb(_recv_exact(sock, size), raw=False), list(fds)
    except Exception:
        for fd in fds:
            os.close(fd)
        raise


class Reader:
    """Non-blocking incremental reader for the supervisor's event loop, bounded before it reads: a
    frame that announces more than ``limit`` bytes is refused from its header alone, and no more
    than one frame's worth plus a header is ever buffered, however much the peer writes."""

    MAX_FRAMES_PER_FEED = 16

    def __init__(self, sock: socket.socket, limit: int = MAX_INTERNAL_FRAME, one: bool = False) -> None:
        """``one``: read one frame's bytes and no more (the header exactly, then the body), and
        return at most that frame per ``feed``: what follows stays in the socket (a template's
        messages after its start carry descriptors, read by ``recv_with_fds``)."""
        self.sock = sock
        self.buf = bytearray()
        self.limit = limit
        self.one = one

    def feed(self) -> tuple[list[Any], bool]:
        """Read what is available; return the complete frames and whether the peer closed. Raises
        ``FrameError`` for a frame over the limit or one that is not msgpack."""
        closed = False
        frames: list[Any] = []
        cap = 1 if self.one else self.MAX_FRAMES_PER_FEED
        while True:
            self._take_frames(frames)
            if len(frames) >= cap:
                break
            want = self._room()
            try:  # MSG_DONTWAIT: the socket stays blocking for sends
                chunk = self.sock.recv(min(_CHUNK, want), socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            self.buf += chunk
            if len(chunk) < min(_CHUNK, want):
                self._take_frames(frames)
                break
        return frames, closed

    def _room(self) -> int:
        """How many bytes the next read may take: the rest of the frame being read (at least a header)."""
        if len(self.buf) < _HEADER.size:
            return _HEADER.size - len(self.buf) + (0 if self.one else _CHUNK)
        size: int = _HEADER.unpack_from(self.buf)[0]
        return max(1, _HEADER.size + size - len(self.buf))

    def _take_frames(self, frames: list[Any]) -> None:
        while len(self.buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buf)
            if size > self.limit:
                raise FrameError(f"internal frame of {size} bytes is over the {self.limit}-byte limit")
            if len(self.buf) < _HEADER.size + size:
                return
            body = bytes(self.buf[_HEADER.size : _HEADER.size + size])
            del self.buf[: _HEADER.size + size]
            try:
                frames.append(unpack(body))  # bounded in work too: tool code shares the writer's process
            except Exception as e:  # msgpack raises many types for malformed input
                raise FrameError(f"internal frame is not valid msgpack: {type(e).__name__}: {e}") from None
