"""The pool's speed targets (issue 12), measured side by side in one run; writes bench-results/pool.json.

1. Per-call overhead: sequential calls of a tool that does nothing, (a) to one executor over ipc, (b)
   through a broker over tcp on loopback, (c) the same with CurveZMQ on both broker sockets. The
   three are measured in interleaved rounds so that the machine's load hits them alike. Target: (b)
   at most 2x (a).
2. Scaling: a tool that sleeps 10 ms, through a broker with 1, 2, 4, 8 and 16 workers in total
   (executors of up to 4 workers each), with twice as many calls in flight as workers, for a fixed
   window. Target: at least 0.85 x linear (calls/s per worker, relative to one worker).

All executors reuse their workers (``--reuse-workers``): this measures the pool, not the fork of a
fresh worker per call (scripts/benchmarks/fresh.py measures that). The figure ``broker_pool`` of
``scripts/bench`` is ``run()`` at its ``--quick`` size; ``python -m scripts.benchmarks.broker
[--quick]`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from controller import ExecutorClient
from protocol import Call
from protocol.curve import keygen, load_pair, load_public
from tests.support.net import free_port
from tests.support.pool import POOL_TOOLS, Pool

from . import report
from .paths import RESULTS
from .record import log, measured, not_built
from .registry import Context, figure

OUT = RESULTS / "pool.json"
TITLE = "Broker overhead and scaling (scripts/benchmarks/broker.py --quick)"
SLEEP_S = 0.010
WORKERS = (1, 2, 4, 8, 16)
PER_EXECUTOR = 4


@contextmanager
def _pool(tmp: Path, workers: int, *, tcp: bool = True, curve: bool = False) -> Iterator[tuple[Pool, dict[str, Any]]]:
    """A broker (tcp on loopback, or ipc) and executors with ``workers`` workers in total."""
    frontend = f"tcp://127.0.0.1:{free_port()}" if tcp else None
    backend = f"tcp://127.0.0.1:{free_port()}" if tcp else None
    keys: dict[str, Any] = {}
    broker_args, executor_args = ["--recovery-s", "0"], ["--reuse-workers"]
    if curve:
        pub, sec = keygen(tmp / "broker", "broker")
        _, client = keygen(tmp / "clients", "client")
        _, worker = keygen(tmp / "executors", "worker")
        broker_args += ["--curve-secret", str(sec), "--curve-clients", str(tmp / "clients"),
                        "--curve-executors", str(tmp / "executors")]
        executor_args += ["--curve-secret", str(worker), "--curve-server-key", str(pub)]
        keys = {"curve_server_key": load_public(pub), "curve_keys": load_pair(client)}
    elif tcp:
        broker_args.append("--insecure")
        executor_args.append("--insecure")
    pool = Pool(tmp, frontend=frontend, backend=backend, status_keys=keys)
    try:
        pool.start_broker(*broker_args, recovery_s=0)
        sizes = [min(PER_EXECUTOR, workers - i) for i in range(0, workers, PER_EXECUTOR)]
        for n in sizes:
            pool.add_executor([POOL_TOOLS], n, *executor_args)
        pool.wait_for_executors(len(sizes))
        yield pool, keys
    finally:
        pool.stop()


@contextmanager
def _single(tmp: Path) -> Iterator[str]:
    """One executor over ipc, no broker."""
    endpoint = f"ipc://{tmp}/single.sock"
    pool = Pool(tmp)
    try:
        pool._spawn("single", ["serve", "--tools", POOL_TOOLS, "--bind", endpoint, "--reuse-workers"])
        deadline = time.monotonic() + 30
        while not Path(endpoint[6:]).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the single executor did not start")
            time.sleep(0.05)
        yield endpoint
    finally:
        pool.stop()


def _round_trips(client: ExecutorClient, n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        r = client.call(Call(tool="work", kwargs={"tag": str(i)}))
        out.append(time.perf_counter() - started)
        if not r.ok:
            raise RuntimeError(f"a benchmark call failed: {r.error}")
    return out


def overhead(rounds: int, per_round: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ciayn-bench-") as t:
        tmp = Path(t)
        (tmp / "a").mkdir(mode=0o700)
        (tmp / "b").mkdir(mode=0o700)
        (tmp / "c").mkdir(mode=0o700)
        with _single(tmp / "a") as direct, _pool(tmp / "b", 1) as (plain, _), \
                _pool(tmp / "c", 1, curve=True) as (secure, keys):
            clients = {"direct_ipc": ExecutorClient(direct), "broker_tcp": ExecutorClient(plain.frontend),
                       "broker_tcp_curve": ExecutorClient(secure.frontend, **keys)}
            samples: dict[str, list[float]] = {name: [] for name in clients}
            try:
                for c in clients.values():
                    _round_trips(c, 20)  # warm up: connections, the first worker
                for _ in range(rounds):
                    for name, c in clients.items():
                        samples[name] += _round_trips(c, per_round)
            finally:
                for c in clients.values():
                    c.close()
    medians = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
    p90 = {name: sorted(s)[int(len(s) * 0.9)] * 1e6 for name, s in samples.items()}
    ratio = medians["broker_tcp"] / medians["direct_ipc"]
    return {
        "calls_each": rounds * per_round,
        "median_us": {k: round(v, 1) for k, v in medians.items()},
        "p90_us": {k: round(v, 1) for k, v in p90.items()},
        "broker_tcp_over_direct_ipc": round(ratio, 2),
        "broker_tcp_curve_over_direct_ipc": round(medians["broker_tcp_curve"] / medians["direct_ipc"], 2),
        "target": {"at_most": 2.0, "met": ratio <= 2.0},
    }


def _rate(client: ExecutorClient, in_flight: int, window: float, warmup: float = 0.5) -> float:
    """Calls per second completed in ``window`` (after ``warmup``), ``in_flight`` calls always outstanding."""
    finished_at: list[float] = []
    errors: list[str] = []
    slots = threading.Semaphore(in_flight)

    def finished(f: Any) -> None:
        r = f.result()
        finished_at.append(time.monotonic())  # list.append is atomic
        if not r.ok:
            errors.append(str(r.error))
        slots.release()

    start = time.monotonic() + warmup
    end = start + window
    while time.monotonic() < end:
        if slots.acquire(timeout=1):
            client.submit(Call(tool="work", kwargs={"tag": "x", "seconds": SLEEP_S})).add_done_callback(finished)
    for _ in range(in_flight):
        slots.acquire(timeout=10)
    if errors:
        raise RuntimeError(f"benchmark calls failed: {errors[0]}")
    return sum(1 for t in finished_at if start <= t < end) / window


def _cpu_s(pool: Pool) -> dict[str, float]:
    """CPU seconds used so far by each part of the pool, and by this process (the client)."""
    def total(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return 0.0

    assert pool.broker is not None
    supervisors = [psutil.Process(e.pid) for e in pool.executors]
    return {"client": total(psutil.Process()), "broker": total(psutil.Process(pool.broker.pid)),
            "executors": sum(total(p) for p in supervisors),
            "workers": sum(total(c) for p in supervisors for c in p.children(recursive=True))}


def scaling(window: float, workers: tuple[int, ...] = WORKERS) -> dict[str, Any]:
    rates = []
    cpu_per_call: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ciayn-bench-") as t:
        for w in workers:
            tmp = Path(t) / f"w{w}"
            tmp.mkdir(mode=0o700)
            with _pool(tmp, w) as (pool, _), ExecutorClient(pool.frontend, timeout=30) as client:
                client.tools()
                before, started = _cpu_s(pool), time.monotonic()
                rates.append(_rate(client, 2 * w, window))
                after, took = _cpu_s(pool), time.monotonic() - started
                calls = max(1.0, rates[-1] * took)  # about: the window's rate over the whole measurement
                cpu_per_call[str(w)] = {k: round((after[k] - before[k]) / calls * 1e6) for k in before}
    per_worker_1 = rates[0] / workers[0]
    efficiency = [round(r / (w * per_worker_1), 3) for r, w in zip(rates, workers, strict=True)]
    worst = min(efficiency)
    return {
        "tool": f"sleeps {SLEEP_S * 1000:g} ms",
        "workers": list(workers),
        "calls_per_s": [round(r, 1) for r in rates],
        "ideal_calls_per_s": [round(w / SLEEP_S, 1) for w in workers],
        "efficiency_vs_1_worker": efficiency,
        "cpu_us_per_call": cpu_per_call,
        "note": "CPU per call summed over the pool's processes bounds calls/s at cpus / that sum",
        "target": {"at_least": 0.85, "worst": worst, "met": worst >= 0.85},
    }


def run(quick: bool = False, out: Path = OUT) -> dict[str, Any]:
    """Measure both figures and write them to ``out`` (bench-results/pool.json)."""
    result = {
        "benchmark": "pool (issue 12): broker overhead and scaling",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "overhead": overhead(rounds=3 if quick else 10, per_round=30 if quick else 100),
        "scaling": scaling(window=1.0 if quick else 3.0, workers=(1, 2, 4) if quick else WORKERS),
    }
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


@figure("broker_pool", "the broker's per-call overhead, with and without CurveZMQ, and scaling through it "
        "(issue 12)", order=110, table=report.table_broker)
def broker_pool(context: Context) -> dict[str, Any]:
    """The pool's own benchmark (issue 12), run as part of the whole. Its figures go into
    results.json; its own bench-results/pool.json (a full run of it) is left alone."""
    if not context.features.broker:
        return not_built(context.features.missing("broker"), title=TITLE)
    if context.tiny:  # its public parts at the smallest size: the code path, not the numbers
        return measured(title=TITLE, overhead=overhead(rounds=1, per_round=3),
                        scaling=scaling(window=0.1, workers=(1,)))
    # Its --quick size: the full one takes about 50 s here, and pool_scaling already goes to 16 workers.
    log("broker pool: scripts/benchmarks/broker.py --quick")
    return measured(title=TITLE, **run(quick=True, out=Path(context.tmp) / "pool.json"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls and workers (a smoke run)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the figures (default: {OUT})")
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.out), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
