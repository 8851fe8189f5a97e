"""What a fresh worker per call weighs against the physical cost of a fork (issue 21), in one run.

    .venv/bin/python -m scripts.benchmarks.weight [--quick] [--python PY]   writes bench-results/weight.json

Side by side, in interleaved rounds on the same machine:

- **the fork floor of the template**: a process that imported what the template imports (the
  executor's worker side and the tool module) forking children that exit at once
  (scripts/benchmarks/forkfloor.py): wall time and CPU (both processes) per fork+exit+wait;
- a no-op call to a fresh-worker executor (the default) and to a ``--reuse-workers`` one, back to
  back and 20 ms apart (as an agent's calls come), and the CPU each call costs in all processes
  together (this client, the supervisor, the template, the workers: scheduler counters);
- the floor of the wire: a bare pyzmq DEALER/ROUTER msgpack echo, back to back and 20 ms apart (at
  that pace every process is asleep when a call comes, and the echo itself is slower);
- **the floor of the architecture** (scripts/benchmarks/archfloor.py): the same processes and hops as
  a no-op call of ours, fresh and reused, with nothing else on them (no limits, groups, pipes,
  checks): each target's ratio is also given for it, so a target it misses itself is out of reach
  of the architecture, not of our code;
- a Jupyter kernel executing the same no-op (where ipykernel is installed), back to back and 20 ms apart;
- sustained fresh calls/s with 100 in flight on 2 workers; the template's own private memory;
- the pool's scaling in the default mode: a tool that sleeps 100 ms on 1, 2, 4, 8 and 16 workers,
  each kept busy (2 calls in flight per worker), against the ideal of 10 calls/s per worker.

The targets are ratios of figures from this one run (issue 21). The figure ``weight`` of
``scripts/bench`` is ``run()`` at its size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from protocol import Call

from . import report
from .archfloor import ArchFloor
from .callpath import CpuMeter
from .contestants import ClientCalls, JupyterKernel, Paced, ZmqEcho
from .executors import BENCH_TOOLS, direct
from .forkfloor import private_kb
from .fresh import _throughput
from .paths import RESULTS, ROOT, module_command
from .record import log, measured
from .registry import Context, figure

TITLE = "A fresh worker per call against the template's fork floor (scripts/benchmarks/weight.py)"

SCALING_NAP_MS = 100.0  # the scaling's tool sleeps this long: the ideal is 1000 / SCALING_NAP_MS calls/s a worker
SCALING_WORKERS = (1, 2, 4, 8, 16)


class ForkFloor:
    """scripts/benchmarks/forkfloor.py as a peer: ``block(n)`` gives n cycles' walls and their CPU."""

    name = "template fork+exit+wait (floor)"

    def __init__(self, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen(module_command("forkfloor", BENCH_TOOLS, python=python), cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the fork-floor peer did not start")
        self.cpu_s = 0.0
        self.cycles = 0
        self.private_kb = 0
        self.bare_fork = False
        self.block(20)
        self.cpu_s, self.cycles = 0.0, 0

    def block(self, n: int) -> list[float]:
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        self.cpu_s += answer["cpu_s"]
        self.cycles += n
        self.private_kb, self.bare_fork = answer["private_kb"], answer["bare_fork"]
        return list(answer["wall_s"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def _template_pid(supervisor: int) -> int:
    import psutil

    for child in psutil.Process(supervisor).children():
        if child.children():  # the template: its children are the workers forked ahead
            return int(child.pid)
    return 0


def _target(value: float, architecture: float | None = None, **bound: float) -> dict[str, Any]:
    """``architecture``: the same ratio for the architecture's floor (archfloor.py)."""
    (kind, limit), = bound.items()
    met = value <= limit if kind == "at_most" else value >= limit
    target = {"value": round(value, 3), kind: limit, "met": met}
    if architecture is not None:
        target["architecture"] = round(architecture, 3)
    return target


def _scaling(window_s: float, workers: tuple[int, ...] = SCALING_WORKERS) -> dict[str, dict[str, float]]:
    """Calls/s of a tool that sleeps ``SCALING_NAP_MS`` on ``n`` fresh workers, a closed loop with
    ``2 n`` calls in flight, counted over ``window_s`` after a warm-up, against ``n`` times the ideal."""
    out: dict[str, dict[str, float]] = {}
    call = Call(tool="nap", kwargs={"ms": SCALING_NAP_MS})
    for n in workers:
        with direct(n, log_level="warning") as running:
            client = running.client
            pending: set[Future[Any]] = {client.submit(call) for _ in range(2 * n)}
            done_calls, started, t0 = 0, time.perf_counter() + min(1.0, window_s / 2), 0.0
            while True:
                finished, pending = wait(pending, timeout=60, return_when=FIRST_COMPLETED)
                if not finished:
                    raise RuntimeError(f"scaling on {n} workers: no call answered within 60 s")
                now = time.perf_counter()
                for f in finished:
                    if not f.result().ok:
                        raise RuntimeError(f"scaling on {n} workers: {f.result().error}")
                    if now >= started:
                        t0 = t0 or now
                        done_calls += 1
                if t0 and now - t0 >= window_s:
                    break
                pending |= {client.submit(call) for _ in finished}
            wait(pending, timeout=60)
            rate = (done_calls - 1) / (now - t0) if now > t0 else 0.0
        ideal = n * 1000 / SCALING_NAP_MS
        out[str(n)] = {"calls_per_s": round(rate, 1), "ideal": ideal, "of_linear": round(rate / ideal, 3)}
    return out


def run(quick: bool = False, python: str = sys.executable, size: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """``size``: (interleaved rounds, calls per round and mode, calls for the throughput)."""
    rounds, per_round, total = size or ((2, 20, 200) if quick else (8, 60, 2000))
    samples: dict[str, list[float]] = {}
    cpu_us: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ciayn-weight-"))
        fresh = stack.enter_context(direct(2, log_level="warning"))
        reuse = stack.enter_context(direct(2, extra=["--reuse-workers"], log_level="warning"))
        floor = ForkFloor(python)
        stack.callback(floor.close)
        echo = ZmqEcho(tmp)
        stack.callback(echo.close)
        arch = {mode: ArchFloor(mode, tmp) for mode in ("fresh", "reuse")}
        for floor_of_mode in arch.values():
            stack.callback(floor_of_mode.close)
        jupyter = None
        with contextlib.suppress(ImportError):
            jupyter = JupyterKernel()
            stack.callback(jupyter.close)
        fresh_calls, reuse_calls = ClientCalls(fresh.client, "fresh"), ClientCalls(reuse.client, "reuse")
        meters = {"fresh": CpuMeter(fresh.roots[0]), "reuse_workers": CpuMeter(reuse.roots[0]),
                  "arch_fresh": CpuMeter(arch["fresh"].pid), "arch_reuse": CpuMeter(arch["reuse"].pid)}
        blocks: dict[str, Any] = {
            "fork_floor": floor, "zmq_echo": echo, "zmq_echo_paced": Paced(echo),
            "fresh_back_to_back": fresh_calls, "reuse_back_to_back": reuse_calls,
            "fresh_paced": Paced(fresh_calls), "reuse_paced": Paced(reuse_calls),
            "arch_fresh_back_to_back": arch["fresh"], "arch_reuse_back_to_back": arch["reuse"],
            "arch_fresh_paced": Paced(arch["fresh"]), "arch_reuse_paced": Paced(arch["reuse"]),
        }
        if jupyter is not None:
            blocks["jupyter_execute"] = jupyter
            blocks["jupyter_execute_paced"] = Paced(jupyter)
        metered = {"fresh_back_to_back": meters["fresh"], "reuse_back_to_back": meters["reuse_workers"],
                   "arch_fresh_back_to_back": meters["arch_fresh"], "arch_reuse_back_to_back": meters["arch_reuse"]}
        for _ in range(rounds):
            for name, block in blocks.items():
                meter = metered.get(name)
                if meter is not None:
                    before = meter.snapshot(before=True)
                    samples.setdefault(name, []).extend(block.block(per_round))
                    time.sleep(0.3)  # fresh workers that answered are killed once the executor is quiet
                    meter.add(before, meter.snapshot(before=False), per_round)
                else:
                    samples.setdefault(name, []).extend(block.block(per_round if not name.startswith("jupyter")
                                                                    else max(5, per_round // 4)))
        for mode, meter in meters.items():
            cpu_us[mode] = round(sum(c["cpu_us"] for c in meter.per_call().values()), 1)
            cpu_us[f"{mode}_by_process"] = meter.per_call()  # type: ignore[assignment]
        template = _template_pid(fresh.roots[0])
        template_private_mb = round(private_kb(template) / 1024, 1) if template else None
        calls_per_s = _throughput(fresh.client, total)
    # a tiny run (the bench's own test) only proves the measurement works: 1 and 2 workers, briefly
    scaling = _scaling(0.5, (1, 2)) if total < 100 else _scaling(1.0 if quick else 3.0)
    p50 = {name: round(statistics.median(values) * 1e6, 1) for name, values in samples.items()}
    floor_cpu_us = round(floor.cpu_s / max(1, floor.cycles) * 1e6, 1)
    cores = os.cpu_count() or 1
    targets = {
        "CPU per fresh call / template fork+exit+wait CPU": _target(
            cpu_us["fresh"] / floor_cpu_us, cpu_us["arch_fresh"] / floor_cpu_us, at_most=2.0),
        "fresh p50 / reuse p50, calls 20 ms apart": _target(
            p50["fresh_paced"] / p50["reuse_paced"], p50["arch_fresh_paced"] / p50["arch_reuse_paced"], at_most=1.2),
        "fresh p50 back to back / (reuse p50 + one template fork)": _target(
            p50["fresh_back_to_back"] / (p50["reuse_back_to_back"] + p50["fork_floor"]),
            p50["arch_fresh_back_to_back"] / (p50["arch_reuse_back_to_back"] + p50["fork_floor"]), at_most=1.0),
        "reuse p50 back to back / bare ZeroMQ echo": _target(
            p50["reuse_back_to_back"] / p50["zmq_echo"], p50["arch_reuse_back_to_back"] / p50["zmq_echo"], at_most=4.0),
        # (the architecture's: the most its CPU per call allows, all cores busy)
        "sustained fresh calls/s / (cores / fork CPU)": _target(
            calls_per_s / (cores / (floor_cpu_us / 1e6)), floor_cpu_us / cpu_us["arch_fresh"], at_least=0.7),
    }
    targets["pool scaling, 100 ms tool on 1-16 workers, worst / linear"] = _target(
        min(row["of_linear"] for row in scaling.values()), at_least=0.85)
    if "jupyter_execute" in p50:
        targets["Jupyter execute p50 / fresh p50 back to back"] = _target(
            p50["jupyter_execute"] / p50["fresh_back_to_back"], p50["jupyter_execute"] / p50["arch_fresh_back_to_back"],
            at_least=3.0)
    return {
        "machine": {"cores": cores, "python": subprocess.run([python, "-c", "import platform; print("
                                                              "platform.python_version())"], capture_output=True,
                                                             text=True, check=True).stdout.strip(),
                    "load_1min": round(os.getloadavg()[0], 2)},
        "p50_us": p50,
        "cpu_per_call_us": cpu_us,
        "fork_floor": {"cpu_us": floor_cpu_us, "p50_us": p50["fork_floor"], "bare_fork": floor.bare_fork,
                       "private_mb": round(floor.private_kb / 1024, 1)},
        "template_private_mb": template_private_mb,
        "fresh_calls_per_s": calls_per_s,
        "scaling_100ms": scaling,
        "samples": {"rounds": rounds, "per_round": per_round, "throughput_calls": total},
        "targets": targets,
    }


@figure("weight", "a fresh call's CPU and latency against the template's own fork+exit+wait (issue 21)",
        order=120, chart=report.chart_weight, table=report.table_weight)
def weight(context: Context) -> dict[str, Any]:
    """Issue 21's figures: a fresh call's CPU and latency against the template's own fork+exit+wait,
    --reuse-workers, the ZeroMQ echo and a Jupyter kernel, interleaved."""
    log("weight: scripts/benchmarks/weight.py")
    data = run(size=(1, 3, 20) if context.tiny else None)
    targets = {f"{name} (issue 21)": t for name, t in data.pop("targets").items()}
    return measured(title=TITLE, targets=targets, **{k: v for k, v in data.items() if k != "machine"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller run (seconds; figures noisier)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of the fork-floor peer (to compare CPython releases' fork cost)")
    parser.add_argument("--out", type=Path, default=RESULTS / "weight.json")
    args = parser.parse_args(argv)
    data = run(args.quick, args.python)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    for name, t in data["targets"].items():
        print(f"{'met ' if t['met'] else 'MISS'} {name}: {t['value']}")
    print(json.dumps({k: data[k] for k in ("p50_us", "fork_floor", "template_private_mb", "fresh_calls_per_s",
                                                  "scaling_100ms")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
