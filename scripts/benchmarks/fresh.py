"""What a fresh worker per call costs (issue 9), side by side with --reuse-workers in one run.

    .venv/bin/python -m scripts.benchmarks.fresh [--quick]      writes bench-results/fresh.json

Three figures, fresh workers (the default) against --reuse-workers, measured in interleaved rounds:

- p50 of a no-op call at low load: one call at a time with a pause between calls (an agent thinks
  between tool calls), so the worker forked ahead is ready when the call comes;
- p50 of back-to-back calls (the next call sent as soon as the last was answered): then a call may
  wait for the replacement worker to be forked;
- sustained throughput: many calls in flight against --workers 2;

and the supervisor's RSS after it all. The figure ``fresh_workers`` of ``scripts/bench`` is
``run()`` at its size; targets: low-load p50 within 1.2x of --reuse-workers, at least 200 calls/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import psutil

from controller import ExecutorClient, LocalExecutor
from protocol import Call

from . import report
from .contestants import PAUSE_S
from .paths import RESULTS, ROOT
from .record import log, measured
from .registry import Context, figure

TITLE = "What a fresh worker per call costs (scripts/benchmarks/fresh.py)"

TOOLS = str(ROOT / "tests" / "tools" / "faulty.py")


def _p50_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def _timed(client: ExecutorClient, n: int, pause: float) -> list[float]:
    out = []
    for _ in range(n):
        if pause:
            time.sleep(pause)
        t = time.perf_counter()
        r = client.call(Call(tool="noop"))
        out.append(time.perf_counter() - t)
        if not r.ok:
            raise RuntimeError(f"a no-op call failed: {r.error}")
    return out


def _throughput(client: ExecutorClient, total: int, in_flight: int = 100) -> float:
    t = time.perf_counter()
    done = 0
    while done < total:
        batch = [client.submit(Call(tool="noop")) for _ in range(min(in_flight, total - done))]
        wait(batch, timeout=120)
        failed = [f.result().error for f in batch if not f.result().ok]
        if failed:
            raise RuntimeError(f"{len(failed)} calls failed, e.g. {failed[0]}")
        done += len(batch)
    return round(total / (time.perf_counter() - t), 1)


def run(quick: bool = False, size: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """``size``: (interleaved rounds, calls per round and mode, calls for the throughput)."""
    rounds, per_round, total = size or ((2, 10, 100) if quick else (6, 40, 2000))
    modes = {"fresh": {}, "reuse_workers": {"reuse_workers": True}}
    low: dict[str, list[float]] = {m: [] for m in modes}
    busy: dict[str, list[float]] = {m: [] for m in modes}
    throughput: dict[str, float] = {}
    rss_mb: dict[str, float] = {}
    locals_ = {"fresh": LocalExecutor(tools=[TOOLS], workers=2, log_level="warning"),
               "reuse_workers": LocalExecutor(tools=[TOOLS], workers=2, log_level="warning", reuse_workers=True)}
    with locals_["fresh"] as fresh, locals_["reuse_workers"] as reuse:
        clients = {"fresh": fresh, "reuse_workers": reuse}
        for client in clients.values():
            _timed(client, 10, 0.0)  # warm up
        for _ in range(rounds):  # interleaved: both modes see the same machine
            for mode, client in clients.items():
                low[mode] += _timed(client, per_round, PAUSE_S)
                busy[mode] += _timed(client, per_round, 0.0)
        for mode, client in clients.items():
            throughput[mode] = _throughput(client, total)
            proc = locals_[mode].proc
            assert proc is not None
            rss_mb[mode] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
    result: dict[str, Any] = {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "load_1min": round(os.getloadavg()[0], 2)},
        "low_load_p50_us": {m: _p50_us(v) for m, v in low.items()},
        "back_to_back_p50_us": {m: _p50_us(v) for m, v in busy.items()},
        "throughput_calls_per_s": throughput,
        "supervisor_rss_mb": rss_mb,
        "pause_between_calls_s": PAUSE_S,
        "samples_per_mode": rounds * per_round,
    }
    ratio = result["low_load_p50_us"]["fresh"] / result["low_load_p50_us"]["reuse_workers"]
    result["targets"] = {
        "fresh_vs_reuse_low_load_p50": {"value": round(ratio, 2), "at_most": 1.2, "met": ratio <= 1.2},
        "fresh_throughput": {"value": throughput["fresh"], "at_least": 200, "met": throughput["fresh"] >= 200},
    }
    return result


@figure("fresh_workers", "fresh workers (the default) against --reuse-workers: p50 apart and back to back, "
        "calls/s (issue 9)", order=20, chart=report.chart_fresh, table=report.table_fresh)
def fresh_workers(context: Context) -> dict[str, Any]:
    """Issue 9's figures: fresh workers (the default) against --reuse-workers, interleaved, with
    calls 20 ms apart (low load, the target's measure), back to back, and sustained."""
    log("fresh workers: scripts/benchmarks/fresh.py")
    data = run(size=(1, 3, 20) if context.tiny else (4, 30, 1000))
    t = data.pop("targets")
    targets = {"fresh_vs_reuse_workers_p50, calls 20 ms apart (issue 9)": t["fresh_vs_reuse_low_load_p50"],
               "fresh_workers_calls_per_s, sustained (issue 9)": t["fresh_throughput"]}
    return measured(title=TITLE, targets=targets, **{k: v for k, v in data.items() if k != "machine"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few calls only (the test suite's size)")
    parser.add_argument("--out", default=str(RESULTS / "fresh.json"))
    args = parser.parse_args()
    result = run(quick=args.quick)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
