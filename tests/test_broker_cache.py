"""The broker's memory of answered calls is the executor's call table: ids accepted to run are kept
apart from results, and the result cache is fair per client. Real broker and executor processes,
real sockets; a side-effect log written by the tool is the ground truth of what ran."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from protocol import Call, Result, decode, encode
from tests.pool import ROOT, Pool

BULK = str(ROOT / "tests" / "tools" / "pool_bulk.py")
FLOOD = 32  # calls of 64 KiB answers: twice the broker's 1 MiB cache in these tests
ANSWER_BOUND_MS = 30_000  # per answer, on a loaded machine


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.stop()


def _runs(log: Path) -> collections.Counter[str]:
    return collections.Counter(line.split()[0] for line in log.read_text().splitlines() if line)


def _ask(sock: zmq.Socket[bytes], calls: list[Call]) -> dict[str, Result]:
    """Send ``calls`` and wait (bounded) for one answer to each, by id."""
    for call in calls:
        sock.send_multipart(encode(call))
    answers: dict[str, Result] = {}
    while len(answers) < len(calls):
        assert sock.poll(ANSWER_BOUND_MS), f"{len(calls) - len(answers)} calls unanswered"
        msg = decode(sock.recv_multipart())
        assert isinstance(msg, Result), msg
        answers[msg.id] = msg
    return answers


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
        alice, bob = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (alice, bob):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pool.frontend)
        mine = Call(tool="bulk", kwargs={"tag": "A", "log": str(log)}, id="A-" + uuid.uuid4().hex)
        [answer] = _ask(alice, [mine]).values()
        assert answer.ok, answer.error

        pool.add_executor([BULK], 2)
        pool.wait_for_executors(2)
        flood = [Call(tool="bulk", kwargs={"tag": f"B{i}", "log": str(log)}, id=uuid.uuid4().hex)
                 for i in range(FLOOD)]
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
    runs = _runs(log)
    assert runs["A"] == 1 and runs["B0"] == 1 and max(runs.values()) == 1, runs
