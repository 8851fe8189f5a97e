"""Red team against the broker: hostile clients on its frontend, hostile executors on its backend (an
ipc backend has no CurveZMQ: whoever can reach the socket file may join), and its state directory.

Real broker and executor processes (``tests.support.pool.Pool``), real sockets; the hostile parties are raw
ZeroMQ sockets speaking ``ciayn/1`` through ``protocol.encode``/``decode``. A test marked
``xfail(strict=True)`` is a hole that is still open; the others are attacks that held.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from controller import ExecutorClient
from executor.broker.journal import JOURNAL_NAME
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
from tests.support.hostile import HostileMember
from tests.support.pool import POOL_TOOLS, Pool
from tests.support.waiting import wait_until

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


@pytest.fixture
def fakes(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[list[HostileMember]]:
    made: list[HostileMember] = []
    yield made
    for f in made:
        f.close()


def _fake(fakes: list[HostileMember], ctx: zmq.Context[zmq.Socket[bytes]], pool: Pool,
          ready: Ready | None) -> HostileMember:
    f = HostileMember(ctx, pool.backend, ready)
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


# Closed (was: any backend peer could announce an honest executor's id with another incarnation; the broker
# dropped the honest executor and answered its running calls `crashed`, though they went on running).
def test_impersonating_an_executor_id_does_not_crash_its_calls(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
    """The member is asked to announce itself again, does (it is alive), and the impostor is refused."""
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 1)
    _members(pool, 1)
    with ExecutorClient(pool.frontend) as client:
        future = client.submit(Call(tool="work", kwargs={"tag": "victim", "seconds": 2.0}))
        report = wait_until("the call to run", lambda: (r := pool.status(0.5)) is not None and r.busy == 1 and r)
        honest = report.executors[0]
        impostor = _fake(fakes, ctx, pool, Ready(executor=honest.executor, incarnation=honest.incarnation + 1,
                                                 tools=[], limits=Limits()))
        bye = impostor.expect(Bye)
        result = future.result(timeout=BOUND)
    assert bye is not None and bye.refused and "live executor" in bye.reason, bye
    assert result.ok, result.error
    after = pool.status()
    assert after is not None and [(e.executor, e.incarnation) for e in after.executors] == \
        [(honest.executor, honest.incarnation)]


def test_a_member_that_keeps_beating_keeps_its_id_even_if_it_never_announces_again(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
    """A member that ignores the broker's "announce yourself again" but goes on heartbeating is alive
    too: a newcomer announcing its id is refused, and the member keeps the call it was given."""
    pool.start_broker()
    holder = _fake(fakes, ctx, pool, Ready(executor="e-1", incarnation=7, tools=[ECHO], limits=Limits()))
    _members(pool, 1)
    client = _client(ctx, pool.frontend)
    client.send_multipart(encode(Call(id="c-" + uuid.uuid4().hex, tool="echo", args=[1])))
    call = holder.expect(Call)
    assert call is not None
    newcomer = _fake(fakes, ctx, pool, Ready(executor="e-1", incarnation=7, tools=[ECHO], limits=Limits()))
    bye = newcomer.expect(Bye)
    assert bye is not None and bye.refused, bye
    assert newcomer.expect(Call, timeout=0.5) is None, "the newcomer was handed the member's call"
    holder.send(Result(id=call.id or "", ok=True, value="from the member"))
    result = _recv(client, Result)
    assert result is not None and result.value == "from the member", result


@pytest.mark.parametrize("gone", ["its connection closed", "it hung, connection open"])
def test_an_executor_back_on_a_new_connection_takes_its_id_and_its_calls_back(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember], gone: str) -> None:
    """The legitimate case beside the attack: the same executor (id and incarnation) announces itself
    on a new connection after its old one died or went silent. The new one takes the id within about
    two seconds and is sent the call in flight again (it holds it: a real executor joins the running call
    or answers from its cache), and its answer reaches the client."""
    pool.start_broker()
    old = _fake(fakes, ctx, pool, Ready(executor="e-1", incarnation=7, tools=[ECHO], limits=Limits()))
    _members(pool, 1)
    client = _client(ctx, pool.frontend)
    cid = "c-" + uuid.uuid4().hex
    client.send_multipart(encode(Call(id=cid, tool="echo", args=[1])))
    assert old.expect(Call) is not None
    if gone == "its connection closed":
        old.close()
    else:
        old.beating = False
    started = time.monotonic()
    new = _fake(fakes, ctx, pool, Ready(executor="e-1", incarnation=7, tools=[ECHO], limits=Limits(), held=[cid]))
    again = new.expect(Call)
    took = time.monotonic() - started
    assert again is not None and again.id == cid, again
    assert took < 2.0 + 2.0, f"took {took:.1f} s"  # CLAIM_WINDOW at most, a sweep, and a loaded machine
    new.send(Result(id=cid, ok=True, value="after the reconnection"))
    result = _recv(client, Result)
    assert result is not None and result.value == "after the reconnection", result
    report = pool.status()
    assert report is not None and [e.executor for e in report.executors] == ["e-1"]


# Closed (was: a backend peer that never sent `ready` can put a result in the broker's cache under any id...).
def test_a_backend_peer_that_never_joined_cannot_answer_a_call(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
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
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember], tmp_path: Path) -> None:
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


# Closed (was: an executor's `ready` decided every client's deadline: its apply_grace_s, up to 86,400, became the
# broker welcome's, and a liar with capacity 4096 that never answered held a 1 s call ~2 minutes).
def test_a_lying_executor_cannot_hold_calls_far_past_their_timeout(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
    """The honest executor's workers are busy, so the calls surely go to the liar, which announces a
    day of apply grace and 4096 workers and never answers. The broker answers each call `timeout`
    itself at its timeout plus 2 s and cancels it on the liar; the welcome's apply grace is the
    broker's own (60 s), and the liar is sent at most 256 calls at once."""
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], 2)
    _members(pool, 1)
    tools = _pool_tools(ctx, pool)
    with ExecutorClient(pool.frontend) as client:
        busy = [client.submit(Call(tool="work", kwargs={"tag": f"b{i}", "seconds": 6.0})) for i in range(2)]
        wait_until("the honest executor's workers to be busy", lambda: (r := pool.status(0.5)) is not None
                   and r.busy == 2)
        liar = _fake(fakes, ctx, pool, Ready(executor="liar", incarnation=1, tools=tools, limits=Limits(),
                                             capacity=4096, apply_grace_s=86400.0))
        report = wait_until("the liar to join", lambda: (r := pool.status(0.5)) is not None and len(r.executors) == 2
                            and r)
        assert {e.executor: e.capacity for e in report.executors}["liar"] == 256
        with ExecutorClient(pool.frontend) as fresh:  # a client that joins now: it would wait 1 + 2 + 60 s itself
            fresh.tools()
            assert fresh.welcome is not None and fresh.welcome.apply_grace_s == 60.0
            started = time.monotonic()
            futures = [fresh.submit(Call(tool="work", kwargs={"tag": f"t{i}"}), timeout=1.0) for i in range(3)]
            results = [f.result(timeout=BOUND) for f in futures]
            took = time.monotonic() - started
        sent = [liar.expect(Call, timeout=0.1) for _ in range(3)]
        cancels = [liar.expect(Cancel, timeout=1.0) for _ in range(3)]
        assert all(f.result(timeout=BOUND).ok for f in busy)
    assert all(c is not None for c in sent), "the calls did not go to the liar"
    assert took < 1.0 + 2.0 + 2.0, f"answered after {took:.1f} s"  # timeout + RESULT_GRACE + a loaded machine
    for r in results:
        assert not r.ok and r.error is not None and r.error.kind == "timeout", r
        assert "'liar' did not answer" in r.error.message and "may have run" in r.error.message, r.error
    assert sorted(c.id for c in cancels if c is not None) == sorted(c.id for c in sent if c is not None)


def test_an_executors_announced_default_timeout_is_trusted_only_up_to_the_brokers_ceiling(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
    """The liar announces a default timeout of an hour and never answers. With --max-timeout 1 the
    broker sends it the call with a 1 s max_timeout, answers the client `timeout` itself at 1 s plus 2 s
    (not after an hour), and its welcome says neither more than 1 s."""
    pool.start_broker("--max-timeout", "1")
    liar = _fake(fakes, ctx, pool, Ready(executor="liar", incarnation=1, tools=[ECHO], limits=Limits(timeout_s=3600)))
    _members(pool, 1)
    _serving(ctx, pool)
    sock = _client(ctx, pool.frontend)
    sock.send_multipart(encode(Hello(client="redteam")))
    welcome = _recv(sock, Welcome)
    assert welcome is not None and welcome.limits.timeout_s == 1.0 and welcome.max_timeout_s == 1.0, welcome
    started = time.monotonic()
    sock.send_multipart(encode(Call(id="ceiling-1", tool="echo", args=[1])))  # no timeout: the default's
    sent = liar.expect(Call)
    result = _recv(sock, Result)
    took = time.monotonic() - started
    sock.close(0)
    assert sent is not None and sent.id == "ceiling-1" and sent.max_timeout == 1.0 and sent.timeout is None, sent
    assert result is not None and result.error is not None and result.error.kind == "timeout", result
    assert "'liar' did not answer within the call's timeout (1 s)" in result.error.message, result.error
    assert took < 1.0 + 2.0 + 2.0, f"answered after {took:.1f} s"  # timeout + RESULT_GRACE + a loaded machine


def test_an_executor_applying_a_calls_writes_gets_the_brokers_apply_grace_and_no_more(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
    """The executor announces a day of apply grace, and says in a heartbeat that it is applying the
    call's writes: the broker (--apply-grace 2) waits until 2 s after that notice plus 2 s, so the
    answer sent 3.5 s after the call reaches the client; another call it says nothing about is
    answered `timeout` at its timeout plus 2 s, and a second notice for it, too late, changes nothing."""
    pool.start_broker("--apply-grace", "2")
    executor = _fake(fakes, ctx, pool, Ready(executor="e-1", incarnation=1, tools=[ECHO], limits=Limits(),
                                             capacity=2, apply_grace_s=86400.0))
    _members(pool, 1)
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        assert client.welcome is not None and client.welcome.apply_grace_s == 2.0
        applying = client.submit(Call(tool="echo", args=["applied"]), timeout=1.0)
        silent = client.submit(Call(tool="echo", args=["silent"]), timeout=1.0)
        sent = {c.args[0]: c for c in (executor.expect(Call), executor.expect(Call)) if c is not None}
        started = time.monotonic()
        executor.send(Heartbeat(executor="e-1", applying=[sent["applied"].id or ""]))
        late = silent.result(timeout=BOUND)
        executor.send(Heartbeat(executor="e-1", applying=[sent["silent"].id or ""]))
        wait_until("3.5 s after the calls", lambda: time.monotonic() - started >= 3.5)
        executor.send(Result(id=sent["applied"].id or "", ok=True, value="applied"))
        result = applying.result(timeout=BOUND)
    assert late.error is not None and late.error.kind == "timeout" and "apply" not in late.error.message, late
    assert result.ok and result.value == "applied", result


# Closed (was: the first executor to announce a tool name fixed its spec, and an honest executor announcing it
# differently later was refused and exited for good: any backend peer could squat the pool's tool names).
def test_a_tool_name_squatter_cannot_make_an_honest_executor_exit(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
    pool.start_broker()
    squat = ToolSpec(name="work", signature="(x)", params=[Param(name="x")])
    squatter = _fake(fakes, ctx, pool, Ready(executor="squatter", incarnation=1, tools=[squat], limits=Limits()))
    _members(pool, 1)
    honest = pool.add_executor([POOL_TOOLS], 1)
    wait_until("the broker to refuse the honest executor", lambda: "refused this executor" in pool.log(honest))
    assert "'work'" in pool.log(honest) and "'squatter'" in pool.log(honest)
    squatter.close()  # the squatter leaves (the broker drops it once it is silent): the honest executor joins
    wait_until("the honest executor to join", lambda: (r := pool.status(0.5)) is not None
               and [e.tools for e in r.executors] == [["lookup", "work"]], timeout=20)
    with ExecutorClient(pool.frontend, timeout=10) as client:
        result = client.call(Call(tool="work", kwargs={"tag": "served"}))
    assert result.ok and result.value["tag"] == "served", result
    assert honest.poll() is None, f"the honest executor exited: {pool.log(honest)[-300:]}"


# Closed (was: executor ids are free text (0-256 chars, newlines allowed) and go into the journal unescap...).
def test_an_executor_id_cannot_forge_journal_lines(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember], tmp_path: Path) -> None:
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
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], fakes: list[HostileMember]) -> None:
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
