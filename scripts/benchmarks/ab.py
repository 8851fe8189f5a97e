"""Before and after, side by side: the executor of another checkout against this one's, in one run.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m scripts.benchmarks.ab /tmp/before [--reuse-workers] [--rounds N] [--calls N]
    .venv/bin/python -m scripts.benchmarks.ab . --after-flags=--no-cgroups   what a flag costs, this tree

(from this tree's root). Starts one executor from each tree (``PYTHONPATH`` names the tree, and the
executors start in an empty directory: ``python -m`` would put their working directory first on
their ``sys.path``, ahead of ``PYTHONPATH``) with the same flags, then times no-op calls in
interleaved rounds, back to back, 20 ms apart and from 3 clients in bursts of 5 calls 20 ms apart
(``contestants.Bursts``), with the CPU each call back to back costs in all processes (client,
supervisor, template, workers; ``callpath.CpuMeter``). Prints one table of p50s and CPU, with
after/before ratios. For a change to the call path, quote these ratios in the commit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .callpath import CpuMeter
from .contestants import Bursts, ClientCalls, Paced
from .executors import Running, direct
from .paths import ROOT


@contextlib.contextmanager
def _tree(tree: Path) -> Iterator[None]:
    """The executor started inside imports its packages from ``tree``."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _cpu_block(meter: CpuMeter, calls: ClientCalls, n: int) -> list[float]:
    before = meter.snapshot(before=True)
    times = calls.block(n)
    time.sleep(0.3)  # fresh workers that answered are killed once the executor is quiet
    meter.add(before, meter.snapshot(before=False), n)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="the other checkout (the code before the change)")
    parser.add_argument("--reuse-workers", action="store_true", help="both executors with --reuse-workers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=60, help="calls per round and mode")
    parser.add_argument("--before-flags", default="", help="more serve flags for the 'before' executor")
    parser.add_argument("--after-flags", default="", help="more serve flags for the 'after' executor")
    args = parser.parse_args(argv)
    extra = ["--reuse-workers"] if args.reuse_workers else []
    flags = {"before": args.before_flags.split(), "after": args.after_flags.split()}
    trees = {"before": args.before.resolve(), "after": ROOT}
    if not (trees["before"] / "executor").is_dir():
        parser.error(f"{args.before} is not a checkout of this project (it has no executor/)")
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.chdir(stack.enter_context(tempfile.TemporaryDirectory(prefix="ciayn-ab-"))))
        running: dict[str, Running] = {}
        for name, tree in trees.items():
            with _tree(tree):
                running[name] = stack.enter_context(direct(args.workers, extra=extra + flags[name],
                                                           log_level="warning"))
        calls = {name: ClientCalls(r.client, name) for name, r in running.items()}
        bursts = {name: Bursts(r.endpoint) for name, r in running.items()}
        meters = {name: CpuMeter(r.roots[0]) for name, r in running.items()}
        b2b: dict[str, list[float]] = {name: [] for name in trees}
        paced: dict[str, list[float]] = {name: [] for name in trees}
        bursty: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name in trees:
                b2b[name] += _cpu_block(meters[name], calls[name], args.calls)
                paced[name] += Paced(calls[name]).block(args.calls // 2)
                bursty[name] += bursts[name].block(args.calls // 2)
    rows = {}
    for name in trees:
        cpu = meters[name].per_call()
        rows[name] = (statistics.median(b2b[name]) * 1e6, statistics.median(paced[name]) * 1e6,
                      statistics.median(bursty[name]) * 1e6, sum(c["cpu_us"] for c in cpu.values()), cpu)
    print(f"{'':8} {'p50 back to back':>18} {'p50 20 ms apart':>16} {'p50 3 clients, bursts':>22} {'CPU per call':>13}")
    for name, (a, b, c, d, _) in rows.items():
        print(f"{name:8} {a:16.0f}us {b:14.0f}us {c:20.0f}us {d:11.0f}us")
    before, after = rows["before"], rows["after"]
    print(f"{'after/before':8} {after[0] / before[0]:17.3f} {after[1] / before[1]:15.3f} "
          f"{after[2] / before[2]:21.3f} {after[3] / before[3]:12.3f}")
    for name, (*_, cpu) in rows.items():
        print(f"{name}: " + ", ".join(f"{k} {v['cpu_us']:.0f}" for k, v in cpu.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
