"""The broker as controllers and executors see it: one executor's face on a pool, routing by tool,
fairness across clients, refusing a conflicting tool, status and metrics. Real processes, real sockets."""

from __future__ import annotations

import collections
import itertools
import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from controller import ExecutorClient
from executor.broker.journal import Journal
from executor.cli import main
from executor.fairqueue import FairQueue
from executor.status import fetch
from protocol import (
    Call,
    Cancel,
    Heartbeat,
    Limits,
    Param,
    Ready,
    Report,
    Result,
    Status,
    ToolSpec,
    decode,
    encode,
)
from protocol.curve import keygen
from tests.support.net import free_port
from tests.support.pool import ALPHA, BETA, CONFLICT, POOL_TOOLS, ROOT, Pool
from tests.support.waiting import wait_until

SLOW = 0.4  # seconds a call of the fairness test takes
BULK = str(ROOT / "tests" / "tools" / "pool_bulk.py")
ANSWER_BOUND_MS = 30_000  # for one answer to a raw client, on a loaded machine


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.stop()


def _raw_clients(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, n: int) -> list[zmq.Socket[bytes]]:
    """``n`` DEALER sockets connected to ``endpoint``: clients whose every message the test writes
    itself (a resend of an id, a cancel of another's call)."""
    socks = []
    for _ in range(n):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    return socks


def _answer(sock: zmq.Socket[bytes]) -> Result:
    assert sock.poll(ANSWER_BOUND_MS), "no answer"
    msg = decode(sock.recv_multipart())
    assert isinstance(msg, Result), msg
    return msg


def _ask(sock: zmq.Socket[bytes], calls: list[Call]) -> dict[str, Result]:
    """Send ``calls`` and wait for one answer to each, by id."""
    for call in calls:
        sock.send_multipart(encode(call))
    answers: dict[str, Result] = {}
    while len(answers) < len(calls):
        r = _answer(sock)
        answers[r.id] = r
    return answers


def test_a_broker_looks_like_one_executor_with_every_tool_of_the_pool(pool: Pool) -> None:
    pool.start_broker()
    pool.add_executor([ALPHA], workers=1)
    pool.add_executor([BETA], workers=2)
    pool.wait_for_executors(2)
    with ExecutorClient(pool.frontend) as client:
        assert sorted(t.name for t in client.tools()) == ["alpha", "beta"]
        assert client.welcome is not None and client.welcome.workers == 3
        assert client.call_text("alpha(1)").value == "alpha:1"


def test_calls_are_routed_to_the_executor_with_the_tool_and_an_unknown_tool_is_refused_at_once(pool: Pool) -> None:
    pool.start_broker()
    pool.add_executor([ALPHA], workers=1)
    pool.add_executor([BETA], workers=1)
    report = pool.wait_for_executors(2)
    owner = {tool: e.executor for e in report.executors for tool in e.tools}
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        futures = [client.submit(Call(tool=t, args=[i])) for i in range(20) for t in ("alpha", "beta")]
        for f in futures:
            r = f.result(timeout=30)
            assert r.ok, r.error
            tool = r.value.split(":")[0]
            assert r.executor == owner[tool]
        started = time.monotonic()
        r = client.call(Call(tool="gamma", args=[1]))
        assert r.error is not None and r.error.kind == "unknown_tool"
        assert "alpha, beta" in r.error.message
        assert time.monotonic() - started < 1.0
        r = client.call(Call(tool="alpha", kwargs={"y": 1}))
        assert r.error is not None and r.error.kind == "bad_arguments"


def test_calls_go_to_the_least_loaded_executor_and_never_beyond_its_workers(pool: Pool) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], workers=2)
    pool.add_executor([POOL_TOOLS], workers=1)
    pool.wait_for_executors(2)
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        futures = [client.submit(Call(tool="work", kwargs={"tag": str(i), "seconds": 0.5})) for i in range(4)]
        wait_until("three calls running", lambda: (r := pool.status()) is not None and r.busy == 3)
        report = pool.status()
        assert report is not None and report.queued == 1  # the fourth waits in the broker, not in an executor
        assert sorted(e.busy for e in report.executors) == [1, 2]
        results = [f.result(timeout=30) for f in futures]
    assert all(r.ok for r in results)
    by_executor = sorted(sum(1 for r in results if r.executor == e.executor) for e in report.executors)
    assert by_executor in ([1, 3], [2, 2])


def test_a_call_that_waits_in_the_broker_for_its_whole_timeout_is_answered_unavailable_unrun(
        pool: Pool, tmp_path: Path) -> None:
    log = tmp_path / "side-effects.log"
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], workers=1)
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        busy = client.submit(Call(tool="work", kwargs={"tag": "busy", "log": str(log), "seconds": 3}))
        wait_until("the worker to be busy", lambda: (r := pool.status()) is not None and r.busy == 1)
        started = time.monotonic()
        r = client.call(Call(tool="work", kwargs={"tag": "late", "log": str(log)}, timeout=0.5))
        waited = time.monotonic() - started
        assert busy.result(timeout=30).ok
    assert r.error is not None and r.error.kind == "unavailable" and "did not run" in r.error.message
    assert waited < 2.0, "answered by the broker at the call's timeout, not by the client's own bound"
    assert log.read_text().split()[0::2] == ["busy"]


def test_only_the_caller_can_cancel_a_call_queued_in_the_broker_or_running_on_an_executor(pool: Pool) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], workers=1)
    pool.wait_for_executors(1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with ExecutorClient(pool.frontend) as client:
            client.tools()
            running = Call(tool="work", kwargs={"tag": "r", "seconds": 30}, id=uuid.uuid4().hex)
            queued = Call(tool="work", kwargs={"tag": "q", "seconds": 30}, id=uuid.uuid4().hex)
            futures = [client.submit(running), client.submit(queued)]
            wait_until("one running, one queued",
                       lambda: (r := pool.status()) is not None and (r.busy, r.queued) == (1, 1))
            [stranger] = _raw_clients(ctx, pool.frontend, 1)
            for c in (running, queued):
                stranger.send_multipart(encode(Cancel(id=c.id or "")))
            stranger.send_multipart(encode(Status()))  # answered after the cancels were handled
            assert stranger.poll(10_000)
            report = decode(stranger.recv_multipart())
            assert isinstance(report, Report) and (report.busy, report.queued) == (1, 1)
            watch_until = time.monotonic() + 1.0  # a cancel honoured would end the running call within this
            while time.monotonic() < watch_until:
                assert not any(f.done() for f in futures)
                time.sleep(0.05)
            for c in (queued, running):
                client.cancel(c.id or "")
            results = [f.result(timeout=10) for f in futures]
    finally:
        ctx.destroy(0)
    assert [r.error.kind if r.error else None for r in results] == ["cancelled", "cancelled"]


def test_a_second_executor_serving_a_tool_of_the_same_name_differently_is_refused_until_the_first_is_gone(
        pool: Pool) -> None:
    """The second keeps announcing itself, with backoff, saying why and who serves the tool; it never
    exits for it, and joins once no executor serves the other version."""
    pool.start_broker()
    first = pool.add_executor([POOL_TOOLS], workers=1)
    report = pool.wait_for_executors(1)
    holder = report.executors[0].executor
    second = pool.add_executor([CONFLICT], workers=1)
    wait_until("a second refusal", lambda: "(refusal 2)" in pool.log(second))
    refusals = [line for line in pool.log(second).splitlines() if "refused this executor" in line]
    assert all("'work'" in line and repr(holder) in line for line in refusals), refusals
    assert "again in 1 s" in refusals[0] and "again in 2 s" in refusals[1], refusals
    assert second.poll() is None, "the refused executor exited"
    assert pool.broker is not None
    assert "refused executor" in pool.log(pool.broker)
    now = pool.status()
    assert now is not None and [e.executor for e in now.executors] == [holder]
    pool.kill(first, signal.SIGTERM)  # it says bye: the other `work` is free to come
    wait_until("the second executor to join", lambda: (r := pool.status()) is not None and len(r.executors) == 1
               and r.executors[0].executor != holder, timeout=20)
    with ExecutorClient(pool.frontend, timeout=10) as client:
        result = client.call(Call(tool="work", kwargs={"tag": "now"}))
    assert result.ok and result.value == "now", result  # the second executor's version of the tool


def test_one_client_flooding_slow_calls_delays_another_by_at_most_one_call(pool: Pool, tmp_path: Path) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], workers=2)
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend, timeout=600) as flood, ExecutorClient(pool.frontend) as other:
        flood.tools()
        other.tools()
        for i in range(1000):
            flood.submit(Call(tool="work", kwargs={"tag": f"f{i}", "seconds": SLOW}))
        wait_until("the flood to fill the pool", lambda: (r := pool.status()) is not None and r.queued >= 900)
        started = time.monotonic()
        r = other.call(Call(tool="work", kwargs={"tag": "mine", "seconds": SLOW}))
        waited = time.monotonic() - started
        assert r.ok, r.error
        # A free worker comes up within one call's duration and goes to the newcomer; then its own call
        # runs. Without fairness it would wait for 1000 calls / 2 workers (200 s).
        assert waited < 2 * SLOW + 1.0, f"waited {waited:.2f} s behind the flood"
        report = pool.status()
        assert report is not None and report.queued > 800  # the flood is still there: it was not drained first


def test_two_executors_serving_one_tool_whose_spec_holds_a_nan_both_join(pool: Pool) -> None:
    """Before: the broker compared specs with ==, a NaN never equals itself, and the second executor
    was refused as serving another version of the tool (and retried for ever)."""
    nan_spec = str(Path(__file__).parent / "tools" / "nan_spec.py")
    pool.start_broker()
    pool.add_executor([nan_spec], 1)
    pool.add_executor([nan_spec], 1)
    report = pool.wait_for_executors(2)
    assert [e.tools for e in report.executors] == [["scale"], ["scale"]]


def test_status_reports_executors_tools_capacity_and_latency_of_a_broker_and_of_one_executor(
        pool: Pool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], workers=2)
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        for i in range(5):
            assert client.call(Call(tool="work", kwargs={"tag": str(i)})).ok
    report = fetch(pool.frontend)
    assert report.role == "broker" and report.capacity == 2 and report.served == 5
    [executor] = report.executors
    assert executor.tools == ["lookup", "work"] and executor.served == 5
    [work] = [t for t in report.tools if t.name == "work"]
    assert work.calls == 5 and work.errors == 0 and work.buckets[-1] == 5

    assert main(["status", pool.frontend, "--json"]) == 0  # the command itself, in this process
    assert json.loads(capsys.readouterr().out)["served"] == 5
    assert main(["status", pool.frontend]) == 0
    text = capsys.readouterr().out
    assert "work" in text and executor.executor in text

    single = f"ipc://{tmp_path}/single.sock"
    proc = pool._spawn("single", ["serve", "--tools", POOL_TOOLS, "--bind", single])
    wait_until("the single executor", lambda: Path(single[6:]).exists())
    with ExecutorClient(single) as client:
        assert client.call(Call(tool="work", kwargs={"tag": "x"})).ok
    mine = fetch(single)
    assert mine.role == "executor" and mine.served == 1 and mine.executors[0].capacity == 1
    assert proc.poll() is None

    assert main(["status", f"ipc://{tmp_path}/nobody.sock", "--timeout", "0.5"]) == 1
    assert "no answer" in capsys.readouterr().err


def test_metrics_port_exposes_the_same_figures_to_prometheus(pool: Pool) -> None:
    broker_port, executor_port = free_port(), free_port()
    pool.start_broker("--metrics-port", str(broker_port))
    pool.add_executor([POOL_TOOLS], 1, "--metrics-port", f"127.0.0.1:{executor_port}")
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        for i in range(3):
            assert client.call(Call(tool="work", kwargs={"tag": str(i)})).ok

    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def served(port: int) -> bool:
        return 'ciayn_tool_calls_total{tool="work"} 3.0' in scrape(port)

    wait_until("the broker's metrics", lambda: served(broker_port), timeout=10)
    wait_until("the executor's metrics", lambda: served(executor_port), timeout=10)
    text = scrape(broker_port)
    assert "ciayn_executors 1.0" in text and "ciayn_capacity 1.0" in text
    assert 'ciayn_tool_call_seconds_bucket{le="+Inf",tool="work"} 3.0' in text


def test_a_client_resending_an_id_through_the_broker_gets_the_first_answer(pool: Pool, tmp_path: Path) -> None:
    """At most once at the broker: a duplicate id joins the running call or is answered from cache."""
    log = tmp_path / "side-effects.log"
    pool.start_broker()
    pool.add_executor([POOL_TOOLS], workers=2)
    pool.wait_for_executors(1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        first, second = _raw_clients(ctx, pool.frontend, 2)
        call = Call(tool="work", kwargs={"tag": "once", "log": str(log), "seconds": 0.3}, id=uuid.uuid4().hex)
        for sock in (first, first, second):  # a resend, and another client with the same id: one call
            sock.send_multipart(encode(call))
        answers = [decode(sock.recv_multipart()) for sock in (first, second) if sock.poll(10_000)]
        second.send_multipart(encode(call))  # after it finished: from the cache
        assert second.poll(5_000)
        answers.append(decode(second.recv_multipart()))
        assert not first.poll(200), "a resend from the same client is answered once"
        other = call.model_copy(update={"kwargs": {"tag": "other"}})  # the same id for another call
        first.send_multipart(encode(other))
        assert first.poll(5_000)
        refused = decode(first.recv_multipart())
    finally:
        ctx.destroy(0)
    assert len(answers) == 3 and all(isinstance(a, Result) and a.ok and a.id == call.id for a in answers)
    assert isinstance(refused, Result) and refused.error is not None and refused.error.kind == "protocol"
    assert "already used for a different call" in refused.error.message
    assert log.read_text().split() == ["once", log.read_text().split()[1]]


def test_a_client_flooding_the_broker_cannot_evict_another_clients_answer_and_nothing_runs_twice(
        pool: Pool, tmp_path: Path) -> None:
    """Client A's call runs on the first executor; client B then floods twice the broker's result cache
    in answers, and the first executor dies. A's resend is answered from the broker's cache (B's flood
    pushed out B's own oldest answers, not A's), and B's resend of its first id, whose answer is gone,
    is answered `unavailable` (already ran) rather than run again on the executor that is left."""
    log = tmp_path / "side-effects.log"
    pool.start_broker("--result-cache-mb", "1")
    first = pool.add_executor([BULK], 2)
    pool.wait_for_executors(1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        alice, bob = _raw_clients(ctx, pool.frontend, 2)
        mine = Call(tool="bulk", kwargs={"tag": "A", "log": str(log)}, id="A-" + uuid.uuid4().hex)
        [answer] = _ask(alice, [mine]).values()
        assert answer.ok, answer.error

        pool.add_executor([BULK], 2)
        pool.wait_for_executors(2)
        flood = [Call(tool="bulk", kwargs={"tag": f"B{i}", "log": str(log)}, id=uuid.uuid4().hex)
                 for i in range(32)]  # twice the 1 MiB cache
        assert all(r.ok for r in _ask(bob, flood).values())
        pool.kill(first)  # the executor that ran A's call, and holds it in its own cache, is gone
        pool.wait_for_executors(1)

        [again] = _ask(alice, [mine]).values()
        [gone] = _ask(bob, [flood[0]]).values()
    finally:
        ctx.destroy(0)
    assert again == answer, "the resend is answered with the first answer, from the broker's cache"
    assert gone.error is not None and gone.error.kind == "unavailable", gone
    assert "already ran" in gone.error.message and "not run again" in gone.error.message
    runs = collections.Counter(line.split()[0] for line in log.read_text().splitlines())
    assert runs["A"] == 1 and runs["B0"] == 1 and max(runs.values()) == 1, runs


def test_an_executor_cannot_answer_a_call_it_was_not_given_and_a_silent_one_is_dropped(pool: Pool) -> None:
    """Two fake executors on raw sockets: the one not given the call forges its answer (ignored); the
    one given it falls silent, and the call is answered `unavailable`, saying it may have run."""
    pool.start_broker()
    spec = ToolSpec(name="echo", signature="(x)", params=[Param(name="x")])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        fakes = {}
        for name in ("ex1", "ex2"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pool.backend)
            sock.send_multipart(encode(Ready(executor=name, incarnation=1, tools=[spec], limits=Limits())))
            fakes[name] = sock

        def beat(*names: str) -> None:
            for name in names:
                fakes[name].send_multipart(encode(Heartbeat(executor=name)))

        def joined() -> bool:
            beat("ex1", "ex2")
            return (r := pool.status(timeout=0.5)) is not None and len(r.executors) == 2

        wait_until("the fake executors to join", joined)
        with ExecutorClient(pool.frontend) as client:
            future = client.submit(Call(tool="echo", args=[1]))
            given = None
            deadline = time.monotonic() + 10
            while given is None and time.monotonic() < deadline:
                beat("ex1", "ex2")
                for name, sock in fakes.items():
                    while sock.poll(0):
                        msg = decode(sock.recv_multipart())
                        if isinstance(msg, Call):
                            given = (name, msg)
                    time.sleep(0.05)
            assert given is not None, "the broker sent the call to neither executor"
            holder, call = given
            [forger] = [n for n in fakes if n != holder]
            fakes[forger].send_multipart(encode(Result(id=call.id or "", ok=True, value="forged")))
            started = time.monotonic()
            while not future.done() and time.monotonic() - started < 10:
                beat(forger)  # it stays; the holder has gone silent
                time.sleep(0.2)
            r = future.result(timeout=1)
    finally:
        ctx.destroy(0)
    assert not r.ok and r.error is not None and r.error.kind == "unavailable", r
    assert "fell silent" in r.error.message and "may have run" in r.error.message
    assert r.value != "forged"


def test_a_restarted_broker_is_silent_long_enough_for_clients_to_resend_but_not_to_give_up() -> None:
    """The recovery window (protocol/timing.py) and the client's Lazy Pirate thresholds must agree."""
    from controller import client
    from protocol.timing import HEARTBEAT_INTERVAL, RECOVERY_WINDOW

    assert client.SILENCE_BEFORE_RECONNECT + HEARTBEAT_INTERVAL < RECOVERY_WINDOW < client.UNAVAILABLE_AFTER


@dataclass
class _Waiting:
    client: bytes
    name: str
    queued_at: float = 0.0
    timeout: float = 10.0
    nbytes: int = 0


def test_the_fair_queue_serves_clients_in_turn_and_a_newcomer_first() -> None:
    q: FairQueue[_Waiting] = FairQueue()
    for i in range(5):
        q.push(_Waiting(b"flood", f"f{i}"))
    assert q.take(lambda j: "w") is not None  # f0; the flood goes to the back of the line
    q.push(_Waiting(b"other", "o0"))
    q.push(_Waiting(b"other", "o1"))
    order = []
    while (taken := q.take(lambda j: "w")) is not None:
        order.append(taken[0].name)
    assert order == ["o0", "f1", "o1", "f2", "f3", "f4"]
    assert len(q) == 0 and not q.queues


def test_the_fair_queue_skips_a_call_no_executor_can_take_and_expires_in_one_pass() -> None:
    q: FairQueue[_Waiting] = FairQueue(scan_depth=2)
    for name in ("busy-tool", "free-tool", "free-tool-2"):
        q.push(_Waiting(b"a", name))
    taken = q.take(lambda j: None if j.name == "busy-tool" else "w")
    assert taken is not None and taken[0].name == "free-tool"
    assert q.take(lambda j: None if j.name == "busy-tool" else "w") is not None  # within the scan depth
    q.push(_Waiting(b"b", "late", queued_at=0.0, timeout=1.0))
    q.push(_Waiting(b"b", "fresh", queued_at=5.0, timeout=1.0))
    expired = q.expire(now=5.5)
    assert [j.name for j in expired] == ["late"] and len(q) == 2
    assert sorted(j.name for j in q) == ["busy-tool", "fresh"]
    assert q.remove(next(j for j in q if j.name == "fresh")) and not q.remove(_Waiting(b"z", "nobody"))
    assert len(q) == 1 and q.of(b"a") == 1 and q.of(b"b") == 0


def test_the_fair_queue_counts_the_bytes_waiting_in_all_and_per_client() -> None:
    q: FairQueue[_Waiting] = FairQueue()
    q.push(_Waiting(b"a", "a0", nbytes=100))
    q.push(_Waiting(b"a", "a1", nbytes=50))
    q.push(_Waiting(b"b", "b0", nbytes=7, queued_at=0.0, timeout=1.0))
    assert (q.bytes, q.bytes_of(b"a"), q.bytes_of(b"b")) == (157, 150, 7)
    assert [j.name for j in q.expire(now=2.0)] == ["b0"] and q.bytes_of(b"b") == 0
    taken = q.take(lambda j: "w")
    assert taken is not None and taken[0].name == "a0" and (q.bytes, q.bytes_of(b"a")) == (50, 50)
    assert q.remove(next(iter(q))) and q.bytes == 0 and not q.client_bytes


def test_the_broker_queue_is_bounded_in_bytes_in_all_and_per_client(pool: Pool) -> None:
    """With --max-queue-mb 1 (a quarter of it per client) and the one worker busy: a client's second
    300 KiB call passes its share and is refused, three clients' first calls fit, a fourth client's
    would pass the whole bound and is refused; none of the refused ran, the queued ones all do."""
    pool.start_broker("--max-queue-mb", "1")
    pool.add_executor([POOL_TOOLS], workers=1)
    pool.wait_for_executors(1)
    big = "x" * (300 * 1024)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        a, b, c, d = _raw_clients(ctx, pool.frontend, 4)

        def send(sock: zmq.Socket[bytes], tag: str, seconds: float = 0.0) -> None:
            sock.send_multipart(encode(Call(tool="work", kwargs={"tag": tag, "seconds": seconds},
                                            id=uuid.uuid4().hex)))

        send(a, "busy", seconds=2.0)
        wait_until("the worker to be busy", lambda: (r := pool.status()) is not None and r.busy == 1)
        send(a, big)
        send(a, big + "-again")
        over_share = _answer(a)
        for sock in (b, c):
            send(sock, big)
        wait_until("three calls queued", lambda: (r := pool.status()) is not None and r.queued == 3)
        send(d, big)
        over_total = _answer(d)
        later = [_answer(sock) for sock in (a, a, b, c)]
    finally:
        ctx.destroy(0)
    assert over_share.error is not None and over_share.error.kind == "unavailable", over_share
    assert "queue is full" in over_share.error.message and "share" in over_share.error.message
    assert over_total.error is not None and over_total.error.kind == "unavailable", over_total
    assert "MiB waiting" in over_total.error.message and "did not run" in over_total.error.message
    assert all(r.ok for r in later), [r.error for r in later]
    assert sorted(len(r.value["tag"]) for r in later) == [4] + [300 * 1024] * 3


def test_the_broker_journal_survives_a_restart_skips_a_torn_line_and_forgets_old_entries(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    journal.record("call-1", "ex-a")
    journal.record("call-2", "ex-b")
    journal.close()
    with open(journal.path, "a") as f:
        f.write(f"{time.time() - 7200:.3f} call-old ex-c\n")  # older than the journal's hour
        f.write("1234.5 call-torn")  # a broker killed mid-write
    again = Journal(tmp_path / "state")
    assert again.previous == {"call-1": "ex-a", "call-2": "ex-b"}
    assert len(again.path.read_text().splitlines()) == 2  # compacted to what is still remembered
    again.close()
    small = Journal(tmp_path / "small", max_entries=3)
    for i in range(10):
        small.record(f"c{i}", "ex")
    assert small.lines <= 4 and len(small.path.read_text().splitlines()) == small.lines
    small.close()


def test_a_linked_executor_tells_the_broker_at_once_which_calls_it_is_applying(tmp_path: Path) -> None:
    """``BrokerLink`` with its ``applying`` source, against a ROUTER standing in for the broker: a call
    that starts applying is named in a heartbeat sent on the link's next turn, not half a second later,
    and in every heartbeat until it is done."""
    from executor.clientside.brokerlink import BrokerLink
    from protocol.timing import HEARTBEAT_INTERVAL

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/backend.sock"
    router.bind(endpoint)
    applying: set[str] = set()
    link = BrokerLink(ctx, endpoint, announce=lambda: Ready(executor="e-1", incarnation=1, tools=[], limits=Limits()),
                      applying=lambda: applying)
    assert not router.poll(100), "a link announced itself before its executor knew its tools"
    link.start()

    def heartbeat(within: float) -> Heartbeat | None:
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            link.tick(time.monotonic())
            if router.poll(min(10, int(left * 1000) + 1)):
                msg = decode(router.recv_multipart()[1:])
                if isinstance(msg, Heartbeat):
                    return msg
        return None

    try:
        assert router.poll(5000) and isinstance(decode(router.recv_multipart()[1:]), Ready)
        first = heartbeat(2.0)  # the first one, due at once
        assert first is not None and first.applying == []
        applying.add("c-1")
        started = time.monotonic()
        told = heartbeat(2.0)
        assert told is not None and told.applying == ["c-1"]
        assert time.monotonic() - started < HEARTBEAT_INTERVAL / 2, "the notice waited for the next heartbeat"
        again = heartbeat(2.0)
        assert again is not None and again.applying == ["c-1"]
        applying.clear()
        done = heartbeat(2.0)
        assert done is not None and done.applying == []
    finally:
        link.close()
        router.close(0)
        ctx.term()


def test_reconnection_backs_off_exponentially_up_to_a_bound() -> None:
    from protocol.timing import RECONNECT_INITIAL, RECONNECT_MAX, backoff

    waits = [backoff(n) for n in range(10)]
    assert waits[0] == RECONNECT_INITIAL and waits[1] == 2 * RECONNECT_INITIAL
    assert all(b == min(RECONNECT_MAX, 2 * a) for a, b in itertools.pairwise(waits))
    assert max(waits) == RECONNECT_MAX == backoff(10**6)


def test_status_latency_quantiles_are_upper_bounds_from_the_histogram() -> None:
    from executor.metrics import CallStats, quantile

    stats = CallStats()
    for wall in (0.002, 0.002, 0.003, 0.2):
        stats.observe("t", Result(id="x", ok=True), wall)
    [t] = stats.tool_stats()
    assert t.calls == 4 and t.buckets[-1] == 4
    assert quantile(t, 0.5) == 0.0025 and quantile(t, 0.95) == 0.25


def test_cli_refuses_contradictory_pool_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*args: str) -> tuple[int, str]:
        """In this process: each of these fails before anything is started or forked."""
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = int(e.code or 0)
        return code, capsys.readouterr().err

    code, err = run("serve", "--tools", POOL_TOOLS, "--bind", "ipc:///tmp/x.sock", "--connect", "ipc:///tmp/y.sock")
    assert code == 2 and "not allowed with argument" in err
    code, err = run("serve", "--tools", POOL_TOOLS, "--connect", "tcp://127.0.0.1:1", "--curve-secret", "k",
                    "--curve-clients", str(tmp_path))
    assert code == 2 and "--curve-clients is for --bind" in err
    code, err = run("serve", "--tools", POOL_TOOLS, "--bind", "ipc:///tmp/x.sock", "--curve-server-key", "k")
    assert code == 2 and "--curve-server-key is for --connect" in err
    code, err = run("broker", "--frontend", "tcp://127.0.0.1:1", "--backend", "tcp://127.0.0.1:2", "--curve-clients",
                    "d")
    assert code == 2 and "need --curve-secret" in err
    code, err = run("broker", "--frontend", "bogus://x", "--backend", f"ipc://{tmp_path}/b.sock")
    assert code == 1 and "frontend: cannot bind bogus://x" in err
    code, err = run("broker", "--frontend", f"ipc://{tmp_path}/f.sock", "--backend", "tcp://127.0.0.1:1")
    assert code == 1 and "backend: refusing to serve on tcp://127.0.0.1:1" in err
    assert not (tmp_path / "f.sock").exists()  # the frontend it had bound is gone again
    _, sec = keygen(tmp_path / "keys", "broker")
    code, err = run("broker", "--frontend", f"ipc://{tmp_path}/f.sock", "--backend", f"ipc://{tmp_path}/b.sock",
                    "--curve-secret", str(sec))
    assert code == 1 and "needs --curve-executors" in err


def test_serve_connect_refuses_a_broker_over_plain_tcp() -> None:
    out = subprocess.run([sys.executable, "-m", "executor.cli", "serve", "--tools", POOL_TOOLS, "--connect",
                          "tcp://127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "refusing to connect" in out.stderr and "--insecure" in out.stderr
