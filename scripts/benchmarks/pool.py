"""Figure 4: pool scaling. Calls per second against the total number of workers, for a no-op tool and
for a tool that sleeps 10 ms, with 1, 4 and 8 controller processes (each an ``ExecutorClient``)
sharing the load. Closed loop: the controllers keep twice as many calls in flight as there are
workers, split between them, and count the calls completed inside a common window.

Through a broker over tcp with two executors sharing the N workers (``serve --connect``) when the
broker exists, else with one executor (``serve --workers N``).

Where the CPU goes: at the most workers, one more window of the sleeping tool with every
controller, ``CPU_WINDOWS`` times as long (CPU times count in clock ticks), is measured in CPU
seconds per call of each part (controllers, broker, executors' supervisors, their workers and
templates, reaped ones included). On a machine shared with other work the calls/s figures say more
about the load than the pool; the CPU per call does not. From it: ``cpu_bound_calls_per_s``, what
the machine's cores would allow if the pool had them to itself (cores / CPU per call), and that
over linear, both from one worker's measured rate (``cpu_bound_scaling_vs_1_worker``, the target's
measure) and from the tool's ideal (``cpu_bound_scaling_vs_ideal``, 100 calls/s a worker)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
from typing import Any

import psutil

from . import report
from .contestants import read_line, start_peer, stop_peer
from .executors import Running, brokered, direct
from .record import log, measured
from .registry import Context, figure

TOOLS: dict[str, dict[str, Any]] = {"noop": {}, "nap": {"ms": 10.0}}
SLEEP_S = 0.010
WINDOW_TIMEOUT = 60.0
CPU_WINDOWS = 8  # the CPU-per-call window is this many windows long


class Controllers:
    """Controller processes kept for the whole figure; ``rate`` runs a window on the first ``n``."""

    def __init__(self, count: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for _ in range(count):
                self.procs.append(start_peer("controller"))
        except BaseException:
            self.close()
            raise

    def window(self, n: int, endpoint: str, tool: str, inflight_total: int, warmup: float, duration: float) -> list[
            dict[str, Any]]:
        inflight = max(1, math.ceil(inflight_total / n))
        command = {"endpoint": endpoint, "tool": tool, "kwargs": TOOLS[tool], "inflight": inflight,
                   "start_at": time.monotonic() + warmup, "duration": duration}
        for proc in self.procs[:n]:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        answers = [json.loads(read_line(proc, WINDOW_TIMEOUT + warmup + duration)) for proc in self.procs[:n]]
        errors = [a["first_error"] for a in answers if a["errors"] or a["first_error"]]
        if errors:
            raise RuntimeError(f"calls failed during the pool benchmark: {errors[0]}")
        return answers

    def close(self) -> None:
        for proc in self.procs:
            stop_peer(proc)


def _tree_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of ``proc`` and its descendants, those already reaped included."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _cpu_s(running: Running, controllers: list[int], via_broker: bool) -> dict[str, float]:
    """CPU seconds used so far by each part of the pool and by the controllers."""
    def own(pid: int) -> float:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)

    supervisors = running.roots[1:] if via_broker else running.roots
    parts = {"controllers": sum(own(pid) for pid in controllers),
             "broker": own(running.roots[0]) if via_broker else 0.0,
             "supervisors": sum(own(pid) for pid in supervisors)}
    trees = 0.0
    for pid in supervisors:
        with contextlib.suppress(psutil.Error):
            trees += _tree_cpu_s(psutil.Process(pid))
    parts["workers"] = trees - parts["supervisors"]  # and their templates
    return parts


def _cpu_per_call(before: dict[str, float], after: dict[str, float], calls: float, workers: int,
                  one_worker_rate: float) -> dict[str, Any]:
    per_call = {k: round((after[k] - before[k]) / max(calls, 1.0) * 1e6) for k in before}
    total = sum(per_call.values())
    bound = len(os.sched_getaffinity(0)) * 1e6 / max(total, 1)
    return {"workers": workers, "us": per_call, "total_us": total, "cpu_bound_calls_per_s": round(bound, 1),
            "cpu_bound_scaling_vs_1_worker": round(bound / (workers * one_worker_rate), 3) if one_worker_rate else None,
            "cpu_bound_scaling_vs_ideal": round(bound / (workers / SLEEP_S), 3)}


def _scaling(rates: dict[str, list[float]], workers: tuple[int, ...]) -> dict[str, list[float | None]]:
    """calls/s at N workers over N x calls/s at one worker, per controller count."""
    return {c: [round(rate / (w * series[0]), 3) if series[0] else None
                for w, rate in zip(workers, series, strict=True)] for c, series in rates.items()}


@figure(
    "pool_scaling",
    "calls/s against total workers for a no-op and a 10 ms tool, with 1 to 8 controllers",
    order=70, chart=report.chart_pool, table=report.table_pool,
)
def pool_scaling(context: Context) -> dict[str, Any]:
    features, sizes = context.features, context.sizes
    via = "broker over tcp, 2 executors" if features.broker else "one executor over ipc (no broker yet)"
    modes: dict[str, list[str]] = {"default flags": []}
    if features.reuse_workers:
        modes["--reuse-workers"] = ["--reuse-workers"]
    log(f"pool scaling ({via}; {', '.join(modes)}): workers {list(sizes.pool_workers)} x controllers "
        f"{list(sizes.pool_controllers)}")
    series: dict[str, dict[str, dict[str, list[float]]]] = {
        mode: {tool: {str(c): [] for c in sizes.pool_controllers} for tool in TOOLS} for mode in modes}
    cpu: dict[str, dict[str, Any]] = {}
    controllers = Controllers(max(sizes.pool_controllers))
    pids = [p.pid for p in controllers.procs]
    try:
        for mode, extra in modes.items():
            for workers in sizes.pool_workers:
                pool = brokered(features, workers, extra=extra) if features.broker else direct(workers, extra=extra)
                with pool as running:
                    controllers.window(max(sizes.pool_controllers), running.endpoint, "noop", 2 * workers,
                                       sizes.pool_warmup_s, sizes.pool_window_s / 4)  # connect every controller
                    for tool in TOOLS:
                        for c in sizes.pool_controllers:
                            answers = controllers.window(c, running.endpoint, tool, 2 * workers,
                                                         sizes.pool_warmup_s, sizes.pool_window_s)
                            series[mode][tool][str(c)].append(round(sum(a["rate"] for a in answers), 1))
                    if workers == max(sizes.pool_workers):
                        before, started = _cpu_s(running, pids, features.broker), time.monotonic()
                        answers = controllers.window(len(pids), running.endpoint, "nap", 2 * workers,
                                                     sizes.pool_warmup_s, CPU_WINDOWS * sizes.pool_window_s)
                        # the window's rate over the whole measurement: about the calls made in it
                        calls = sum(a["rate"] for a in answers) * (time.monotonic() - started - sizes.pool_warmup_s)
                        one = series[mode]["nap"][str(max(sizes.pool_controllers))][0]  # workers go up from 1
                        cpu[mode] = _cpu_per_call(before, _cpu_s(running, pids, features.broker), calls, workers,
                                                  one)
    finally:
        controllers.close()

    results: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for mode, by_tool in series.items():
        efficiency = _scaling(by_tool["nap"], sizes.pool_workers)
        worst = min((e for effs in efficiency.values() for e in effs if e is not None), default=None)
        results[mode] = {"calls_per_s": {"noop": by_tool["noop"], "sleep_10ms": by_tool["nap"]},
                         "sleep_10ms_scaling_vs_1_worker": efficiency, "sleep_10ms_worst_scaling": worst,
                         "sleep_10ms_cpu_per_call": cpu.get(mode)}
        targets[f"sleep_10ms_worst_scaling, {mode} (issues 12, 14)"] = {
            "value": worst, "at_least": 0.85, "met": None if worst is None else worst >= 0.85}
    return measured(
        title="Pool scaling: calls/s against total workers",
        via=via,
        method=("closed loop: the controllers (ExecutorClient each, separate processes) keep 2 x workers calls in "
                f"flight between them; calls completed in a common {sizes.pool_window_s:g} s window"),
        workers=list(sizes.pool_workers),
        modes=results,
        sleep_10ms_ideal_calls_per_s=[round(w / SLEEP_S, 1) for w in sizes.pool_workers],
        targets=targets,
    )
