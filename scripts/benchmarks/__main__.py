"""Every benchmark in one run: ours against what users would pick instead, side by side.

Usage: .venv/bin/python -m scripts.benchmarks [--tiny] [--out DIR] [--only FIGURE ...] [--list] [--no-readme]
(from the project root; ``scripts/bench`` sets up the venv and runs this.)

Measures every figure the package's modules declare (``registry.discover``; ``--list`` prints them)
and writes DIR/results.json (every figure, with the machine it ran on), DIR/*.png (charts) and
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
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # controller imports litellm: stay offline

from . import report
from .executors import SHARED
from .features import Features
from .paths import RESULTS
from .record import broken, failed, log, machine
from .registry import Context, Figure, discover
from .sizes import FULL, TINY

BENCH_RESULTS = RESULTS.resolve()


def write_report(results: dict[str, Any], out: Path, readme: bool, figures: list[Figure]) -> None:
    """Charts and results.md in ``out``; when ``readme`` and ``out`` is the project's bench-results/,
    also the generated part of bench-results/README.md (the charts beside it, so the same text)."""
    report.charts(results, out, figures)
    text = report.markdown(results, figures)
    (out / "results.md").write_text(text + "\n")
    if readme and out == BENCH_RESULTS:
        if report.update_readme(out / "README.md", text):
            log("bench-results/README.md: measured tables refreshed")
        else:
            log(f"bench-results/README.md has no {report.BEGIN} ... {report.END} markers: left alone")


def _figure_list(figures: list[Figure], indent: str = "  ") -> str:
    width = max(len(f.name) for f in figures)
    return "\n".join(f"{indent}{f.name:<{width}}  {f.measures}" for f in figures)


def main(argv: list[str] | None = None) -> int:
    figures = discover()
    names = [f.name for f in figures]
    epilog = f"figures, in the order they run and are reported:\n{_figure_list(figures)}"
    parser = argparse.ArgumentParser(description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every code path at a tiny size (for tests)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the results")
    parser.add_argument("--only", action="append", choices=names, metavar="FIGURE",
                        help="run only this figure (repeatable; the figures are listed below)")
    parser.add_argument("--list", action="store_true", help="print the figures, one a line (name, what it measures)")
    parser.add_argument("--no-readme", action="store_true", help="do not refresh the tables in bench-results/README.md")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: redraw the charts, results.md and (for bench-results/) the tables "
                        "of its README.md from DIR/results.json")
    args = parser.parse_args(argv)
    if args.list:
        print(_figure_list(figures, indent=""))
        return 0
    if args.report_only:
        saved = json.loads((args.out / "results.json").read_text())
        write_report(saved, args.out.resolve(), not args.no_readme, figures)
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
        context = Context(features, sizes, tmp, out)
        for fig in figures:
            if args.only and fig.name not in args.only:
                continue
            t0 = time.perf_counter()
            try:
                entry = fig.run(context)
            except Exception as e:
                traceback.print_exc()
                entry = failed(e, title=fig.name)
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            results["figures"][fig.name] = entry
            log(f"{fig.name}: {entry['status']} in {entry['seconds']} s")
    finally:
        SHARED.close()
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
    write_report(results, out, not args.no_readme and not args.tiny, figures)
    failures = [k for k, f in results["figures"].items() if broken(f)]
    took = round(time.perf_counter() - started, 1)
    log(f"done in {took} s; results in {out}" + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
