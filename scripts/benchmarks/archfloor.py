"""The floor of the executor's architecture (``weight.py`` runs it next to the executor): the same
processes and hops as a no-op call of ours, each doing nothing else. A client's DEALER sends a
msgpack call to a ROUTER process (the supervisor's place), which hands it to a worker over a
socketpair; the worker sends a start notice and a reply; the answer goes back. Workers are forked by
a template process, a child of the supervisor, that imported what our template imports (as the fork
floor's process does, and no more: ``archtemplate``) and sends each worker's channel to the
supervisor with ``SCM_RIGHTS``.

- ``fresh``: two workers are kept forked ahead, each rehearsing the call path once (as ours do,
  unless a call waits for it);
  each answers one call and stops; once the supervisor has been quiet for ``REFILL_QUIET`` (or a call
  finds no worker) it kills the answered ones and asks for new ones, as ours does. The template
  reaps them and reports their exits.
- ``reuse``: two workers answer call after call; the supervisor polls without sleeping for
  ``SPIN_AFTER_DISPATCH`` after a dispatch, as ours does.

Nothing else: no limits, no control groups, no stdout or stderr pipes, no pidfd, no checks of what
a peer sends, no at-most-once memory, no logging. What a call of ours costs beyond this is what our
features and our code cost; a target this floor itself misses is out of reach of the architecture.

    python -m scripts.benchmarks.archfloor supervisor ENDPOINT MODE   (prints ``ready``; ``stop`` ends it)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgpack
import zmq

from executor.slot import REFILL_MAX_DELAY, REFILL_QUIET, SPIN_AFTER_DISPATCH

from .archtemplate import HEADER, MODES, REPORT, frame
from .contestants import ECHO_BODY, ZmqEcho, start_peer
from .paths import ROOT, module_command

WORKERS = 2
STOP = b"stop"


class _Supervisor:
    def __init__(self, endpoint: str, mode: str) -> None:
        self.quiet, self.max_delay = REFILL_QUIET, REFILL_MAX_DELAY
        self.spin = SPIN_AFTER_DISPATCH if mode == "reuse" else 0.0
        self.fresh = mode == "fresh"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.chan, theirs = socket.socketpair()
        self.template = subprocess.Popen(module_command("archtemplate", str(theirs.fileno()), mode),
                                         cwd=ROOT, pass_fds=[theirs.fileno()])
        theirs.close()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.chan, zmq.POLLIN)
        self.ready: list[tuple[socket.socket, int]] = []  # (channel, pid)
        self.busy: dict[int, tuple[socket.socket, int, bytes, bytearray]] = {}
        self.answered: list[int] = []  # fresh workers stopped after their answer: killed at the next refill
        self.waiting: list[tuple[bytes, dict[str, Any]]] = []
        self.spin_until = 0.0
        self.missing, self.first_missing = WORKERS, 0.0

    def serve(self) -> None:
        while True:
            # Answered workers are replaced once no event came for ``quiet``, or ``max_delay`` after
            # the first answer (ours waits as long; a call that finds no worker does not wait).
            now = time.monotonic()
            if self.missing and now >= self.first_missing + self.max_delay:
                self._refill()
            timeout = None
            if self.missing:
                timeout = int(min(self.quiet, self.first_missing + self.max_delay - now) * 1000) + 1
            events = self.poller.poll(0 if now < self.spin_until else timeout)
            if not events and self.missing and now >= self.spin_until:
                self._refill()
            for sock, _ in events:
                if sock is self.sock:
                    route, body = self.sock.recv_multipart()
                    if body == STOP:
                        return
                    self.waiting.append((route, msgpack.unpackb(body)))
                    self._dispatch()
                elif sock == self.chan.fileno():  # (the poller gives plain sockets back as their fds)
                    self._on_template()
                else:
                    self._on_worker(sock)

    def _refill(self, urgent: bool = False) -> None:
        for pid in self.answered:
            os.kill(pid, signal.SIGKILL)
        self.answered.clear()
        self.chan.sendall((b"u" if urgent else b"s") * self.missing)
        self.missing = 0

    def _dispatch(self) -> None:
        while self.waiting and self.ready:
            (route, call), (worker, pid) = self.waiting.pop(0), self.ready.pop(0)
            worker.sendall(frame({"seq": 1, "tool": call["tool"], "args": call["args"], "kwargs": call["kwargs"]}))
            self.busy[worker.fileno()] = (worker, pid, route, bytearray())
            self.poller.register(worker, zmq.POLLIN)
            self.spin_until = time.monotonic() + self.spin
        if self.waiting and self.missing:
            self._refill(urgent=True)  # a call waits for a worker: no waiting for quiet, no rehearsal

    def _on_template(self) -> None:
        report, fds, _flags, _addr = socket.recv_fds(self.chan, REPORT.size, 1)
        if not report:
            raise SystemExit("the template exited")
        kind, pid = REPORT.unpack(report)
        if kind == b"W":
            self.ready.append((socket.socket(fileno=fds[0]), pid))
            self._dispatch()

    def _on_worker(self, fd: int) -> None:
        worker, pid, route, buf = self.busy[fd]
        buf += worker.recv(65536)
        while len(buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + size:
                return
            message = msgpack.unpackb(bytes(buf[HEADER.size:HEADER.size + size]))
            del buf[:HEADER.size + size]
            if "ok" not in message:
                continue  # the start notice
            self.sock.send_multipart([route, msgpack.packb({"id": ECHO_BODY["id"], "ok": message["ok"],
                                                            "value": message["value"]})])
            self.poller.unregister(worker)
            del self.busy[fd]
            if self.fresh:
                worker.close()
                self.answered.append(pid)
                if not self.missing:
                    self.first_missing = time.monotonic()
                self.missing += 1
            else:
                self.ready.append((worker, pid))
            self._dispatch()
            return

    def close(self) -> None:
        for pid in self.answered:  # stopped: they would never exit by themselves
            os.kill(pid, signal.SIGKILL)
        self.chan.close()
        self.template.wait(10)
        self.sock.close(0)
        self.ctx.term()


def supervisor(endpoint: str, mode: str) -> None:
    served = _Supervisor(endpoint, mode)
    print("ready", flush=True)
    try:
        served.serve()
    finally:
        served.close()


class ArchFloor(ZmqEcho):
    """A no-op call through the bare architecture (``mode``: fresh or reuse), from a plain DEALER
    (the echo's client loop): ``block(n)``; ``pid`` is its supervisor (for ``callpath.CpuMeter``)."""

    def __init__(self, mode: str, tmp: str) -> None:
        self.name = f"the bare architecture ({mode})"
        endpoint = f"ipc://{tmp}/archfloor-{mode}.sock"
        self._connect(start_peer("supervisor", endpoint, mode, module="archfloor"), endpoint, warm_up=20)

    def _check(self, answer: Any) -> None:
        if answer.get("ok") is not True:
            raise RuntimeError(f"{self.name} answered {answer!r}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["supervisor"] and len(argv) == 3 and argv[2] in MODES:
        supervisor(argv[1], argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
