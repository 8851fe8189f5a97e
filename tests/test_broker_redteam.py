"""Red team against the broker: hostile clients on its frontend, hostile executors on its backend (an
ipc backend has no CurveZMQ: whoever can reach the socket file may join), and its state directory.

Real broker and executor processes (``tests.pool.Pool``), real sockets; the hostile parties are raw
ZeroMQ sockets speaking ``ciayn/1`` through ``protocol.encode``/``decode``. A test marked
``xfail(strict=True)`` is a hole that is still open; the others are attacks that held.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from controller import ExecutorClient
from executor.journal import JOURNAL_NAME
from protocol import (
    Bye,
    Call,
    Cancel,
    Heartbeat,
    Hello,
    Limits,
    Param,
    Ping,
    Pong,
    Ready,
    Result,
    Status,
    ToolSpec,
    Welcome,
    decode,
    encode,
)
from tests.pool import POOL_TOOLS, Pool, wait_until

BOUND = 10.0  # seconds for one expected answer
ECHO = ToolSpec(name="echo", signature="(x)", params=[Param(name="x")])


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.stop()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(0)


class FakeExecutor:
    """A hostile executor on the backend, in a thread that owns its DEALER: it sends ``ready`` (unless
    ``ready`` is None), heartbeats while ``beating``, records what the broker sends it, and sends
    whatever the test queues with ``send``. It never answers a call on its own."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, ready: Ready | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.name = ready.executor if ready is not None else ""
        self.ready = ready
        self.beating = ready is not None
        self.received: queue.Queue[Any] = queue.Queue()
        self.outgoing: queue.Queue[list[bytes]] = queue.Queue()
        self.stop = threading.Event()
        if ready is not None:
            self.outgoing.put(encode(ready))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.outgoing.put(msg if isinstance(msg, list) else encode(msg))

    def _run(self) -> None:
        next_beat = 0.0
        while not self.stop.is_set():
            while not self.outgoing.empty():
                self.sock.send_multipart(self.outgoing.get())
            now = time.monotonic()
            if self.beating and now >= next_beat:
                self.sock.send_multipart(encode(Heartbeat(executor=self.name)))
                next_beat = now + 0.3
            if self.sock.poll(20):
                msg = decode(self.sock.recv_multipart())
                if not isinstance(msg, Heartbeat):
                    self.received.put(msg)
        self.sock.close(0)

    def expect(self, kind: type, timeout: float = BOUND) -> Any:
        """The next message of ``kind`` the broker sends this executor, or None within ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.received.get(timeout=left)
            except queue.Empty:
                return None
            if isinstance(msg, kind):
                return msg
        return None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def fakes(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[list[FakeExecutor]]:
    made: list[FakeExecutor] = []
    yield made
    for f in made:
        f.close()


def _fake(fakes: list[FakeExecutor], ctx: zmq.Context[zmq.Socket[bytes]], pool: Pool,
          ready: Ready | None) -> FakeExecutor:
    f = FakeExecutor(ctx, pool.backend, ready)
    fakes.append(f)
    return f


def _client(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"c" + uuid.uuid4().bytes)
    sock.connect(endpoint)
    return sock


def _recv(sock: zmq.Socket[bytes], kind: type, timeout: float = BOUND) -> Any:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return None
        msg = decode(sock.recv_multipart())
        if isinstance(msg, kind):
            return msg
    return None


def _members(pool: Pool, n: int) -> None:
    wait_until(f"{n} executors in the pool", lambda: (r := pool.status(0.5)) is not None and len(r.executors) == n)


def _serving(ctx: zmq.Context[zmq.Socket[bytes]], pool: Pool) -> None:
    """Wait for the broker's recovery window to end: it answers pings again."""
    probe = _client(ctx, pool.frontend)

    def pong() -> bool:
        probe.send_multipart(encode(Ping(nonce=1)))
        return _recv(probe, Pong, timeout=0.2) is not None

    wait_until("the broker to answer pings", pong)
    probe.close(0)


def _pool_tools(ctx: zmq.Context[zmq.Socket[bytes]], pool: Pool) -> list[ToolSpec]:
    """The specs the pool serves, as any client reads them from a welcome."""
    sock = _client(ctx, pool.frontend)
    sock.send_multipart(encode(Hello(client="redteam")))
    welcome = _recv(sock, Welcome)
    sock.close(0)
    assert welcome is not None
    return list(welcome.tools)


# ---------------------------------------------------------------- hostile executors: holes


@pytest.mark.xfail(strict=True, reason=(
    "HOLE: any backend peer can announce an honest executor's id (read from `status`) with another "
    "incarnation; the broker then drops the honest executor and answers every call it is running "
    "`crashed`, though it goes on running them. Reproduce: a call running on a real executor; send "
    "Ready(executor=<its id>, incarnation=<its incarnation>+1) on the backend."))
def test_impersonating_an_executor_id_does_not_crash_its_calls(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor]) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 1)
    _members(pool, 1)
    with ExecutorClient(pool.frontend) as client:
        future = client.submit(Call(tool="work", kwargs={"tag": "victim", "seconds": 2.0}))
        report = wait_until("the call to run", lambda: (r := pool.status(0.5)) is not None and r.busy == 1 and r)
        honest = report.executors[0]
        _fake(fakes, ctx, pool, Ready(executor=honest.executor, incarnation=honest.incarnation + 1, tools=[],
                                      limits=Limits()))
        result = future.result(timeout=BOUND)
    assert result.ok, result.error


# Closed (was: a backend peer that never sent `ready` can put a result in the broker's cache under any id...).
def test_a_backend_peer_that_never_joined_cannot_answer_a_call(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor]) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 1)
    _members(pool, 1)
    forger = _fake(fakes, ctx, pool, None)
    forger.send(Result(id="c-1", ok=True, value="forged"))
    assert forger.expect(Bye) is not None, "the broker did not take the forged result"
    client = _client(ctx, pool.frontend)
    client.send_multipart(encode(Call(id="c-1", tool="work", kwargs={"tag": "real"})))
    result = _recv(client, Result)
    assert result is not None
    assert result.value != "forged", "a call was answered by a peer that never joined, without running"
    assert result.ok and result.value["tag"] == "real", result


# Closed (was: held ids of every executor shared one bounded table, oldest out: a flood evicted others').
def test_a_flood_of_held_ids_does_not_reroute_a_held_call(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor], tmp_path: Path) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 1)
    _members(pool, 1)
    cid = "held-" + uuid.uuid4().hex
    holder = _fake(fakes, ctx, pool, Ready(executor="holder", incarnation=1, tools=[], limits=Limits(), held=[cid]))
    _members(pool, 2)
    flooder = _fake(fakes, ctx, pool, Ready(executor="flooder", incarnation=1, tools=[], limits=Limits()))
    for _ in range(5):
        flooder.send(Ready(executor="flooder", incarnation=1, tools=[], limits=Limits(),
                           held=[uuid.uuid4().hex for _ in range(65536)]))
    _members(pool, 3)
    wait_until("the broker to read the flood", lambda: flooder.outgoing.empty() and pool.status(1.0) is not None)
    log = tmp_path / "runs.log"
    client = _client(ctx, pool.frontend)
    client.send_multipart(encode(Call(id=cid, tool="work", kwargs={"tag": "held", "log": str(log)})))
    sent = holder.expect(Call, timeout=5.0)
    ran = log.exists() and log.read_text().strip()
    assert sent is not None and sent.id == cid and not ran, "the held call went elsewhere and ran"


@pytest.mark.xfail(strict=False, reason=(
    "Not strict: whether the liar attracts the calls depends on routing order (one fresh-clone run passed). "
    "HOLE: an executor's `ready` decides every client's deadline: its apply_grace_s (up to 86,400) becomes "
    "the broker welcome's, and clients wait that much (capped at 120 s) past a call's timeout. With a "
    "capacity of 4096 the liar attracts calls while an honest executor sits idle, and never answers: a "
    "1 s call hangs ~2 minutes instead of failing at 3 s. Reproduce: Ready(capacity=4096, "
    "apply_grace_s=86400, tools=<the pool's specs>), heartbeat, never answer."))
def test_a_lying_executor_cannot_hold_calls_far_past_their_timeout(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor]) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 2)
    _members(pool, 1)
    tools = _pool_tools(ctx, pool)
    _fake(fakes, ctx, pool, Ready(executor="liar", incarnation=1, tools=tools, limits=Limits(), capacity=4096,
                                  apply_grace_s=86400.0))
    _members(pool, 2)
    with ExecutorClient(pool.frontend) as client:
        futures = [client.submit(Call(tool="work", kwargs={"tag": f"t{i}"}), timeout=1.0) for i in range(3)]
        started = time.monotonic()
        for f in futures:
            f.result(timeout=max(0.1, 1.0 + 2.0 + 4.0 - (time.monotonic() - started)))  # timeout + grace + slack


@pytest.mark.xfail(strict=True, reason=(
    "HOLE: the first executor to announce a tool name fixes its spec, and an honest executor later "
    "announcing it differently is refused and exits for good; any backend peer can squat the pool's tool "
    "names (e.g. while the honest executors reconnect after a broker restart) and knock them out. "
    "Reproduce: Ready(tools=[ToolSpec(name='work', signature='(x)')]) before `serve --connect` starts."))
def test_a_tool_name_squatter_cannot_make_an_honest_executor_exit(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor]) -> None:
    pool.start_broker()
    squat = ToolSpec(name="work", signature="(x)", params=[Param(name="x")])
    _fake(fakes, ctx, pool, Ready(executor="squatter", incarnation=1, tools=[squat], limits=Limits()))
    _members(pool, 1)
    honest = pool.add_executor([POOL_TOOLS], 1)
    wait_until("the broker to answer the honest executor", lambda: "refused" in pool.log(honest) or
               ((r := pool.status(0.5)) is not None and len(r.executors) == 2), timeout=20)
    fakes[0].close()  # the squatter leaves: the honest executor should be able to serve now
    try:
        code = honest.wait(4)
    except subprocess.TimeoutExpired:
        code = None
    assert code is None, f"the honest executor exited ({code}): {pool.log(honest)[-300:]}"


# Closed (was: executor ids are free text (0-256 chars, newlines allowed) and go into the journal unescap...).
def test_an_executor_id_cannot_forge_journal_lines(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor], tmp_path: Path) -> None:
    state = tmp_path / "state"
    pool.start_broker("--state-dir", str(state))
    evil = f"x\n{time.time():.3f} victim-id gone"
    f = _fake(fakes, ctx, pool, Ready(executor=evil, incarnation=1, tools=[ECHO], limits=Limits()))
    _members(pool, 1)
    client = _client(ctx, pool.frontend)
    client.send_multipart(encode(Call(id="c-" + uuid.uuid4().hex, tool="echo", args=[1])))
    assert f.expect(Call) is not None
    lines = (state / JOURNAL_NAME).read_text().splitlines()
    assert not any(" victim-id " in line for line in lines), lines


# Closed (was: --state-dir is used whatever its owner and mode, and the journal is written through symlin...).
def test_a_symlink_in_the_state_dir_cannot_redirect_the_journal(pool: Pool, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    (state / "dispatched.tmp").symlink_to(victim)
    pool.start_broker("--state-dir", str(state))
    assert pool.broker is not None
    wait_until("the broker to start or refuse", lambda: pool.broker.poll() is not None or pool.status(0.5))
    assert victim.read_text() == "precious\n", "the broker wrote through a planted symlink"


# ---------------------------------------------------------------- attacks that held


def test_an_executor_cannot_answer_a_call_it_was_not_sent_even_under_the_right_id(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[FakeExecutor]) -> None:
    """Two joined executors: the one given the call is slow; the other answers its id first. Ignored."""
    pool.start_broker()
    a = _fake(fakes, ctx, pool, Ready(executor="a", incarnation=1, tools=[ECHO], limits=Limits()))
    b = _fake(fakes, ctx, pool, Ready(executor="b", incarnation=1, tools=[ECHO], limits=Limits()))
    _members(pool, 2)
    client = _client(ctx, pool.frontend)
    cid = "c-" + uuid.uuid4().hex
    client.send_multipart(encode(Call(id=cid, tool="echo", args=[1])))
    got: dict[str, Call] = {}
    wait_until("the call to reach one executor", lambda: any(
        (m := f.expect(Call, timeout=0.05)) is not None and got.setdefault(f.name, m) for f in (a, b)))
    [holder] = [f for f in (a, b) if f.name in got]
    [other] = [f for f in (a, b) if f is not holder]
    other.send(Result(id=cid, ok=True, value="forged"))
    other.send(Result(id="someone-elses", ok=True, value="forged"))
    holder.send(Result(id=cid, ok=True, value="real"))
    result = _recv(client, Result)
    assert result is not None and result.value == "real", result


def test_a_resend_with_another_body_neither_joins_nor_reads_the_first_call(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Another client reusing a running (then finished) call's id with other arguments is refused both
    times, never handed the first call's answer, and cannot cancel it."""
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 1)
    _members(pool, 1)
    victim, thief = _client(ctx, pool.frontend), _client(ctx, pool.frontend)
    cid = "c-" + uuid.uuid4().hex
    victim.send_multipart(encode(Call(id=cid, tool="work", kwargs={"tag": "secret", "seconds": 0.5})))
    wait_until("the call to run", lambda: (r := pool.status(0.5)) is not None and r.busy == 1)
    thief.send_multipart(encode(Call(id=cid, tool="work", kwargs={"tag": "guess"})))
    thief.send_multipart(encode(Cancel(id=cid)))
    refused = _recv(thief, Result)
    answer = _recv(victim, Result)
    thief.send_multipart(encode(Call(id=cid, tool="work", kwargs={"tag": "guess"}, timeout=5.0)))
    again = _recv(thief, Result)
    assert answer is not None and answer.ok and answer.value["tag"] == "secret", answer
    for r in (refused, again):
        assert r is not None and not r.ok and r.error is not None and r.error.kind == "protocol", r
        assert "secret" not in str(r.model_dump())


def test_a_frontend_flood_of_garbage_and_new_identities_leaves_the_broker_answering(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Malformed frames, executor-only kinds, hellos and status requests from hundreds of routing ids:
    the broker answers a ping at once afterwards and its memory stays small."""
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 1)
    _members(pool, 1)
    _serving(ctx, pool)
    assert pool.broker is not None

    def rss_kb() -> int:
        for line in Path(f"/proc/{pool.broker.pid}/status").read_text().splitlines():  # type: ignore[union-attr]
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    before = rss_kb()
    junk = [[b"ciayn/1", b"call", b"\xc1"], [b"ciayn/9", b"ping", b"\x80"], [b"x"] * 9, [b"ciayn/1", b"zzz", b"\x80"],
            encode(Ready(executor="x", incarnation=1, tools=[], limits=Limits())), encode(Status()),
            encode(Hello()), [b"ciayn/1", b"cancel", b"\x81\xa2id\xa1y"]]
    socks = [_client(ctx, pool.frontend) for _ in range(200)]
    for i in range(2000):
        socks[i % len(socks)].send_multipart(junk[i % len(junk)])
    probe = _client(ctx, pool.frontend)
    probe.send_multipart(encode(Ping(nonce=7)))
    pong = _recv(probe, Pong, timeout=15)
    assert pong is not None and pong.nonce == 7 and pong.error is None
    for s in socks:
        s.close(0)
    assert rss_kb() - before < 100 * 1024, (before, rss_kb())
