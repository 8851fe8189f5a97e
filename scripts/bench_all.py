"""Every benchmark of issue 14 in one run: ours against what users would pick instead, side by side.

Usage: .venv/bin/python scripts/bench_all.py [--tiny] [--out DIR] [--only FIGURE ...] [--no-readme]
(``scripts/bench`` sets up the venv and runs this.)

Writes DIR/results.json (every figure, with the machine it ran on), DIR/*.png (charts) and
DIR/results.md (tables and what each figure means); with the default DIR (bench-results/) it also
refreshes the tables of bench-results/README.md between its bench markers (the project README only
links there, so no run ever writes it). With ``--only``, the figures run replace
theirs in DIR/results.json and the rest are kept (each figure records when and where it ran).
``--tiny`` runs every code path at a size that takes seconds (the test suite does this); its
numbers mean nothing. Exits 1 if a benchmark broke (its figure then says ``failed`` and why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
for path in (str(ROOT), str(SCRIPTS)):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # controller imports litellm: stay offline

import bench_callpath  # noqa: E402
import bench_ciayn  # noqa: E402
import bench_executors  # noqa: E402
import bench_faults  # noqa: E402
import bench_fresh  # noqa: E402
import bench_layers  # noqa: E402
import bench_memory  # noqa: E402
import bench_pool  # noqa: E402
import bench_report  # noqa: E402
import bench_roundtrip  # noqa: E402
import bench_weight  # noqa: E402
from bench_features import Features  # noqa: E402
from bench_record import FAILED, failed, log, machine, measured, not_built  # noqa: E402
from bench_sizes import FULL, TINY, Sizes  # noqa: E402

FIGURES = ("ciayn_overhead", "round_trip", "fresh_workers", "call_path", "call_path_cuts", "recovery",
           "timeout_precision", "pool_scaling", "memory", "hardened_layers", "broker_pool", "weight")


BROKER_TITLE = "Broker overhead and scaling (scripts/bench_broker.py --quick)"
FRESH_TITLE = "What a fresh worker per call costs (scripts/bench_fresh.py)"
WEIGHT_TITLE = "A fresh worker per call against the template's fork floor (scripts/bench_weight.py)"


def fresh_workers(tiny: bool) -> dict[str, Any]:
    """Issue 9's figures: fresh workers (the default) against --reuse-workers, interleaved, with
    calls 20 ms apart (low load, the target's measure), back to back, and sustained."""
    log("fresh workers: scripts/bench_fresh.py")
    data = bench_fresh.run(size=(1, 3, 20) if tiny else (4, 30, 1000))
    t = data.pop("targets")
    targets = {"fresh_vs_reuse_workers_p50, calls 20 ms apart (issue 9)": t["fresh_vs_reuse_low_load_p50"],
               "fresh_workers_calls_per_s, sustained (issue 9)": t["fresh_throughput"]}
    return measured(title=FRESH_TITLE, targets=targets, **{k: v for k, v in data.items() if k != "machine"})


def weight(tiny: bool) -> dict[str, Any]:
    """Issue 21's figures: a fresh call's CPU and latency against the template's own fork+exit+wait,
    --reuse-workers, the ZeroMQ echo and a Jupyter kernel, interleaved."""
    log("weight: scripts/bench_weight.py")
    data = bench_weight.run(size=(1, 3, 20) if tiny else None)
    targets = {f"{name} (issue 21)": t for name, t in data.pop("targets").items()}
    return measured(title=WEIGHT_TITLE, targets=targets, **{k: v for k, v in data.items() if k != "machine"})


def broker_pool(features: Features, tmp: str, tiny: bool) -> dict[str, Any]:
    """The pool's own benchmark (scripts/bench_broker.py, issue 12: broker overhead with and without
    CurveZMQ, scaling through the broker), run as part of the whole. Its figures go into
    results.json; its own bench-results/pool.json (a full run of it) is left alone."""
    if not features.broker:
        return not_built(features.missing("broker"), title=BROKER_TITLE)
    try:
        import bench_broker
    except ImportError as e:
        return not_built(f"scripts/bench_broker.py cannot be imported ({e})",
                         title=BROKER_TITLE)
    if tiny:  # its public parts at the smallest size: the code path, not the numbers
        return measured(title=BROKER_TITLE, overhead=bench_broker.overhead(rounds=1, per_round=3),
                        scaling=bench_broker.scaling(window=0.1, workers=(1,)))
    # Its --quick size: the full one takes about 50 s here, and pool_scaling already goes to 16 workers.
    log("broker pool: scripts/bench_broker.py --quick")
    return measured(title=BROKER_TITLE, **bench_broker.run(quick=True, out=Path(tmp) / "pool.json"))


def figure_makers(features: Features, sizes: Sizes, tmp: str, out: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    return {
        "ciayn_overhead": lambda: bench_ciayn.run(sizes.microbench_repeat, out),
        "round_trip": lambda: bench_roundtrip.run(features, sizes, tmp),
        "fresh_workers": lambda: fresh_workers(sizes is TINY),
        "call_path": lambda: bench_callpath.run(features, sizes, tmp),
        "call_path_cuts": lambda: bench_callpath.cuts(features, sizes, tmp),
        "recovery": lambda: bench_faults.run_recovery(features, sizes),
        "timeout_precision": lambda: bench_faults.run_timeouts(sizes),
        "pool_scaling": lambda: bench_pool.run(features, sizes),
        "memory": lambda: bench_memory.run(sizes.memory_calls),
        "hardened_layers": lambda: bench_layers.run(features, sizes, tiny=sizes is TINY),
        "broker_pool": lambda: broker_pool(features, tmp, sizes is TINY),
        "weight": lambda: weight(sizes is TINY),
    }


BENCH_RESULTS = (ROOT / "bench-results").resolve()


def write_report(results: dict[str, Any], out: Path, readme: bool) -> None:
    """Charts and results.md in ``out``; when ``readme`` and ``out`` is the project's bench-results/,
    also the generated part of bench-results/README.md (the charts beside it, so the same text)."""
    bench_report.charts(results, out)
    text = bench_report.markdown(results)
    (out / "results.md").write_text(text + "\n")
    if readme and out == BENCH_RESULTS:
        if bench_report.update_readme(out / "README.md", text):
            log("bench-results/README.md: measured tables refreshed")
        else:
            log(f"bench-results/README.md has no {bench_report.BEGIN} ... {bench_report.END} markers: left alone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every code path at a tiny size (for tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results", help="directory for the results")
    parser.add_argument("--only", action="append", choices=FIGURES, metavar="FIGURE",
                        help=f"run only this figure (repeatable): {', '.join(FIGURES)}")
    parser.add_argument("--no-readme", action="store_true", help="do not refresh the tables in bench-results/README.md")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: redraw the charts, results.md and (for bench-results/) the tables "
                        "of its README.md from DIR/results.json")
    args = parser.parse_args(argv)
    if args.report_only:
        saved = json.loads((args.out / "results.json").read_text())
        write_report(saved, args.out.resolve(), readme=not args.no_readme)
        return 0
    started = time.perf_counter()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = TINY if args.tiny else FULL
    features = Features.detect()
    log(f"features: {asdict(features)}")
    results: dict[str, Any] = {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "size": "tiny" if args.tiny else "full",
        "sizes": asdict(sizes),
        "machine": machine(),
        "features": asdict(features),
        "out": str(out),
        "figures": {},
    }
    tmp = tempfile.mkdtemp(prefix="ciayn-bench-")
    try:
        makers = figure_makers(features, sizes, tmp, out)
        for key in args.only or FIGURES:
            t0 = time.perf_counter()
            try:
                results["figures"][key] = makers[key]()
            except Exception as e:
                traceback.print_exc()
                results["figures"][key] = failed(e, title=key)
            results["figures"][key]["seconds"] = round(time.perf_counter() - t0, 1)
            log(f"{key}: {results['figures'][key]['status']} in {results['figures'][key]['seconds']} s")
    finally:
        bench_executors.SHARED.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    saved = out / "results.json"
    if args.only and saved.exists():  # a partial run updates its figures in the last full results
        previous = json.loads(saved.read_text())
        if previous.get("size") == results["size"]:
            previous["figures"].update(results["figures"])
            previous.setdefault("updated", {}).update({k: results["generated"] for k in results["figures"]})
            results = previous
    saved.write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, out, readme=not args.no_readme and not args.tiny)
    broken = [k for k, f in results["figures"].items() if f["status"] == FAILED or bench_roundtrip.has_failures(f)]
    took = round(time.perf_counter() - started, 1)
    log(f"done in {took} s; results in {out}" + (f"; FAILED: {', '.join(broken)}" if broken else ""))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
