#!/usr/bin/env python3
"""Benchmark ``protocol.parse_call``: median and p90 time per call for typical model replies.

Usage: .venv/bin/python -m scripts.benchmarks.parse [--out FILE] [--repeat N]

Writes the figures as JSON (default ``bench-results/parse.json``) and prints a markdown table. The
target is a median under 50 us for a typical one-line call.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol import ToolSpec, parse_call

from .paths import RESULTS

TARGET_MEDIAN_US = 50.0


def read_file(path: str, start: int = 0, lines: int | None = None) -> str:
    """Read a UTF-8 text file from the workspace."""
    return path


def write_file(path: str, content: str) -> None:
    """Write a UTF-8 text file in the workspace."""


def search(pattern: str, paths: list[str], *, regex: bool = False, limit: int = 50) -> list[str]:
    """Search files for a pattern."""
    return []


TOOLS = {
    spec.name: spec
    for spec in (
        ToolSpec.from_function(read_file, bundleable=True),
        ToolSpec.from_function(write_file),
        ToolSpec.from_function(search, bundleable=True),
    )
}


def _file_20kb() -> str:
    line = 'def f(x):\n    return "quote \' and \\" and \\\\ backslash"  # ``` not a fence\n'
    body = (line * (20_000 // len(line) + 1))[:20_000]
    return body.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


CASES: dict[str, tuple[str, bool]] = {
    "read_file positional": ('read_file("src/main.py")', False),
    "read_file keywords": ('read_file(path="src/main.py", start=10, lines=40)', False),
    "search list + bool": ('search("TODO", ["a.py", "b.py"], regex=False, limit=-1)', False),
    "nested dict arg": ('configure(options={"retries": 3, "paths": ["a", "b"], "ratio": 0.5, "x": None})', False),
    "fenced + think": ('<think>read it</think>\n```python\nread_file("src/main.py")\n```', False),
    "write_file 20 KB triple-quoted": (f'write_file(path="big.py", content="""{_file_20kb()}""")', False),
    "read_file keywords, with tools": ('read_file(path="src/main.py", start=10, lines=40)', True),
    "write_file 20 KB, with tools": (f'write_file(path="big.py", content="""{_file_20kb()}""")', True),
}


def measure(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Per-call times in microseconds over ``repeat`` timed batches (each long enough to time)."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    batch = max(1, int(0.002 / max(once, 1e-7)))
    for _ in range(max(3, repeat // 20)):  # warm up
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - t0) / batch / 1000)
    samples.sort()
    return {
        "median_us": round(statistics.median(samples), 2),
        "p90_us": round(samples[int(0.9 * (len(samples) - 1))], 2),
        "min_us": round(samples[0], 2),
        "batches": repeat,
        "calls_per_batch": batch,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "parse.json")
    parser.add_argument("--repeat", type=int, default=200, help="timed batches per case")
    args = parser.parse_args(argv)

    results: dict[str, dict[str, Any]] = {}
    for name, (text, with_tools) in CASES.items():
        tools = TOOLS if with_tools else None
        parse_call(text, tools)  # must be valid, or the benchmark measures an error path
        timing = measure(functools.partial(parse_call, text, tools), args.repeat)
        results[name] = {"chars": len(text), "with_tools": with_tools, **timing}

    typical = results["read_file keywords"]["median_us"]
    report = {
        "benchmark": "protocol.parse_call",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "target_median_us": TARGET_MEDIAN_US,
        "typical_median_us": typical,
        "meets_target": typical < TARGET_MEDIAN_US,
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print("| case | chars | median (us) | p90 (us) |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['chars']} | {r['median_us']:.1f} | {r['p90_us']:.1f} |")
    verdict = "meets" if report["meets_target"] else "MISSES"
    print(f"\nTypical one-line call: {typical:.1f} us median ({verdict} the {TARGET_MEDIAN_US:.0f} us target).")
    print(f"Written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
