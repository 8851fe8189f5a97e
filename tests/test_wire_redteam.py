"""Red team on the wire: a hostile client against real executors and brokers, and a hostile server
against ``ExecutorClient``. Each test is an attack that broke something, kept so it stays fixed.

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
from protocol import VERSION, Call, Hello, Ping, Pong, Result, decode, encode
from protocol.wire import LOG_BURST
from tests.support.net import free_port
from tests.support.waiting import wait_until

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
                self.sock.send_multipart([route, *reply], copy=False)  # the same body sent again costs no memory
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
    the heaviest is dropped and disconnected (what its connection held counts as freed, so that a
    client that reads is never dropped for it). A client that reads gets every answer meanwhile."""
    import psutil

    from executor.clientside.router import RouterEndpoint

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
        deadline = time.monotonic() + 10
        while (received < 30 or endpoint.outboxes.held_total > 40 * mib) and time.monotonic() < deadline:
            endpoint.socket.poll(0)  # as the executor's loop does: ZeroMQ frees a closed connection's pipe
            endpoint.tick(time.monotonic())  # a dropped client's pipe counts until ZeroMQ has freed it
            if reader.poll(50):
                received += 1
                reader.recv_multipart()
        assert received == 30, received
        assert endpoint.outboxes.held_total <= 40 * mib, endpoint.outboxes.held_total
        grown = (peak - before) / mib
        # the total, what dropped clients' connections held until ZeroMQ freed it, one client's share
        assert grown < 2 * 40 + 16 + 24, f"the endpoint's process grew by {grown:.0f} MiB"
        warnings = [r.getMessage() for r in caplog.records if "does not read its answers" in r.getMessage()]
        assert any("heaviest" in w for w in warnings), warnings
    finally:
        for sock in socks:
            sock.close(0)
        endpoint.close()
        ctx.term()


def _flood_malformed(endpoint: str, n: int) -> float:
    """Send ``n`` calls whose body is not msgpack from one raw client and read every answer (each a
    ``protocol`` result); return the seconds it took."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    started = time.monotonic()
    answered = 0
    try:
        for _ in range(n):
            sock.send_multipart([VERSION, b"call", b"\xc1" + b"A" * 200])
            while sock.poll(0):
                sock.recv_multipart()
                answered += 1
        while answered < n and sock.poll(10_000):
            reply = decode(sock.recv_multipart())
            assert isinstance(reply, Result) and reply.error is not None and reply.error.kind == "protocol", reply
            answered += 1
        assert answered == n, answered
        return time.monotonic() - started
    finally:
        sock.close(0)
        ctx.term()


def _complaint_lines(log_text: str) -> int:
    return sum("protocol error from client" in line for line in log_text.splitlines())


def test_a_flood_of_malformed_messages_is_logged_at_a_bounded_rate_by_the_broker(tmp_path: Path) -> None:
    """Attack: 5,000 calls whose body is not msgpack, against a broker's frontend. Before, each was a
    warning line in the broker's log (about 140 bytes each, 4,000 a second: a client could fill the
    broker's disk). Each is still answered ``protocol``; the log holds at most ``LOG_BURST`` lines a
    window, then a line counting the rest. The broker then serves a normal call."""
    from tests.support.pool import Pool

    pool = Pool(tmp_path)
    try:
        pool.start_broker()
        pool.add_executor()
        pool.wait_for_executors(1)
        elapsed = _flood_malformed(pool.frontend, 5000)
        assert pool.broker is not None
        lines = _complaint_lines(pool.log(pool.broker))
        assert 1 <= lines <= LOG_BURST * (elapsed / 10 + 2), (lines, elapsed)
        with ExecutorClient(pool.frontend, connect_timeout=10) as client:
            result = client.call(Call(tool="work", args=["redteam"]), timeout=10)
            assert result.ok, result
    finally:
        pool.stop()


def test_a_flood_of_malformed_messages_is_logged_at_a_bounded_rate_by_the_executor(
    make_client: Callable[..., ExecutorClient]
) -> None:
    """Attack: 5,000 calls whose body is not msgpack against a real executor. Before, each was a
    warning line in its log (50,000 made 6.8 MB in 13 s). Fixed in the supervisor (bc56675) with
    ``LogBudget``; each is still answered ``protocol`` and a normal call is served after."""
    client = make_client()
    local = client.local  # type: ignore[attr-defined]
    elapsed = _flood_malformed(local.endpoint, 5000)
    assert client.call(Call(tool="noop"), timeout=10).ok
    lines = _complaint_lines(local.log_path.read_text(errors="replace"))
    assert 1 <= lines <= LOG_BURST * (elapsed / 10 + 2), (lines, elapsed)


def test_one_client_flooding_an_executor_delays_another_by_at_most_one_call(
    make_client: Callable[..., ExecutorClient]
) -> None:
    """Attack: one client queues 30 calls of ``nap(0.3)`` on ``serve --workers 1``. Before, another
    client's call waited behind all of them (9 s) and was answered ``unavailable`` at its 3 s
    timeout: the queue was first come, first served. Fixed in the call table (d0857fe): clients are
    served in turn, as the broker serves them."""
    flooder = make_client(workers=1, reuse_workers=True)
    local = flooder.local  # type: ignore[attr-defined]
    flood = [flooder.submit(Call(tool="nap", args=[0.3]), timeout=60) for _ in range(30)]
    with ExecutorClient(local.endpoint, connect_timeout=10) as other:
        other.tools()
        deadline = time.monotonic() + 10
        while not any(f.done() for f in flood) and time.monotonic() < deadline:
            time.sleep(0.01)  # the flood is queued and running
        started = time.monotonic()
        result = other.call(Call(tool="noop"), timeout=3)
        assert result.ok, result
        assert time.monotonic() - started < 0.3 * 2 + 1.0
    for f in flood:
        f.result()


def test_a_client_refused_by_curvezmq_is_logged_with_the_reason(tmp_path: Path) -> None:
    """Attack: clients with a key the executor does not admit, with the wrong server key, and without
    CurveZMQ at all, against ``serve --curve-secret --curve-clients``. Each gets nothing, as it must;
    before, the executor's log said nothing either, so an operator could not tell why a controller
    got no answer. Now each refusal is a warning naming the reason (at a bounded rate); an admitted
    client is then served."""
    import subprocess
    import sys

    from protocol.curve import keygen, load_pair, load_public

    server_pub, server_sec = keygen(tmp_path / "server", "server")
    _, client_sec = keygen(tmp_path / "clients", "alice")
    _, stranger_sec = keygen(tmp_path / "strangers", "mallory")
    other_pub, _ = keygen(tmp_path / "strangers", "other-server")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "executor.cli", "serve", "--tools", "executor.toolkits.builtin",
                                 "--bind", endpoint, "--curve-secret", str(server_sec), "--curve-clients",
                                 str(tmp_path / "clients")], stdout=out, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    try:
        with ExecutorClient(endpoint, curve_server_key=load_public(server_pub), curve_keys=load_pair(client_sec),
                            connect_timeout=30) as admitted:
            admitted.tools()  # the executor is up
        # Without CurveZMQ first, alone: libzmq reports it as a mechanism mismatch or, when the peer
        # goes before the greetings are exchanged, with no detail; either way one refusal is logged.
        attempts = [("no curve", None, ("does not use CurveZMQ", "did not complete the handshake")),
                    ("not admitted", (load_public(server_pub), load_pair(stranger_sec)), ("is not in",)),
                    ("wrong server key", (load_public(other_pub), load_pair(client_sec)),
                     ("another server public key",))]
        seen = 0
        for name, keys, reasons in attempts:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                sock.curve_serverkey, (sock.curve_publickey, sock.curve_secretkey) = keys
            sock.connect(endpoint)
            sock.send_multipart(encode(Ping(nonce=1)))
            assert not sock.poll(1000), f"{name}: answered"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                text = log_path.read_text(errors="replace")
                lines = [line for line in text.splitlines() if "refused a connection" in line]
                if any(r in line for line in lines[seen:] for r in reasons):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"{name}: refusal not logged with its reason {reasons}: {lines}")
            sock.close(0)
            seen = len(lines)
        with ExecutorClient(endpoint, curve_server_key=load_public(server_pub), curve_keys=load_pair(client_sec),
                            connect_timeout=10) as admitted:
            assert admitted.call(Call(tool="list_dir", kwargs={"path": "."}), timeout=10).error is None
    finally:
        ctx.term()
        proc.terminate()
        proc.wait(10)


def test_a_server_pushing_large_messages_cannot_fill_the_clients_memory(
    fake: Callable[[Handler], tuple[FakeExecutor, ExecutorClient]]
) -> None:
    """Attack: answer a call with 100 results of 48 MiB each, for an id the client never sent, as fast
    as the socket takes them. ZeroMQ reads ahead of the client's I/O thread up to the receive
    high-water mark (1,000 messages by default), so before, the client's process grew by gigabytes
    (3.1 GB at the peak for 100 messages of 60 MiB). Now it reads at most ``RECV_HWM`` ahead; the
    rest waits on the server's side. The call is answered by its deadline as always."""
    import psutil

    body = msgpack.packb({"id": "never-asked", "ok": True, "value": "x" * (48 << 20)})
    _, client = fake(lambda route, call: [[VERSION, b"result", body] for _ in range(100)])
    me = psutil.Process()
    before = me.memory_info().rss
    peak = before
    future = client.submit(Call(tool="t"), timeout=3)
    while not future.done():
        peak = max(peak, me.memory_info().rss)
        time.sleep(0.005)
    assert future.result().error is not None and future.result().error.kind == "timeout"  # type: ignore[union-attr]
    grown = (peak - before) / (1 << 20)
    assert grown < 500, f"the client grew by {grown:.0f} MiB"  # RECV_HWM (4) messages read ahead, and copies


def test_a_client_pushing_large_calls_cannot_fill_the_executors_memory(
    make_client: Callable[..., ExecutorClient]
) -> None:
    """Attack: one raw client sends 40 calls of 60 MiB each (valid msgpack, the same id, arguments the
    tool refuses) without waiting. ZeroMQ read them ahead of the executor's loop up to its receive
    high-water mark (1,000 messages by default): the supervisor grew by 2,760 MiB for 60 such calls. Now it reads at
    most ``RECV_HWM`` ahead per connection (479 MiB at the peak); every call is answered and the
    executor then serves a normal call."""
    import psutil

    client = make_client(reuse_workers=True)
    local = client.local  # type: ignore[attr-defined]
    supervisor = psutil.Process(local.proc.pid)
    body = msgpack.packb({"id": "big-1", "tool": "noop", "args": ["x" * (60 << 20)]})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(local.endpoint)
    try:
        before = supervisor.memory_info().rss
        peak = before
        for _ in range(40):
            sock.send_multipart([VERSION, b"call", body], copy=False)  # the same bytes: no copy here
        answered = 0
        deadline = time.monotonic() + 120
        while answered < 40 and time.monotonic() < deadline:
            peak = max(peak, supervisor.memory_info().rss)
            if sock.poll(10):
                reply = decode(sock.recv_multipart())
                assert isinstance(reply, Result) and reply.error is not None
                assert reply.error.kind == "bad_arguments", reply
                answered += 1
        assert answered == 40
        grown = (peak - before) / (1 << 20)
        assert grown < 1000, f"the executor grew by {grown:.0f} MiB"
        assert client.call(Call(tool="noop"), timeout=10).ok
    finally:
        sock.close(0)
        ctx.term()


def test_a_broker_pushing_large_calls_cannot_fill_a_linked_executors_memory(private_dir: Path) -> None:
    """Attack (a hostile broker, which an executor's link connects to): once the executor has
    announced itself, send it 40 calls of 60 MiB each (arguments its tool refuses) without waiting,
    heartbeating all along so it keeps the connection. The link set no receive high-water mark, so
    ZeroMQ read them ahead of the executor's loop up to its default of 1,000 messages (the executor
    grew by 1.7-2.1 GB); now it reads at most ``RECV_HWM`` ahead (480 MiB at the peak), the rest wait
    on the broker's side, and every call is answered ``bad_arguments``."""
    import psutil

    from protocol import Heartbeat, Ready
    from tests.support.pool import POOL_TOOLS, Pool

    backend = f"ipc://{private_dir}/backend.sock"
    ctx = zmq.Context()
    broker = ctx.socket(zmq.ROUTER)
    broker.setsockopt(zmq.LINGER, 0)
    broker.setsockopt(zmq.SNDHWM, 0)
    broker.bind(backend)
    pool = Pool(private_dir, backend=backend)
    try:
        proc = pool.add_executor([POOL_TOOLS], 1)
        assert broker.poll(30_000), "the executor did not announce itself"
        route, *frames = broker.recv_multipart()
        assert isinstance(decode(frames), Ready)
        beat = encode(Heartbeat(executor="broker"))
        executor = psutil.Process(proc.pid)
        before = peak = executor.memory_info().rss
        body = msgpack.packb({"id": "big-1", "tool": "work", "kwargs": {"tag": "x", "nope": "x" * (60 << 20)}})
        for _ in range(40):
            broker.send_multipart([route, VERSION, b"call", body], copy=False)  # the same bytes: no copy here
        answered, next_beat = 0, 0.0
        deadline = time.monotonic() + 120
        while answered < 40 and time.monotonic() < deadline:
            peak = max(peak, executor.memory_info().rss)
            if time.monotonic() >= next_beat:
                broker.send_multipart([route, *beat])
                next_beat = time.monotonic() + 0.3
            if broker.poll(10):
                _, *frames = broker.recv_multipart()
                reply = decode(frames)
                if isinstance(reply, Result):
                    assert reply.error is not None and reply.error.kind == "bad_arguments", reply
                    answered += 1
        assert answered == 40
        grown = (peak - before) / (1 << 20)
        assert grown < 1000, f"the executor grew by {grown:.0f} MiB"
        assert proc.poll() is None
    finally:
        pool.stop()
        broker.close(0)
        ctx.term()


def test_a_pool_never_grows_past_the_tools_a_welcome_may_list(tmp_path: Path) -> None:
    """Two executors with 600 different tools each: together over the 1024 a welcome may list (the
    broker's welcome would no longer be valid). The second is refused, told why."""
    from protocol import Bye, Heartbeat, Limits, Ready, ToolSpec
    from tests.support.pool import Pool

    pool = Pool(tmp_path)
    ctx = zmq.Context()
    try:
        pool.start_broker()
        socks = []
        for k in range(2):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pool.backend)
            tools = [ToolSpec(name=f"e{k}-t{i}", signature="()") for i in range(600)]
            sock.send_multipart(encode(Ready(executor=f"e{k}", incarnation=1, tools=tools, limits=Limits())))
            socks.append(sock)
            if k == 0:  # the broker's first heartbeat to it: it joined
                assert sock.poll(10_000) and isinstance(decode(sock.recv_multipart()), Heartbeat)

        def bye_to(sock: zmq.Socket[bytes], within: float) -> Bye | None:
            deadline = time.monotonic() + within
            while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
                msg = decode(sock.recv_multipart())  # heartbeats meanwhile
                if isinstance(msg, Bye):
                    return msg
            return None

        bye = bye_to(socks[1], 10.0)
        assert bye is not None and bye.refused and "over the 1024" in bye.reason, bye
        assert bye_to(socks[0], 0.5) is None, "the first executor, within the bound, was sent away"
    finally:
        ctx.destroy(0)
        pool.stop()


def test_an_executor_announcing_thousands_of_tools_does_not_stall_the_broker(tmp_path: Path) -> None:
    """Attack (a hostile executor on the broker's backend): two executors each announce the same
    tools, as many as a ``ready`` may carry (1024), and a third 12,000. Checking the second against
    the first compared each tool with a linear search of the other's tools: quadratic, so with 12,000
    tools each the broker's loop stalled for 10-20 s, answering no client meanwhile. Now the check is
    linear, and a ``ready`` of more than 1024 tools is refused as malformed: the two join, the third
    does not, and every ``status`` is answered within 5 s."""
    from protocol import Limits, Ready, Report, Status, ToolSpec
    from protocol.spec import MAX_TOOLS
    from tests.support.pool import Pool

    pool = Pool(tmp_path)
    ctx = zmq.Context()
    try:
        pool.start_broker()
        tools = [ToolSpec(name=f"t{i}", signature="()") for i in range(MAX_TOOLS)]
        fakes = []
        for _ in range(3):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pool.backend)
            fakes.append(sock)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(pool.frontend)
        client.send_multipart(encode(Status()))
        assert client.poll(30_000), "the broker does not answer status"
        client.recv_multipart()
        for k, sock in enumerate(fakes[:2]):
            sock.send_multipart(encode(Ready(executor=f"evil-{k}", incarnation=1, tools=tools, limits=Limits())))
        too_many = [ToolSpec(name=f"t{i}", signature="()") for i in range(12_000)]
        fakes[2].send_multipart(encode(Ready.model_construct(executor="evil-2", incarnation=1, tools=too_many,
                                                             limits=Limits(), capacity=1, held=[],
                                                             profile="default", apply_grace_s=0.0)))

        def executors() -> int:
            started = time.monotonic()
            client.send_multipart(encode(Status()))
            assert client.poll(5_000), f"the broker stalled: still silent after {time.monotonic() - started:.1f} s"
            report = decode(client.recv_multipart())
            assert isinstance(report, Report), report
            return len(report.executors)

        wait_until("the two executors to join", lambda: executors() == 2, timeout=30)
        assert executors() == 2, "the executor announcing 12,000 tools joined"
    finally:
        ctx.destroy(0)
        pool.stop()
