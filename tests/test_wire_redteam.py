"""Red team on the wire: a hostile client against real executors and brokers, and a hostile server
against ``ExecutorClient``. Each test is an attack that broke something, kept so it stays fixed (or
marked ``xfail(strict=True)`` with its reproduction when the fix belongs to code outside the wire).

The hostile server is a plain ROUTER socket in a thread, speaking just enough ``ciayn/1`` to be
believed; everything else is a real executor or broker process on a real socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from controller import ExecutorClient
from protocol import VERSION, Call, Hello, Ping, Pong, decode, encode
from protocol.wire import LOG_BURST

Handler = Callable[[bytes, Any], list[list[bytes]]]


def _welcome(incarnation: int = 1) -> list[bytes]:
    return [VERSION, b"welcome", msgpack.packb({"executor": "evil", "incarnation": incarnation,
                                                "tools": [{"name": "t", "signature": "()"}], "limits": {}})]


class FakeExecutor:
    """A hostile executor: answers ``hello`` with a welcome, ``ping`` with a pong, and every call with
    what ``on_call(route, call)`` returns (raw frames, sent as they are). Counts the hellos it got."""

    def __init__(self, endpoint: str, on_call: Handler) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(endpoint)
        self.on_call = on_call
        self.hellos = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            route, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            replies: list[list[bytes]] = []
            if isinstance(msg, Hello):
                self.hellos += 1
                replies = [_welcome()]
            elif isinstance(msg, Ping):
                replies = [encode(Pong(nonce=msg.nonce, executor="evil", incarnation=1))]
            elif isinstance(msg, Call):
                replies = self.on_call(route, msg)
            for reply in replies:
                self.sock.send_multipart([route, *reply])
        self.sock.close(0)
        self.ctx.term()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def fake() -> Iterator[Callable[[Handler], tuple[FakeExecutor, ExecutorClient]]]:
    """``fake(on_call)``: a hostile executor on a private ipc socket and a connected client."""
    made: list[tuple[FakeExecutor, ExecutorClient]] = []
    directory = Path(f"/tmp/ciayn-redteam-{uuid.uuid4().hex[:8]}")
    directory.mkdir(mode=0o700)

    def make(on_call: Handler) -> tuple[FakeExecutor, ExecutorClient]:
        server = FakeExecutor(f"ipc://{directory}/evil-{len(made)}.sock", on_call)
        client = ExecutorClient(f"ipc://{directory}/evil-{len(made)}.sock", connect_timeout=5)
        made.append((server, client))
        client.tools()
        return server, client

    yield make
    for server, client in made:
        client.close()
        server.close()
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()


def _result(body: dict[str, Any]) -> list[bytes]:
    return [VERSION, b"result", msgpack.packb(body)]


# --------------------------------------------------------------------------- hostile server vs client


@pytest.mark.parametrize("body", [{"ok": False}, {"ok": True, "error": {"kind": "crashed", "message": "x"}}],
                         ids=["failed-without-error", "ok-with-error"])
def test_a_result_that_contradicts_itself_is_answered_protocol(
    fake: Callable[[Handler], tuple[FakeExecutor, ExecutorClient]], body: dict[str, Any]
) -> None:
    """Attack: a result ``{"id": ..., "ok": false}`` with no error (or ok with an error). Before, the
    client handed it on as it was, and ``ciayn call`` died on ``assert result.error is not None``;
    any caller reading ``result.error.kind`` after ``not result.ok`` crashed the same way."""
    _, client = fake(lambda route, call: [_result({"id": call.id, **body})])
    result = client.call(Call(tool="t"), timeout=5)
    assert not result.ok and result.error is not None and result.error.kind == "protocol", result
    assert "ok is" in result.error.message


def test_an_executor_changing_incarnation_on_every_pong_gets_a_bounded_number_of_hellos_and_log_lines(
    fake: Callable[[Handler], tuple[FakeExecutor, ExecutorClient]], caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: answer a call with 20,000 pongs, each claiming a new incarnation. Before, the client
    sent a ``hello`` for every one of them and logged a warning for each (21,000 lines in 3 s into the
    calling program's log). Now it asks for the tools once a heartbeat and its complaints are capped
    per window; the call is still answered (``unavailable``: the executor says it restarted)."""
    incarnations = iter(range(2, 10**9))

    def churn(route: bytes, call: Any) -> list[list[bytes]]:
        return [encode(Pong(nonce=1, executor="evil", incarnation=next(incarnations))) for _ in range(20_000)]

    caplog.set_level(logging.WARNING, logger="ciayn.client")
    server, client = fake(churn)
    hellos_before = server.hellos
    started = time.monotonic()
    result = client.call(Call(tool="t"), timeout=5)
    assert result.error is not None and result.error.kind == "unavailable", result
    deadline = time.monotonic() + 20
    while server.thread.is_alive() and time.monotonic() < deadline and client.welcome is not None \
            and client.welcome.incarnation == 1 and server.hellos == hellos_before:
        time.sleep(0.05)
    time.sleep(1.0)  # let the rest of the flood arrive: what is measured is what it caused
    elapsed = time.monotonic() - started
    hellos = server.hellos - hellos_before
    assert 1 <= hellos <= elapsed / 0.5 + 3, (hellos, elapsed)
    lines = [r for r in caplog.records if r.name == "ciayn.client"]
    assert len(lines) <= LOG_BURST * (elapsed / 10 + 2), len(lines)


def test_a_flood_of_malformed_messages_is_logged_at_a_bounded_rate(
    fake: Callable[[Handler], tuple[FakeExecutor, ExecutorClient]], caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: answer a call with 20,000 results the client cannot decode. Before, every one was a
    warning line in the calling program's log. Now at most ``LOG_BURST`` a window; the call itself
    times out on the client's bound as before."""
    caplog.set_level(logging.WARNING, logger="ciayn.client")
    _, client = fake(lambda route, call: [[VERSION, b"result", b"\xc1"] for _ in range(20_000)])
    started = time.monotonic()
    result = client.call(Call(tool="t"), timeout=0.5)
    assert result.error is not None and result.error.kind == "timeout"
    elapsed = time.monotonic() - started
    lines = [r for r in caplog.records if "malformed message" in r.getMessage()]
    assert 1 <= len(lines) <= LOG_BURST * (elapsed / 10 + 2), len(lines)


# --------------------------------------------------------------------------- hostile clients vs executor


@pytest.fixture
def private_dir() -> Iterator[Path]:
    directory = Path(f"/tmp/ciayn-redteam-{uuid.uuid4().hex[:8]}")
    directory.mkdir(mode=0o700)
    yield directory
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()


def test_clients_that_do_not_read_cannot_make_the_endpoint_hold_more_than_its_total_bound(
    private_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: many routing identities, each connected and never reading, each sent answers of 1 MiB.
    Before, each identity could hold its outbox bound *plus* ``SEND_HWM`` answers of any size in
    ZeroMQ's pipe (copied there), and nothing bounded the sum over identities: against a real executor,
    3 identities x 120 calls of ``huge_string(mb=3)`` took its RSS from 47 MB to 1,021 MB. Now what is
    held for a client counts what ZeroMQ holds for it, and all clients together have a bound: past it
    the heaviest is dropped and disconnected. A client that reads gets every answer meanwhile."""
    import psutil

    from executor.endpoint import RouterEndpoint

    mib = 1024 * 1024
    caplog.set_level(logging.WARNING, logger="ciayn-executor")
    ctx = zmq.Context()
    endpoint = RouterEndpoint(ctx, f"ipc://{private_dir}/exec.sock", outbox_bytes=16 * mib,
                              outbox_total_bytes=40 * mib)
    poller = zmq.Poller()
    poller.register(endpoint.socket, zmq.POLLIN)
    me = psutil.Process()
    socks = []

    def joined(sock: zmq.Socket[bytes], nonce: int) -> bytes:
        sock.send_multipart(encode(Ping(nonce=nonce)))
        assert poller.poll(10_000)
        (route, ping), = list(endpoint.receive())
        assert isinstance(ping, Ping) and ping.nonce == nonce
        return route

    try:
        reader = ctx.socket(zmq.DEALER)
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(endpoint.endpoint)
        socks.append(reader)
        reader_route = joined(reader, 0)
        routes = []
        for i in range(8):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(endpoint.endpoint)
            socks.append(sock)
            routes.append(joined(sock, i + 1))
        before = me.memory_info().rss
        peak = before
        received = 0
        for n in range(30):
            for route in routes:
                endpoint.send(route, [VERSION, b"result", os.urandom(1) * mib])  # a fresh MiB each time
                endpoint.tick(time.monotonic())
            endpoint.send(reader_route, [VERSION, b"result", bytes([n]) * 100_000])
            while reader.poll(0):
                received += reader.recv_multipart()[-1][:1] != b""
            peak = max(peak, me.memory_info().rss)
            assert endpoint.held_total <= 40 * mib + mib, endpoint.held_total
        deadline = time.monotonic() + 10
        while received < 30 and time.monotonic() < deadline:
            endpoint.tick(time.monotonic())
            if reader.poll(50):
                received += 1
                reader.recv_multipart()
        assert received == 30, received
        grown = (peak - before) / mib
        assert grown < 40 + 16 + 24, f"the endpoint's process grew by {grown:.0f} MiB"
        warnings = [r.getMessage() for r in caplog.records if "does not read its answers" in r.getMessage()]
        assert any("heaviest" in w for w in warnings), warnings
    finally:
        for sock in socks:
            sock.close(0)
        endpoint.close()
        ctx.term()
