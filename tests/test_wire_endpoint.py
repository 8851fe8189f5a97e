"""The executor's client-facing side on real sockets (SPEC.md sections 1, 6, 7): no answer lost to a
high-water mark, oversized and many-frame messages answered instead of a silent disconnect, the queue
bounded in bytes and in wait, private endpoints, log lines no call id can forge. Each test is a finding
of the wire attacker or the other-language client in issue 10."""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from controller import ExecutorClient
from controller.client import DEADLINE_GRACE
from protocol import MAX_FRAME_BYTES, VERSION, Call, Ping, Pong, Report, Result, Status, decode, encode
from tests.support.bombs import BOMBS
from tests.support.executors import local_of
from tests.support.net import free_port

FAULTY = str(Path(__file__).parent / "tools" / "faulty.py")
SERVE = [sys.executable, "-m", "executor.cli", "serve", "--tools", FAULTY]
SLACK = 3.0


def until_busy(endpoint: str, within: float = 10.0) -> None:
    """Wait until the executor reports a call running (its ``status``)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    try:
        deadline = time.monotonic() + within
        while True:
            sock.send_multipart(encode(Status()))
            report = decode(sock.recv_multipart())
            assert isinstance(report, Report)
            if report.busy:
                return
            assert time.monotonic() < deadline, "no call started"
            time.sleep(0.02)
    finally:
        sock.close(0)
        ctx.term()


# --------------------------------------------------------------------------- no answer is lost


def test_ten_thousand_calls_sent_before_reading_are_all_answered(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    """Before: the ROUTER's high-water mark (1000) silently dropped replies: 10,000 calls, 2,000
    answers. Now every one is answered (most ``unavailable``: the queue holds 64)."""
    client = make_client(max_queue=64)
    sock = dealer(client.endpoint)
    ids = [f"burst-{i}" for i in range(10_000)]
    for cid in ids:
        sock.send_multipart(encode(Call(id=cid, tool="noop")))
    answered: dict[str, Result] = {}
    while len(answered) < len(ids):
        reply = decode(sock.recv_multipart())  # RCVTIMEO: a lost answer fails here, not hangs
        assert isinstance(reply, Result)
        answered[reply.id] = reply
    assert set(answered) == set(ids)
    assert {r.error.kind if r.error else "ok" for r in answered.values()} <= {"ok", "unavailable"}


def test_a_body_over_the_cap_is_answered_and_the_connection_survives(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    """Before: a 65 MiB body made libzmq drop the connection: no reply, and the answer to another call
    running on that connection was lost."""
    client = make_client()
    sock = dealer(client.endpoint)
    sock.send_multipart(encode(Call(id="running-1", tool="nap", kwargs={"seconds": 1.0})))
    body = b"\x82\xa2id\xa6over-1\xa4tool" + b"\xdb" + (MAX_FRAME_BYTES + 1024 * 1024).to_bytes(4, "big")
    body += b"x" * (MAX_FRAME_BYTES + 1024 * 1024)
    sock.send_multipart([VERSION, b"call", body])
    replies = {}
    for _ in range(2):
        reply = decode(sock.recv_multipart())
        assert isinstance(reply, Result)
        replies[reply.id] = reply
    over = replies["over-1"]
    assert over.error is not None and over.error.kind == "protocol" and "over the" in over.error.message
    assert replies["running-1"].ok, "the answer to the other call on the connection was lost"


def test_the_client_refuses_to_send_a_call_over_the_cap(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client()
    started = time.monotonic()
    r = client.call(Call(tool="echo", args=["x" * (MAX_FRAME_BYTES + 1)]))
    assert r.error is not None and r.error.kind == "protocol" and "not sent" in r.error.message
    assert time.monotonic() - started < 5
    assert client.call(Call(tool="echo", args=[1])).value == 1


def test_a_message_of_many_frames_is_answered_protocol(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    client = make_client()
    sock = dealer(client.endpoint)
    sock.send_multipart([VERSION, b"ping", b"\x80", *([b"x" * 1024] * 2000)])
    reply = decode(sock.recv_multipart())
    assert isinstance(reply, Result) and reply.error is not None and "expected 3 frames" in reply.error.message
    sock.send_multipart(encode(Ping(nonce=5)))
    pong = decode(sock.recv_multipart())
    assert isinstance(pong, Pong) and pong.nonce == 5


# --------------------------------------------------------------------------- the queue's bounds


@pytest.fixture
def private_dir() -> Iterator[Path]:
    directory = Path(f"/tmp/ciayn-wire-{uuid.uuid4().hex[:8]}")
    directory.mkdir(mode=0o700)
    yield directory
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()


@pytest.fixture
def serve(private_dir: Path) -> Iterator[Callable[..., tuple[ExecutorClient, subprocess.Popen[bytes]]]]:
    """``serve(*flags)``: a real executor on an ipc socket in a private directory, and a client."""
    started: list[tuple[ExecutorClient, subprocess.Popen[bytes]]] = []

    def start(*flags: str) -> tuple[ExecutorClient, subprocess.Popen[bytes]]:
        endpoint = f"ipc://{private_dir}/exec-{len(started)}.sock"
        log = open(private_dir / f"exec-{len(started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([*SERVE, "--bind", endpoint, *flags], stdin=subprocess.DEVNULL, stderr=log)
        log.close()
        client = ExecutorClient(endpoint, connect_timeout=30)
        started.append((client, proc))
        client.tools()
        return client, proc

    yield start
    for client, proc in started:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_the_queue_is_bounded_in_bytes(serve: Callable[..., tuple[ExecutorClient, subprocess.Popen[bytes]]]) -> None:
    """Before: only by count (120 queued 16 MB calls held 2 GB)."""
    client, _ = serve("--workers", "1", "--max-queue-mb", "40")
    busy = client.submit(Call(tool="nap", kwargs={"seconds": 3.0}))
    blob = "x" * (16 * 1024 * 1024)
    queued = [client.submit(Call(tool="fail", args=[blob]), timeout=60) for _ in range(3)]
    results = [f.result(timeout=60) for f in queued]
    kinds = [r.error.kind if r.error else "ok" for r in results]
    assert kinds == ["tool_error", "tool_error", "unavailable"], [r.error for r in results]
    assert results[2].error is not None and "queue is full (32 MiB queued" in results[2].error.message
    assert busy.result(timeout=30).ok


def test_a_call_that_waits_in_the_queue_past_its_timeout_is_answered_unavailable_in_time(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """Before: pongs reporting queued calls pushed the client's deadline back, so ``timeout=1`` was
    answered after 20 s. Now the executor answers it ``unavailable`` (it did not run) at its timeout."""
    client = make_client(workers=1)
    busy = client.submit(Call(tool="nap", kwargs={"seconds": 8.0}), timeout=30)
    until_busy(client.endpoint)
    started = time.monotonic()
    r = client.call(Call(tool="noop"), timeout=1.0)
    took = time.monotonic() - started
    assert r.error is not None and r.error.kind == "unavailable", r
    assert "queue" in r.error.message and "did not run" in r.error.message
    assert took < 1.0 + DEADLINE_GRACE + 0.5
    assert busy.result(timeout=30).ok


def test_queue_wait_is_bounded_by_max_queue_wait(
    serve: Callable[..., tuple[ExecutorClient, subprocess.Popen[bytes]]],
) -> None:
    client, _ = serve("--workers", "1", "--max-queue-wait", "1")
    busy = client.submit(Call(tool="nap", kwargs={"seconds": 6.0}), timeout=30)
    until_busy(client.endpoint)
    started = time.monotonic()
    r = client.call(Call(tool="noop"), timeout=20)
    assert r.error is not None and r.error.kind == "unavailable" and "--max-queue-wait" in r.error.message, r
    assert time.monotonic() - started < 1.0 + SLACK
    assert busy.result(timeout=30).ok


def test_a_call_started_late_gets_what_is_left_of_its_timeout(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(workers=1)
    first = client.submit(Call(tool="nap", kwargs={"seconds": 1.0}), timeout=10)
    until_busy(client.endpoint)
    second = client.call(Call(tool="nap", kwargs={"seconds": 0.1}), timeout=5)
    assert first.result(timeout=10).ok and second.ok, second
    assert second.limits is not None and 2.0 < second.limits.timeout_s < 4.5, second.limits


# --------------------------------------------------------------------------- private endpoints


def _serve_fails(*args: str) -> str:
    out = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out.stderr
    assert "Traceback" not in out.stderr
    return out.stderr


@pytest.mark.parametrize("endpoint", ["ipc://@ciayn-wire-test", "tcp://127.0.0.1:{port}"], ids=["abstract", "tcp"])
def test_an_endpoint_any_local_user_can_reach_is_refused_without_insecure(endpoint: str) -> None:
    """Before: an executor on abstract ipc or loopback tcp without CurveZMQ served any local user."""
    endpoint = endpoint.format(port=free_port())
    err = _serve_fails("--bind", endpoint)
    assert "refusing to serve" in err and "--insecure" in err


def test_with_insecure_it_serves_and_warns(private_dir: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([*SERVE, "--bind", endpoint, "--insecure"], stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        with ExecutorClient(endpoint, connect_timeout=30) as client:
            assert client.call(Call(tool="echo", args=[3])).value == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "serving insecurely (--insecure)" in err


def test_an_ipc_socket_outside_a_private_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    err = _serve_fails("--bind", f"ipc://{shared}/exec.sock")
    assert "mode 0755" in err and "0700" in err


def test_a_missing_socket_directory_is_created_private(private_dir: Path) -> None:
    sub = private_dir / "run"
    endpoint = f"ipc://{sub}/exec.sock"
    proc = subprocess.Popen([*SERVE, "--bind", endpoint], stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ExecutorClient(endpoint, connect_timeout=30) as client:
            assert client.call(Call(tool="noop")).ok
        assert stat.S_IMODE(sub.stat().st_mode) == 0o700 and sub.stat().st_uid == os.geteuid()
    finally:
        proc.terminate()
        proc.wait(10)
        for p in sub.iterdir():
            p.unlink()
        sub.rmdir()


def test_the_client_refuses_a_socket_another_user_owns(private_dir: Path) -> None:
    """Before: a socket squatted in a shared directory by another user fed a root client forged tools."""
    path = private_dir / "squatted.sock"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(str(path))
    squatter.listen()
    try:
        os.chown(path, 12345, 12345)
        with pytest.raises(ValueError, match="belongs to uid 12345"):
            ExecutorClient(f"ipc://{path}")
    finally:
        squatter.close()
    with pytest.raises(ValueError, match="abstract"):
        ExecutorClient("ipc://@ciayn-wire-test")


def test_the_client_refuses_a_socket_in_a_directory_others_can_write(private_dir: Path) -> None:
    private_dir.chmod(0o777)
    path = private_dir / "exec.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    try:
        with pytest.raises(ValueError, match="writable by other users"):
            ExecutorClient(f"ipc://{path}")
        private_dir.chmod(0o1777)  # sticky, like /tmp: only the owner may replace the socket
        ExecutorClient(f"ipc://{path}", connect_timeout=0.1).close()
    finally:
        listener.close()


# --------------------------------------------------------------------------- logs


def test_no_call_id_or_tool_name_can_forge_a_log_line(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    client = make_client(log_level="debug")  # every call is logged (at debug)
    sock = dealer(client.endpoint)
    forged = "DEBUG call forged-id noop: ok"
    for body in ({"id": f"x\nciayn-executor[1] {forged}", "tool": "noop"},
                 {"id": "dup-1", "tool": "noop"}, {"id": "dup-1", "tool": f"noop\nciayn-executor[1] {forged}"}):
        sock.send_multipart([VERSION, b"call", msgpack.packb(body)])
        decode(sock.recv_multipart())
    lines = local_of(client).log_path.read_text().splitlines()
    assert not [line for line in lines if line.startswith("ciayn-executor[1]")], lines


# --------------------------------------------------------------------------- random bytes


def test_random_bytes_on_the_wire_only_ever_get_protocol_answers_in_bounded_time_and_memory(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    """Hundreds of random bodies (and the decoding bombs) under every kind a client may send: each
    gets exactly one error answer, fast, and the executor's memory does not grow with them."""
    client = make_client()
    sock = dealer(client.endpoint)
    local = local_of(client)
    assert local.proc is not None
    supervisor = psutil.Process(local.proc.pid)
    rng = random.Random(10)
    bodies: list[list[bytes]] = [make() for make in BOMBS.values()]
    for _ in range(400):
        kind = rng.choice([b"call", b"ping", b"cancel", b"hello", b"status", b"result", b"bogus"])
        body = rng.randbytes(rng.randrange(0, 2048))
        if rng.random() < 0.5:  # a map header first, so the bytes get past the first check
            body = b"\x83\xa2id\xa3r-1" + body
        bodies.append([VERSION, kind, body])
    rss_before = supervisor.memory_info().rss
    slowest = 0.0
    for frames in bodies:
        try:
            decode(frames)
            continue  # a random body that happens to be valid: not what this test is about
        except Exception:
            pass
        started = time.monotonic()
        sock.send_multipart(frames)
        reply = decode(sock.recv_multipart())
        slowest = max(slowest, time.monotonic() - started)
        assert isinstance(reply, Result | Pong), reply
        assert reply.error is not None and reply.error.kind in ("protocol", "bad_arguments"), reply
    assert slowest < 2.0, f"slowest answer {slowest:.2f} s"
    assert supervisor.memory_info().rss - rss_before < 200 * 1024 * 1024
    sock.send_multipart(encode(Ping(nonce=1)))
    assert isinstance(decode(sock.recv_multipart()), Pong)


def test_a_flood_of_costly_bodies_does_not_hold_up_deadlines(
    make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]
) -> None:
    """1000 bodies of 65,000 empty arrays (each just inside the element budget, a few ms to decode)
    wait at the executor's socket when a running call's deadline passes: the executor takes messages
    for at most RECV_BUDGET_S per turn, so it enforces the deadline at once instead of after decoding
    the whole flood (seconds)."""
    client = make_client()
    local = local_of(client)
    assert local.proc is not None
    running = client.submit(Call(tool="sleep_forever"), timeout=1.0)
    until_busy(client.endpoint)
    flood = dealer(client.endpoint)
    body = b"\x83\xa2id\xa3f-1\xa4tool\xa1f\xa4args\xdd" + (65_000).to_bytes(4, "big") + b"\x90" * 65_000
    os.kill(local.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(1000):
            flood.send_multipart([VERSION, b"call", body])
        time.sleep(1.2)  # the call's deadline passes while the executor is stopped
    finally:
        os.kill(local.proc.pid, signal.SIGCONT)
    thawed = time.monotonic()
    result = running.result(timeout=60)
    assert result.error is not None and result.error.kind == "timeout", result
    assert time.monotonic() - thawed < 1.5, "the deadline waited for the flood to be decoded"


FLOOD_CONNECTIONS = r"""
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
socks = []
for _ in range(int(sys.argv[2])):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # this process is out of descriptors: as many as it can hold
        break
    try:
        s.connect(sys.argv[1])
    except OSError:
        s.close()
        continue
    socks.append(s)
print(len(socks), flush=True)
sys.stdin.read()  # hold them until told
"""


def _low_soft_nofile() -> None:
    """In the executor's child, before exec: the common default of a low soft descriptor limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 8192, reason="the hard descriptor limit is low")
def test_a_flood_of_bare_connections_does_not_abort_the_executor(private_dir: Path) -> None:
    """Before: bare connect()s to the ipc socket past the executor's soft descriptor limit (1024 by
    default on most systems) made libzmq assert on EMFILE in its ipc listener and abort the executor.
    It now raises its limit as far as allowed at start (here the hard limit), and closes connections
    that never complete the handshake after HANDSHAKE_IVL. (A flood past the hard limit still aborts
    it: the residual libzmq risk in SPEC.md, which is why only this user may connect at all.)"""
    endpoint = f"ipc://{private_dir}/exec.sock"
    proc = subprocess.Popen([*SERVE, "--bind", endpoint], stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_low_soft_nofile)
    flood = None
    try:
        with ExecutorClient(endpoint, connect_timeout=30) as client:
            assert client.call(Call(tool="noop")).ok
            flood = subprocess.Popen([sys.executable, "-c", FLOOD_CONNECTIONS, str(private_dir / "exec.sock"), "5000"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert flood.stdout is not None
            assert int(flood.stdout.readline()) == 5000
            r = client.call(Call(tool="echo", args=["still here"]), timeout=10)
            assert r.value == "still here", r
            flood.communicate("", timeout=30)
            assert proc.poll() is None, "the executor died"
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        proc.terminate()
        proc.wait(10)


def test_a_client_that_does_not_read_its_answers_is_disconnected_with_a_log_line(
    private_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The endpoint on a real socket, with a 1 MiB outbox: answers the client's pipe cannot take wait
    in its outbox; past the bound they are dropped, the client's connection is closed (it may come
    back; its results stay in the cache) and a warning says so. Before: ZeroMQ's high-water mark
    dropped answers silently and the client was starved without a word."""
    import logging

    from executor.clientside.router import RouterEndpoint

    caplog.set_level(logging.WARNING, logger="ciayn-executor")
    ctx = zmq.Context()
    endpoint = RouterEndpoint(ctx, f"ipc://{private_dir}/exec.sock", outbox_bytes=1024 * 1024)
    server_side = endpoint.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVHWM, 1)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVTIMEO, 10_000)
    client.setsockopt(zmq.ROUTING_ID, b"slow-reader")  # as ExecutorClient does: the same id when it is back
    try:
        client.connect(endpoint.endpoint)
        client.send_multipart(encode(Ping(nonce=1)))
        poller = zmq.Poller()
        poller.register(endpoint.socket, zmq.POLLIN)
        assert poller.poll(10_000)
        (route, ping), = list(endpoint.receive())
        assert isinstance(ping, Ping)
        for _ in range(1000):  # until the endpoint gives up on it (then it sends it nothing more)
            endpoint.send(route, [b"x" * 100_000])
            endpoint.tick(time.monotonic())
            if any("does not read its answers" in r.getMessage() for r in caplog.records):
                break
        else:
            raise AssertionError("the client that does not read was never disconnected")
        assert server_side.poll(10_000), "the endpoint said it disconnected the client, but ZeroMQ did not within 10 s"
        warnings = [r.getMessage() for r in caplog.records if "does not read its answers" in r.getMessage()]
        assert len(warnings) == 1 and "disconnected it" in warnings[0], warnings
        while client.poll(1000):  # the client drains what reached it, sees the connection closed, comes back
            client.recv_multipart()
        client.send_multipart(encode(Ping(nonce=2)))
        assert poller.poll(10_000)
        (again, ping), = list(endpoint.receive())
        assert again == route == b"slow-reader" and isinstance(ping, Ping) and ping.nonce == 2
    finally:
        endpoint.socket.disable_monitor()
        server_side.close(0)
        client.close(0)
        endpoint.close()
        ctx.term()


def test_a_handler_slower_than_the_receive_budget_still_gets_every_waiting_message(
    private_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receive budget bounds the endpoint's own receiving and decoding, not the time its caller
    spends on each message. Before, a supervisor descheduled while it handled a client's first
    cancel (a loaded machine) left the second unread for a turn, in which the cancelled call's
    worker died and the queued call the client had also given up on was handed to a worker and ran
    (tests/test_wire_at_most_once.py, on CI). Here the handler's slowness is a clock it moves on by a
    second per message; the socket and the messages are real."""
    from executor.clientside import router
    from executor.clientside.router import RouterEndpoint

    clock = [time.monotonic()]
    monkeypatch.setattr(router.time, "monotonic", lambda: clock[0])
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{private_dir}/exec.sock"
    client.connect(address)  # before the endpoint binds: the three wait in the client's pipe...
    for nonce in range(3):
        client.send_multipart(encode(Ping(nonce=nonce)))
    endpoint = RouterEndpoint(ctx, address)  # ...and arrive together once it does
    try:
        poller = zmq.Poller()
        poller.register(endpoint.socket, zmq.POLLIN)
        assert poller.poll(10_000)
        nonces = []
        for _route, ping in endpoint.receive():
            assert isinstance(ping, Ping)
            nonces.append(ping.nonce)
            clock[0] += 1.0  # the handler took a second (descheduled, say)
        assert nonces == [0, 1, 2]
    finally:
        client.close(0)
        endpoint.close()
        ctx.term()
