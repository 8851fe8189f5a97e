"""The pool under faults: real broker and executor processes, real sockets, real SIGKILLs.

A side-effect log written by the tools themselves (one ``O_APPEND`` line per run) is the ground
truth of what ran: no call of a non-idempotent tool may appear twice, and every ``ok`` answer must
have run exactly once.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller import ExecutorClient
from protocol import Call
from tests.support.pool import POOL_TOOLS, ROOT, Pool
from tests.support.waiting import wait_until

CONTROLLERS = 8
CALLS = 500
EXECUTORS = 3
WORKERS = 2


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.stop()


def _runs(log: Path) -> collections.Counter[str]:
    """How many times each `work` tag ran, from the side-effect log."""
    if not log.exists():
        return collections.Counter()
    return collections.Counter(line.split()[0] for line in log.read_text().splitlines() if line and
                               not line.startswith("start "))


def test_load_with_an_executor_killed_and_another_joining_answers_every_call_once(pool: Pool, tmp_path: Path) -> None:
    log = tmp_path / "side-effects.log"
    pool.start_broker()
    # The subject is the pool, not worker isolation: the executors reuse their workers, which makes
    # 4000 calls three times faster than a fresh fork per call on a 2-core machine.
    victims = [pool.add_executor([POOL_TOOLS], WORKERS, "--reuse-workers") for _ in range(EXECUTORS)]
    pool.wait_for_executors(EXECUTORS)

    outs = [tmp_path / f"controller-{i}.jsonl" for i in range(CONTROLLERS)]
    controllers = [
        subprocess.Popen([sys.executable, str(ROOT / "tests" / "tools" / "pool_controller.py"), pool.frontend,
                          f"c{i}", str(CALLS), str(log), str(out)], cwd=ROOT, stderr=subprocess.PIPE)
        for i, out in enumerate(outs)
    ]
    try:
        # Mid-run: a quarter of the calls have run. Kill one executor outright; a new one joins.
        wait_until("a quarter of the calls to run", lambda: sum(_runs(log).values()) >= CONTROLLERS * CALLS // 4,
                   timeout=120)
        pool.kill(victims[0])
        pool.add_executor([POOL_TOOLS], WORKERS, "--reuse-workers")
        for c in controllers:
            _, err = c.communicate(timeout=180)
            assert c.returncode == 0, err.decode(errors="replace")[-2000:]
    finally:
        for c in controllers:
            if c.poll() is None:
                c.kill()

    answers = [json.loads(line) for out in outs for line in out.read_text().splitlines() if line]
    assert len(answers) == CONTROLLERS * CALLS  # every call answered...
    assert len({a["id"] for a in answers}) == len(answers)  # ...exactly once
    for a in answers:  # and the answer reached the caller that asked
        assert a["got_id"] == a["id"]
        if a["ok"]:
            assert a["got_tag"] == a["tag"]
    runs = _runs(log)
    twice = [tag for tag, n in runs.items() if n > 1]
    assert not twice, f"ran more than once: {twice[:10]}"
    for a in answers:
        if a["tool"] == "work" and a["ok"]:
            assert runs[a["tag"]] == 1, a
    failed = [a for a in answers if not a["ok"]]
    # Only calls in flight on the killed executor may fail (at most its workers' worth), saying they may have run.
    assert len(failed) <= WORKERS, failed
    for a in failed:
        assert a["tool"] == "work" and a["kind"] in ("crashed", "unavailable"), a
        assert "may have run" in a["message"]
    report = pool.status()
    assert report is not None and len(report.executors) == EXECUTORS
    newcomer = [e for e in report.executors if e.served > 0]
    assert len(newcomer) == EXECUTORS, "the executor that joined mid-run took calls too"


@pytest.mark.parametrize("outage", ["at once", "after the executors notice"])
def test_broker_killed_and_restarted_mid_run_loses_no_answer_and_runs_nothing_twice(
        pool: Pool, tmp_path: Path, outage: str) -> None:
    """Restarted at once, the executors' connections come back by themselves and the new broker asks
    them to announce again; restarted later, they have dropped their connections and reconnect with
    backoff. Either way they re-announce the calls they hold."""
    log = tmp_path / "side-effects.log"
    pool.start_broker()
    executors = [pool.add_executor(workers=2) for _ in range(2)]
    pool.wait_for_executors(2)
    with ExecutorClient(pool.frontend, timeout=30) as client:
        client.tools()
        # Running when the broker dies: four calls that take a while. Queued behind them: four more.
        calls = [Call(tool="work", kwargs={"tag": f"t{i}", "log": str(log), "seconds": 1.5}, id=uuid.uuid4().hex)
                 for i in range(8)]
        futures = [client.submit(c) for c in calls]
        wait_until("four calls running", lambda: (r := pool.status()) is not None and r.busy == 4)
        assert pool.broker is not None
        pool.kill(pool.broker)
        if outage != "at once":  # they drop their connections and back off, holding their results
            wait_until("the executors to notice the broker is gone",
                       lambda: all("has been silent" in pool.log(e) for e in executors), timeout=15)
        late = client.submit(Call(tool="work", kwargs={"tag": "late", "log": str(log)}, id=uuid.uuid4().hex))
        pool.start_broker(recovery_s=3.0)  # the default window: executors re-announce what they hold
        results = [f.result(timeout=60) for f in [*futures, late]]
    assert [r.ok for r in results] == [True] * 9, [r.error for r in results if not r.ok]
    assert [r.value["tag"] for r in results] == [f"t{i}" for i in range(8)] + ["late"]
    runs = _runs(log)
    assert runs == collections.Counter({f"t{i}": 1 for i in range(8)} | {"late": 1})
    assert all(e.poll() is None for e in executors), "the executors recovered without restarting"
    if outage == "at once":
        assert not any("has been silent" in pool.log(e) for e in executors)
        assert all("announce itself again" in pool.log(e) for e in executors)


def test_calls_of_an_idempotent_tool_are_rerun_once_elsewhere_when_their_executor_dies(
        pool: Pool, tmp_path: Path) -> None:
    log = tmp_path / "side-effects.log"
    pool.start_broker()
    first = pool.add_executor(workers=2)
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend, timeout=60) as client:
        client.tools()
        rerun = client.submit(Call(tool="lookup", kwargs={"tag": "L", "log": str(log), "seconds": 8}))
        lost = client.submit(Call(tool="work", kwargs={"tag": "W", "log": str(log), "seconds": 30}))
        wait_until("both calls running", lambda: (r := pool.status()) is not None and r.busy == 2)
        pool.add_executor(workers=2)
        pool.wait_for_executors(2)
        assert not rerun.done(), "the machine is too slow for this test: the 8 s call finished before the fault"
        pool.kill(first)
        other = lost.result(timeout=30)
        idempotent = rerun.result(timeout=30)
    assert other.error is not None and other.error.kind == "unavailable", other.error
    assert "may have run" in other.error.message
    assert idempotent.ok, idempotent.error
    starts = [line.split()[2] for line in log.read_text().splitlines() if line.startswith("start L ")]
    assert len(starts) == 2 and starts[0] != starts[1], "started once on each executor"
    assert _runs(log)["W"] == 0


def test_with_a_journal_a_restarted_broker_does_not_rerun_a_call_whose_executor_died_meanwhile(
        pool: Pool, tmp_path: Path) -> None:
    """The double fault: the broker and the executor running a call both die. With --state-dir the
    restarted broker knows it sent the call there, answers the client's resend `unavailable` (may have
    run) instead of running it again, and re-runs the idempotent call elsewhere."""
    log = tmp_path / "side-effects.log"
    state = ["--state-dir", str(tmp_path / "state")]
    pool.start_broker(*state)
    first = pool.add_executor(workers=2)
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend, timeout=30) as client:
        client.tools()
        lost = client.submit(Call(tool="work", kwargs={"tag": "W", "log": str(log), "seconds": 8}))
        rerun = client.submit(Call(tool="lookup", kwargs={"tag": "L", "log": str(log), "seconds": 6}))
        wait_until("both calls running on the first executor", lambda: (r := pool.status()) is not None and r.busy == 2)
        pool.add_executor(workers=2)  # where the idempotent call can run again
        pool.wait_for_executors(2)
        assert not rerun.done(), "the machine is too slow for this test: the 6 s call finished before the faults"
        assert pool.broker is not None
        pool.kill(pool.broker)
        pool.kill(first)
        pool.start_broker(*state, recovery_s=3.0)
        other, idempotent = lost.result(timeout=60), rerun.result(timeout=60)
    assert other.error is not None and other.error.kind == "unavailable", other.error
    assert "may have run" in other.error.message and "has not come back" in other.error.message
    assert idempotent.ok, idempotent.error
    assert _runs(log)["W"] == 0  # killed before it finished, and not run again
    assert len([line for line in log.read_text().splitlines() if line.startswith("start L ")]) == 2
