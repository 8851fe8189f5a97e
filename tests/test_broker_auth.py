"""CurveZMQ on both sockets of a broker: controllers authenticate on the frontend, executors on the
backend, each against its own directory of admitted keys. Allowed keys work; no key, a key not
admitted, or the wrong server key get nothing at all within 2 s, on either socket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from controller import ExecutorClient
from protocol import Bye, Call, Heartbeat, Limits, Ping, Ready, ToolSpec, decode, encode
from protocol.curve import keygen, load_pair, load_public, secure_client
from tests.support.net import free_port
from tests.support.pool import POOL_TOOLS, Pool
from tests.support.waiting import wait_until

SILENCE = 2.0


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    broker_pub, broker_sec = keygen(tmp_path / "broker", "broker")
    _, alice = keygen(tmp_path / "clients", "alice")
    _, worker = keygen(tmp_path / "executors", "worker")
    _, mallory = keygen(tmp_path / "strangers", "mallory")
    return {"broker_pub": broker_pub, "broker_sec": broker_sec, "clients": tmp_path / "clients",
            "executors": tmp_path / "executors", "alice": alice, "worker": worker, "mallory": mallory}


@pytest.fixture
def pool(tmp_path: Path, keys: dict[str, Path]) -> Iterator[Pool]:
    p = Pool(tmp_path, frontend=f"tcp://127.0.0.1:{free_port()}", backend=f"tcp://127.0.0.1:{free_port()}",
             status_keys={"curve_server_key": load_public(keys["broker_pub"]),
                          "curve_keys": load_pair(keys["alice"])})
    yield p
    p.stop()


def _start_with_curve(pool: Pool, keys: dict[str, Path]) -> None:
    """A broker with CurveZMQ on both sockets and one executor admitted with the ``worker`` key."""
    pool.start_broker("--curve-secret", str(keys["broker_sec"]), "--curve-clients", str(keys["clients"]),
                      "--curve-executors", str(keys["executors"]))
    pool.add_executor([POOL_TOOLS], 1, "--curve-secret", str(keys["worker"]),
                      "--curve-server-key", str(keys["broker_pub"]))
    pool.wait_for_executors(1)


def test_allowed_keys_work_and_anything_else_gets_nothing_on_both_broker_sockets(
        pool: Pool, keys: dict[str, Path]) -> None:
    _start_with_curve(pool, keys)
    server = load_public(keys["broker_pub"])
    with ExecutorClient(pool.frontend, curve_server_key=server, curve_keys=load_pair(keys["alice"])) as client:
        assert client.call(Call(tool="work", kwargs={"tag": "hi"})).value["tag"] == "hi"

    wrong_server = load_public(keys["mallory"])
    probes = {  # name: (endpoint, server key or None, own key pair or None, messages)
        "frontend, no key": (pool.frontend, None, None),
        "frontend, key not admitted": (pool.frontend, server, load_pair(keys["mallory"])),
        "frontend, wrong server key": (pool.frontend, wrong_server, load_pair(keys["alice"])),
        "backend, no key": (pool.backend, None, None),
        "backend, key not admitted": (pool.backend, server, load_pair(keys["mallory"])),
        "backend, wrong server key": (pool.backend, wrong_server, load_pair(keys["worker"])),
    }
    ready = Ready(executor="intruder", incarnation=1, limits=Limits(),
                  tools=[ToolSpec(name="steal", signature="()")])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        socks = {}
        for name, (endpoint, server_key, pair) in probes.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if server_key is not None:
                secure_client(sock, server_key, pair)
            sock.connect(endpoint)
            for msg in ((Ping(nonce=1),) if "frontend" in name else (ready, Heartbeat(executor="intruder"))):
                sock.send_multipart(encode(msg), zmq.NOBLOCK)
            socks[name] = sock
        poller = zmq.Poller()
        for sock in socks.values():
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + SILENCE
        heard: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                heard.append(next(n for n, s in socks.items() if s is sock))
                sock.recv_multipart()
        assert not heard, f"answered: {sorted(set(heard))}"
    finally:
        ctx.destroy(0)
    report = pool.status()
    assert report is not None and [e.tools for e in report.executors] == [["lookup", "work"]]


def test_an_executor_id_passes_at_once_only_to_a_connection_with_the_same_key(
        pool: Pool, keys: dict[str, Path], tmp_path: Path) -> None:
    """With CurveZMQ on the backend an announcement of a live member's id from a connection that
    authenticated with another admitted key is refused (the member is alive); one with the member's
    own key is the same executor, restarted: it replaces the member at once, whose running call is
    answered `crashed`."""
    _, other = keygen(keys["executors"], "worker2")
    _start_with_curve(pool, keys)
    server = load_public(keys["broker_pub"])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    def announce(pair_file: Path, executor: str, incarnation: int) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, server, load_pair(pair_file))
        sock.connect(pool.backend)
        sock.send_multipart(encode(Ready(executor=executor, incarnation=incarnation, limits=Limits(), tools=[])))
        return sock

    try:
        with ExecutorClient(pool.frontend, curve_server_key=server, curve_keys=load_pair(keys["alice"])) as client:
            future = client.submit(Call(tool="work", kwargs={"tag": "victim", "seconds": 20.0}))
            report = wait_until("the call to run", lambda: (r := pool.status(0.5)) is not None and r.busy == 1 and r)
            honest = report.executors[0]
            stranger = announce(other, honest.executor, honest.incarnation + 1)
            bye = None
            while bye is None and stranger.poll(10_000):
                msg = decode(stranger.recv_multipart())
                bye = msg if isinstance(msg, Bye) else None
            assert bye is not None and bye.refused, bye
            assert not future.done()
            started = time.monotonic()
            same = announce(keys["worker"], honest.executor, honest.incarnation + 1)  # kept open until answered
            result = future.result(timeout=10)
            took = time.monotonic() - started
            same.close(0)
    finally:
        ctx.destroy(0)
    assert result.error is not None and result.error.kind == "crashed" and "restarted" in result.error.message, result
    assert took < 2.0, f"took {took:.1f} s"  # at once: no waiting for the old connection's silence
