"""ZeroMQ socket settings and the bounded receive both ends of a ``ciayn/1`` link use (see SPEC.md,
Transport). The codec stays free of zmq; this module is the one place that knows how a message comes
off a socket.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import Any, NamedTuple

import zmq

from protocol.codec import SOCKET_MAX_FRAME_BYTES

MAX_FRAMES = 3  # version, kind, body: a ROUTER adds one routing frame in front
LOG_BURST = 20  # complaints about a peer logged per window, at most...
LOG_WINDOW = 10.0  # ...seconds; the rest are counted and summed up in one line


class LogBudget:
    """Log lines about what a peer sent (malformed messages, refused handshakes), at most ``burst`` per
    ``window`` seconds; the rest are counted and reported in one line once the window is over, so a
    peer sending a flood of bad messages cannot fill the disk through our log. Not thread-safe: one
    per I/O loop."""

    def __init__(self, log: logging.Logger, what: str, *, burst: int = LOG_BURST, window: float = LOG_WINDOW) -> None:
        self.log = log
        self.what = what
        self.burst = burst
        self.window = window
        self.started = time.monotonic()
        self.logged = 0
        self.suppressed = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        self.flush(now)
        if self.logged < self.burst:
            self.logged += 1
            self.log.warning(message, *args)
        else:
            self.suppressed += 1

    def flush(self, now: float) -> None:
        """Start a new window once this one is over, reporting what it did not log."""
        if now - self.started < self.window:
            return
        if self.suppressed:
            self.log.warning("%d more %s in the last %.0f s were not logged (at most %d lines per %.0f s)",
                             self.suppressed, self.what, now - self.started, self.burst, self.window)
        self.started, self.logged, self.suppressed = now, 0, 0


def bound_socket(sock: zmq.Socket[Any]) -> None:
    """The per-frame size limit libzmq enforces (it drops a connection that sends a larger frame);
    set above the body cap so that a body somewhat over it gets a ``protocol`` reply instead."""
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_FRAME_BYTES)


def recv_message(sock: zmq.Socket[Any], max_frames: int = MAX_FRAMES) -> list[bytes] | None:
    """One message from ``sock`` without blocking, or None if none is waiting. At most
    ``max_frames + 1`` frames are copied out (so that ``decode`` reports "too many frames"); the rest
    of a message with more frames is read and dropped without copying. libzmq has already buffered
    the whole message by then: what bounds that is who may connect (SPEC.md, Transport)."""
    received = recv_message_from(sock, max_frames)
    return received.frames if received is not None else None


class Received(NamedTuple):
    """A message off a socket, and where it came from."""

    frames: list[bytes]
    fd: int  # the descriptor of the connection it came on (-1 if unknown)
    user: str  # with CurveZMQ: the sender's public key (Z85) as authenticated; else ""


def recv_message_from(sock: zmq.Socket[Any], max_frames: int = MAX_FRAMES, *, user: bool = False) -> Received | None:
    """``recv_message``, and the connection the message came on; with ``user``, the sender's
    authenticated CurveZMQ key too (the ``User-Id`` the ZAP handler gave its connection)."""
    try:
        first = sock.recv(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    frames = [first.bytes]
    last = first
    while last.more:
        last = sock.recv(copy=False)  # the rest of a multipart message is already here
        if len(frames) <= max_frames:
            frames.append(last.bytes)
    try:
        fd = int(last.get(zmq.SRCFD))
    except (zmq.ZMQError, ValueError, TypeError):
        fd = -1
    key = ""
    if user:
        try:
            key = str(last.get("User-Id"))
        except (zmq.ZMQError, ValueError, TypeError, UnicodeDecodeError):
            key = ""  # no CurveZMQ on this connection: no metadata
    return Received(frames, fd, key)


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint; None for tcp and for abstract ``ipc://@name``."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    return path if path and not path.startswith("@") else None


def ipc_owner_problem(path: str) -> str:
    """Why a client must not trust the ipc socket file at ``path`` ("" if it may). The socket must
    belong to this user (or root), and its directory must not let another user replace it: owned by
    this user or root, and not writable by others unless sticky (like /tmp, where only a file's owner
    may remove it). A socket that does not exist yet is no problem here (it is checked again when it
    answers: the client reconnects through this check)."""
    me = os.geteuid()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"cannot inspect the executor socket {path}: {e}"
    if st.st_uid not in (me, 0):
        return (f"the executor socket {path} belongs to uid {st.st_uid}, not to this user (uid {me}) or root: "
                "another user may be impersonating the executor; refusing to connect")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        dst = os.stat(directory)
    except OSError as e:
        return f"cannot inspect the directory of the executor socket {path}: {e}"
    if dst.st_uid not in (me, 0):
        return f"the directory {directory} of the executor socket belongs to uid {dst.st_uid}; refusing to connect"
    if dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not dst.st_mode & stat.S_ISVTX:
        return (f"the directory {directory} of the executor socket is writable by other users, who could "
                "replace the socket; use a private (0700) directory")
    return ""
