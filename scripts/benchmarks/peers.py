"""The other ends of the benchmarks, each run as its own process (``python -m scripts.benchmarks.peers
ROLE ...`` from the project root, ``contestants.start_peer``):

- ``zmq-echo ENDPOINT``: the floor. A ROUTER that answers each msgpack message with itself; a
  DEALER in the benchmark process talks to it (a bare pyzmq DEALER/ROUTER msgpack echo between two
  processes).
- ``chan-echo FD``: the floor of the executor's worker channel. Echoes length-prefixed msgpack
  frames (4-byte big-endian length, as the supervisor and its workers frame them) on an inherited
  stream socket.
- ``controller``: one controller of the pool benchmark. Reads one JSON command per line on stdin
  (endpoint, tool, kwargs, calls kept in flight, a start time on the shared monotonic clock and a
  duration), drives an ``ExecutorClient`` with that many calls in flight, and answers one JSON line
  with the calls completed inside the window. Exits at end of input.

Every peer prints ``ready`` once it can be used, and exits when its input ends.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import msgpack
import zmq

from .archtemplate import HEADER, recv_exact

STOP = b"stop"


def zmq_echo(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        ident, body = sock.recv_multipart()
        if body == STOP:
            break
        sock.send_multipart([ident, msgpack.packb(msgpack.unpackb(body))])
    sock.close(0)
    ctx.term()


def chan_echo(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    print("ready", flush=True)
    try:
        while True:
            (size,) = HEADER.unpack(recv_exact(sock, HEADER.size))
            body = msgpack.packb(msgpack.unpackb(recv_exact(sock, size)), use_bin_type=True)
            sock.sendall(HEADER.pack(len(body)) + body)
    except (EOFError, OSError):
        pass


def run_window(client: Any, command: dict[str, Any]) -> dict[str, Any]:
    """Keep ``inflight`` calls going from ``start_at - warmup`` to ``start_at + duration``; count the
    ones that completed inside [start_at, start_at + duration]."""
    from protocol import Call

    start, end = command["start_at"], command["start_at"] + command["duration"]
    call = Call(tool=command["tool"], kwargs=command.get("kwargs") or {})
    flying: set[Future[Any]] = set()
    done_in_window = errors = 0
    first_error = ""
    while True:
        now = time.monotonic()
        while now < end and len(flying) < command["inflight"]:
            flying.add(client.submit(call))
        if not flying:
            break
        finished, flying = wait(flying, timeout=30, return_when=FIRST_COMPLETED)
        if not finished:
            first_error = first_error or "no call finished within 30 s"
            break
        now = time.monotonic()
        for future in finished:
            result = future.result()
            if not result.ok:
                errors += 1
                first_error = first_error or f"{result.error.kind}: {result.error.message}"
            elif start <= now <= end:
                done_in_window += 1
    return {"calls": done_in_window, "errors": errors, "first_error": first_error,
            "rate": done_in_window / command["duration"]}


def controller() -> None:
    from controller import ExecutorClient

    print("ready", flush=True)
    clients: dict[str, Any] = {}
    try:
        for line in sys.stdin:
            command = json.loads(line)
            endpoint = command["endpoint"]
            if endpoint not in clients:
                for old in clients.values():
                    old.close()
                clients = {endpoint: ExecutorClient(endpoint, timeout=30)}
                clients[endpoint].tools()
            print(json.dumps(run_window(clients[endpoint], command)), flush=True)
    finally:
        for client in clients.values():
            client.close()


def main(argv: list[str]) -> int:
    role = argv[0] if argv else ""
    if role == "zmq-echo":
        zmq_echo(argv[1])
    elif role == "chan-echo":
        chan_echo(int(argv[1]))
    elif role == "controller":
        controller()
    else:
        print(f"usage: python -m scripts.benchmarks.peers zmq-echo ENDPOINT | chan-echo FD | controller (got {argv})",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
