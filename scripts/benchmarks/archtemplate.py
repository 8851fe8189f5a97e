"""The far side of ``archfloor``'s bare architecture: its template and workers, run as
``python -m scripts.benchmarks.archtemplate CHANNEL_FD MODE`` by the floor's supervisor.

A module of its own so that the template maps what ours maps and no more: the executor's worker
side and the tool module (as the fork floor's process does), msgpack and the standard library; no
ZeroMQ, no controller, no benchmark harness. A bigger template would make each fork, and so the
floor, dearer than ours.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import sys
from typing import Any

import msgpack

from .paths import HERE

HEADER = struct.Struct("!I")  # a frame's length, as the supervisor and its workers frame them (and peers.chan-echo)
REPORT = struct.Struct("!cQ")  # b"W" (a worker, its channel attached) or b"E" (one exited), and its pid
MODES = ("fresh", "reuse")


def frame(obj: Any) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _answer(chan: socket.socket) -> bool:
    """Read a request, send the start notice and the reply; False at end of input."""
    try:
        (size,) = HEADER.unpack(recv_exact(chan, HEADER.size))
        request = msgpack.unpackb(recv_exact(chan, size))
    except EOFError:
        return False
    chan.sendall(frame({"seq": request["seq"]}))
    chan.sendall(frame({"seq": request["seq"], "ok": True, "value": None, "wall_s": 0.0}))
    return True


def _worker(chan: socket.socket, reuse: bool, rehearse: bool) -> None:
    if reuse:
        while _answer(chan):
            pass
        return
    # As ours: a rehearsal takes the call path's copy-on-write faults before the call, and once
    # answered the worker stops until the supervisor kills it (its exit then costs no answer time).
    if rehearse:
        ours, theirs = socket.socketpair()
        ours.sendall(frame({"seq": 0, "tool": "noop", "args": [], "kwargs": {}}))
        _answer(theirs)
        ours.close()
        theirs.close()
    if _answer(chan):
        os.kill(os.getpid(), signal.SIGSTOP)


def _report(chan: socket.socket, report: bytes, fd: int | None = None) -> bool:
    """Send a report (with a descriptor); False once the supervisor is gone."""
    try:
        socket.send_fds(chan, [report], [fd] if fd is not None else [])
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def template(fd: int, mode: str) -> None:
    """Fork a worker per request byte; report each worker (with its channel) and each exit."""
    import executor.workers.template  # noqa: F401  (what our template has imported)
    from executor.registry import find_tools
    from executor.workers import quickfork

    find_tools([str(HERE / "tools.py")])
    chan = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([chan.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, _status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if not _report(chan, REPORT.pack(b"E", pid)):
                    return
        if chan.fileno() in ready:
            try:
                request = chan.recv(1)  # b"s": a worker made ahead (it rehearses); b"u": one a call waits for
            except ConnectionResetError:
                return
            if not request:
                return
            ours, theirs = socket.socketpair()
            pid = quickfork.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                ours.close()
                chan.close()
                _worker(theirs, mode == "reuse", rehearse=request == b"s")
                os._exit(0)
            theirs.close()
            sent = _report(chan, REPORT.pack(b"W", pid), ours.fileno())
            ours.close()
            if not sent:
                return


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in MODES:
        print(__doc__, file=sys.stderr)
        return 2
    template(int(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
