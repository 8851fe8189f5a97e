"""The executor's bound ROUTER (``RouterEndpoint``), one of the two ``ClientSide`` implementations
(``executor.clientside.base``).

The bound ROUTER is private by default (SPEC.md, Transport): an ipc socket lives in a 0700 directory
owned by this user (created so, or checked), and abstract ipc or tcp without CurveZMQ is refused unless
the operator says ``--insecure``. No answer is dropped by a high-water mark: the socket is
``ROUTER_MANDATORY``, and what a client's pipe cannot take yet waits in its outbox, bounded in bytes
per client and in total (``executor.clientside.outbox``); this module binds, reads, and remembers
each client's connection and CurveZMQ key.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import resource
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from executor.clientside.base import (
    MAX_KNOWN_CONNECTIONS,
    OUTBOX_BYTES,
    OUTBOX_RETRY,
    RECV_BATCH,
    RECV_BUDGET_S,
    RECV_HWM,
    SEND_HWM,
    SHUTDOWN_LINGER_MS,
    EndpointError,
    Incoming,
)
from executor.clientside.outbox import Outboxes
from protocol import Message, ProtocolError, decode
from protocol.wire import MAX_FRAMES, LogBudget, bound_socket, ipc_path, recv_message_from

log = logging.getLogger("ciayn-executor")

HANDSHAKE_IVL_MS = 5000  # a connection that has not completed the ZMTP (and Curve) handshake is closed
OUTBOX_TOTAL_BYTES = 1024 * 1024 * 1024  # answers held for all clients together, at most
PIPE_CHECK = 1.0  # seconds between looks at which large answers ZeroMQ has sent
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # logged on a CurveZMQ endpoint


class RouterEndpoint:
    """A bound ROUTER socket, optionally CurveZMQ-authenticated; owns its ipc socket file."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, curve_secret: str | None = None,
                 curve_clients: str | None = None, insecure: bool = False, outbox_bytes: int = OUTBOX_BYTES,
                 outbox_total_bytes: int = OUTBOX_TOTAL_BYTES, handover: bool = True) -> None:
        """``handover``: a client reconnecting under its routing id takes it over (SPEC.md section 1).
        A broker's backend turns it off: executors never set routing ids, and with it a peer that
        learned or guessed a member's route could take over that member's connection."""
        self.endpoint = endpoint
        # route -> (descriptor, inode) of the connection it last spoke on, so that a client that does not
        # read its answers can be disconnected; bounded, oldest first.
        self.connections: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()
        # route -> the CurveZMQ public key its connection authenticated with (Z85); bounded, oldest first.
        self.keys: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.curve_secret = curve_secret
        self.curve_clients = curve_clients
        self.auth: Any = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.refusals = LogBudget(log, "refused CurveZMQ handshakes")
        self.failed = ""
        self.ipc_identity: tuple[int, int] | None = None
        self.check_endpoint(endpoint, curve=bool(curve_secret), insecure=insecure)
        raise_open_files_limit()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        bound_socket(sock)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if handover else 0)  # a client reconnecting takes its id over
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe raises Again instead of dropping the answer
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)  # libzmq counts messages, not bytes: keep its share small
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)  # likewise for what it reads ahead of the loop
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
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
        self.outboxes = Outboxes(sock, limit=outbox_bytes, total_limit=outbox_total_bytes,
                                 connected=self.connections, disconnect=self._disconnect)
        if curve_secret:  # so that the operator learns why a client gets nothing at all
            self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        path = self._ipc_path()
        self.ipc_identity = _file_identity(path) if path else None

    def describe(self) -> str:
        if not self.curve_secret:
            curve = "off"
        else:
            curve = f"clients in {self.curve_clients}" if self.curve_clients else "any client key"
        return f"{self.endpoint} (curve: {curve})"

    def start(self) -> None:
        """Nothing to do: clients that connected while the tools were imported are read from now on."""

    def receive(self) -> Iterator[Incoming]:
        """Messages waiting now, at most ``RECV_BATCH`` of them or ``RECV_BUDGET_S`` of receiving and
        decoding, so that a flood of costly bodies cannot keep the loop from pings, deadlines and
        workers. Only this generator's own time counts: handling a message (its caller's time) is
        bounded by the batch, and a caller descheduled while it handled one does not leave the next
        unread (a cancel read after the worker's death, which hands its queued call to a worker)."""
        spent = 0.0
        for _ in range(RECV_BATCH):
            if spent > RECV_BUDGET_S:
                return
            started = time.monotonic()
            # The routing frame, then the message.
            received = recv_message_from(self.socket, MAX_FRAMES + 1, user=self.curve_secret is not None)
            if received is None:
                return
            frames, fd, key = received
            if len(frames) < 2:
                continue
            route, body = frames[0], frames[1:]
            self._note_connection(route, fd)
            if key:
                self._note_key(route, key)
            self.outboxes.heard(route)
            try:
                message: Message | ProtocolError = decode(body)
            except ProtocolError as e:
                message = e
            spent += time.monotonic() - started
            yield route, message

    def send(self, route: bytes, frames: list[bytes]) -> None:
        """Send now, or hold for this client until its pipe has room (``Outboxes.send``)."""
        self.outboxes.send(route, frames)

    def key_of(self, route: bytes) -> str:
        """The CurveZMQ public key (Z85) ``route``'s connection authenticated with; "" without CurveZMQ
        or if it has not spoken lately."""
        return self.keys.get(route, "")

    def probe(self, route: bytes, frames: list[bytes]) -> bool:
        """Send ``frames`` to ``route``; False if ZeroMQ has no connection for it any more (its peer
        is gone for certain), True if it has (or an answer for it is waiting: then it had one lately)."""
        if route in self.outboxes.dropped:
            return False  # its connection was closed for not reading, and it has not spoken since
        if self.outboxes.holds(route):
            self.outboxes.send(route, frames)
            return True
        try:
            self.socket.send_multipart([route, *frames], zmq.NOBLOCK)
        except zmq.Again:
            return True  # its pipe is full: connected
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            log.warning("cannot send to %s: %s", route.hex()[:8], e)
        return True

    def _note_key(self, route: bytes, key: str) -> None:
        self.keys[route] = key
        self.keys.move_to_end(route)
        while len(self.keys) > MAX_KNOWN_CONNECTIONS:
            self.keys.popitem(last=False)

    def _note_connection(self, route: bytes, fd: int) -> None:
        if fd < 0:
            return
        known = self.connections.get(route)
        if known is not None and known[0] == fd:
            return
        with contextlib.suppress(OSError):
            self.connections[route] = (fd, os.fstat(fd).st_ino)
            self.connections.move_to_end(route)
            while len(self.connections) > MAX_KNOWN_CONNECTIONS:
                self.connections.popitem(last=False)

    def _disconnect(self, route: bytes) -> bool:
        """Close the connection ``route`` last spoke on (libzmq has no call for that: shut the socket
        down under it, after checking the descriptor still is that connection); it may come back."""
        known = self.connections.pop(route, None)
        if known is None:
            return False
        fd, inode = known
        try:
            if os.fstat(fd).st_ino != inode:
                return False  # that connection is gone and the number reused: leave it alone
            with socket.socket(fileno=os.dup(fd)) as conn:
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True

    def tick(self, now: float) -> float:
        """Send answers held for clients whose pipes were full, and forget large answers ZeroMQ has
        sent, and log refused CurveZMQ handshakes; a bound ROUTER has no other timers (clients ping it)."""
        if self.monitor is not None:
            self._log_handshake_failures()
        self.outboxes.flush()
        if self.outboxes.boxes:
            return OUTBOX_RETRY
        return PIPE_CHECK if self.outboxes.in_pipe or self.monitor is not None else float("inf")

    def _log_handshake_failures(self) -> None:
        """A client with a key the endpoint does not admit, or the wrong server key, gets nothing at
        all (CurveZMQ gives it no answer): say so here, at a bounded rate."""
        assert self.monitor is not None
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                where = f"in {self.curve_clients}" if self.curve_clients else "admitted"
                why = f"its public key is not {where} (authentication status {value})"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                why = "its handshake could not be decrypted: it is probably using another server public key"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                why = "it does not use CurveZMQ"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = f"it broke the handshake protocol (ZeroMQ protocol error {value:#x})"
            else:
                why = "it did not complete the handshake (closed or timed out)"
            self.refusals.warning("refused a connection on %s: %s", self.endpoint, why)

    def close(self) -> None:
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
        self.socket.close(linger=SHUTDOWN_LINGER_MS)
        if self.auth is not None:
            self.auth.stop()
        path = self._ipc_path()
        if path and self.ipc_identity is not None and _file_identity(path) == self.ipc_identity:
            with contextlib.suppress(OSError):
                os.unlink(path)  # only our own socket file, not one a later executor bound there

    def _ipc_path(self) -> str | None:
        return _ipc_path(self.endpoint)

    @classmethod
    def check_endpoint(cls, endpoint: str, *, curve: bool, insecure: bool) -> None:
        """Refuse an endpoint other local users could reach or take over, unless ``insecure``: an
        ipc socket outside a 0700 directory of this user (one that does not exist yet is created so),
        abstract ipc, tcp without CurveZMQ. Then refuse a live ipc endpoint (``check_free``)."""
        problem = ""
        if endpoint.startswith("ipc://@"):
            problem = ("an abstract socket has no owner or permissions, so any local user can connect to it (and "
                       "run these tools) or bind it first; use an ipc path in a private directory")
        elif endpoint.startswith("tcp://") and not curve:
            problem = ("tcp without CurveZMQ lets anyone who can reach it (on loopback: any local user) run these "
                       "tools; use --curve-secret and --curve-clients, or an ipc path in a private directory")
        elif (path := ipc_path(endpoint)) is not None:
            problem = _private_directory_problem(os.path.dirname(os.path.abspath(path)))
        if problem and not insecure:
            raise EndpointError(f"refusing to serve on {endpoint}: {problem} (or pass --insecure to serve anyway)")
        if problem:
            log.warning("serving insecurely (--insecure) on %s: %s", endpoint, problem)
        cls.check_free(endpoint)

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
    return ipc_path(endpoint)


def _private_directory_problem(directory: str) -> str:
    """Why ``directory`` is no private home for an ipc socket ("" if it is one). A missing directory
    is created with mode 0700."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create the socket's directory {directory}: {e}"
    st = os.stat(directory)
    if st.st_uid != os.geteuid():
        return f"the socket's directory {directory} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return (f"the socket's directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}: other users could "
                "connect to the socket, or replace it; use a directory with mode 0700")
    return ""


def raise_open_files_limit() -> None:
    """Raise RLIMIT_NOFILE as far as allowed (the hard limit, and as root the kernel's ``nr_open``, at
    most 2^20): each connection costs a descriptor, and libzmq aborts the process when its ipc
    listener's accept() fails with EMFILE (a connection flood from an allowed user). The residual risk
    is in SPEC.md."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = 1 << 20
    with contextlib.suppress(OSError, ValueError):
        ceiling = min(ceiling, int(Path("/proc/sys/fs/nr_open").read_text()))
    if hard == resource.RLIM_INFINITY:
        hard = ceiling
    for target in (max(ceiling, soft), hard):  # beyond the hard limit needs privilege; else up to it
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(target, hard)))
            return
        except (ValueError, OSError):
            continue


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
