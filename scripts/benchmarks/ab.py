"""Before and after, side by side: the executor of another checkout against this one's, in one run.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m scripts.benchmarks.ab /tmp/before [--reuse-workers] [--sessions N] [--rounds N]
    .venv/bin/python -m scripts.benchmarks.ab . --after-flags=--no-cgroups   what a flag costs, this tree

(from this tree's root). Each session starts one executor from each tree (``PYTHONPATH`` names the
tree, and the executors start in an empty directory: ``python -m`` would put their working directory
first on their ``sys.path``, ahead of ``PYTHONPATH``) with the same flags, then times no-op calls in
interleaved rounds, back to back, 20 ms apart and from 3 clients in bursts of 5 calls 20 ms apart
(``contestants.Bursts``), with the CPU each call back to back costs in all processes (client,
supervisor, template, workers; ``callpath.CpuMeter``). Which executor starts first, and which is
timed first in a round, alternates. Prints one table of p50s and CPU over all sessions, with
after/before ratios and their range over the sessions. For a change to the call path, quote these
ratios in the commit; an A/A run (the same code on both sides) shows this machine's noise.
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


SETTLE_S = 0.3  # fresh workers that answered are killed, and new ones forked, once the executor is quiet


def _cpu_block(meter: CpuMeter, calls: ClientCalls, n: int) -> list[float]:
    """Calls back to back, and the CPU they cost in all processes: the window opens once what the
    executor's previous block left (its bursts' workers) is done, and closes once this block's is."""
    time.sleep(SETTLE_S)
    before = meter.snapshot(before=True)
    times = calls.block(n)
    time.sleep(SETTLE_S)
    meter.add(before, meter.snapshot(before=False), n)
    return times


Side = tuple[list[float], list[float], list[float], dict[str, dict[str, float]]]  # b2b, paced, bursts, CPU


def _session(trees: dict[str, Path], flags: dict[str, list[str]], args: argparse.Namespace,
             first: str) -> dict[str, Side]:
    """One pair of executors, ``first`` started first and timed first in even rounds: which goes
    first alternates (in a fixed order an A/A run, the same code on both sides, came out 1.09x and
    1.17x back to back against the second), and each session starts new executors (an executor
    started first, from the same code, was up to 7% slower paced in one session than its twin)."""
    order = (first, *(n for n in trees if n != first))
    with contextlib.ExitStack() as stack:
        running: dict[str, Running] = {}
        for name in order:
            with _tree(trees[name]):
                running[name] = stack.enter_context(direct(args.workers, extra=flags[name], log_level="warning"))
        calls = {name: ClientCalls(r.client, name) for name, r in running.items()}
        bursts = {name: Bursts(r.endpoint) for name, r in running.items()}
        meters = {name: CpuMeter(r.roots[0]) for name, r in running.items()}
        times: dict[str, tuple[list[float], list[float], list[float]]] = {name: ([], [], []) for name in trees}
        for round_ in range(args.rounds):
            for name in (order if round_ % 2 == 0 else order[::-1]):
                b2b, paced, bursty = times[name]
                b2b += _cpu_block(meters[name], calls[name], args.calls)
                paced += Paced(calls[name]).block(args.calls // 2)
                bursty += bursts[name].block(args.calls // 2)
        return {name: (*times[name], meters[name].per_call()) for name in trees}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="the other checkout (the code before the change)")
    parser.add_argument("--reuse-workers", action="store_true", help="both executors with --reuse-workers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=6,
                        help="pairs of executors started one after the other (who starts first alternates)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per session")
    parser.add_argument("--calls", type=int, default=60, help="calls per round and mode")
    parser.add_argument("--before-flags", default="", help="more serve flags for the 'before' executor")
    parser.add_argument("--after-flags", default="", help="more serve flags for the 'after' executor")
    args = parser.parse_args(argv)
    if args.sessions % 2 or args.rounds % 2:
        parser.error("--sessions and --rounds must be even: each side starts first, and is timed first, "
                     "equally often")
    extra = ["--reuse-workers"] if args.reuse_workers else []
    flags = {"before": extra + args.before_flags.split(), "after": extra + args.after_flags.split()}
    trees = {"before": args.before.resolve(), "after": ROOT}
    if not (trees["before"] / "executor").is_dir():
        parser.error(f"{args.before} is not a checkout of this project (it has no executor/)")
    sessions: list[dict[str, Side]] = []
    with tempfile.TemporaryDirectory(prefix="ciayn-ab-") as empty, contextlib.chdir(empty):
        for i in range(args.sessions):
            sessions.append(_session(trees, flags, args, first="before" if i % 2 == 0 else "after"))
    measures = ("p50 back to back", "p50 20 ms apart", "p50 3 clients, bursts", "CPU per call")

    def figures(side: Side) -> list[float]:
        *blocks, cpu = side
        return [*(statistics.median(b) * 1e6 for b in blocks), sum(c["cpu_us"] for c in cpu.values())]

    def pool(name: str) -> Side:
        sides = [s[name] for s in sessions]
        return ([t for side in sides for t in side[0]], [t for side in sides for t in side[1]],
                [t for side in sides for t in side[2]], _mean_cpu([side[3] for side in sides]))

    pooled = {name: figures(pool(name)) for name in trees}
    each = [{name: figures(s[name]) for name in trees} for s in sessions]
    spread = [[e["after"][k] / e["before"][k] for e in each] for k in range(len(measures))]
    print(f"{'':13} " + " ".join(f"{m:>22}" for m in measures))
    for name, row in pooled.items():
        print(f"{name:13} " + " ".join(f"{v:20.0f}us" for v in row))
    ratios = [a / b for a, b in zip(pooled["after"], pooled["before"], strict=True)]
    print(f"{'after/before':13} " + " ".join(f"{r:22.3f}" for r in ratios))
    print(f"{'  by session':13} " + " ".join(f"{min(r):14.3f} - {max(r):.3f}" for r in spread))
    for name in trees:
        print(f"{name}: " + ", ".join(f"{k} {v['cpu_us']:.0f}" for k, v in pool(name)[3].items()))
    return 0


def _mean_cpu(per_session: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each process's CPU per call, the mean over sessions (each timed the same number of calls)."""
    roles = sorted({role for cpu in per_session for role in cpu})
    return {role: {"cpu_us": sum(cpu.get(role, {}).get("cpu_us", 0.0) for cpu in per_session) / len(per_session)}
            for role in roles}


if __name__ == "__main__":
    sys.exit(main())
