#!/usr/bin/env python3
"""Benchmark ``protocol.decode`` on bodies built to cost work (issue 10): the attacker's 16 M empty
arrays, many small containers, short strings, repeated keys, deep nesting, a 64 MiB string, and a
typical call for scale. Each case runs in a fresh process so its peak memory can be measured.

Usage: .venv/bin/python -m scripts.benchmarks.decode [--out FILE] [--repeat N]

Writes JSON (default ``bench-results/decode.json``) and prints a markdown table: per case the body
size, the outcome, the slowest and median of N decodes, and the peak of what one decode allocates
(tracemalloc, in a separate untimed pass). The target: any body within the caps decodes or is refused in tens of
milliseconds and tens of MB (before the element budget: 8-37 s and up to 4.9 GB).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .paths import RESULTS, ROOT

TARGET_MS = 100.0
TARGET_MB = 64.0


def _array(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def _call(args: bytes) -> bytes:
    return b"\x83\xa2id\xa3c-1\xa4tool\xa1f\xa4args" + args


def bodies() -> dict[str, Callable[[], bytes]]:
    """Each case's body, built on demand (so a case's process holds only its own)."""
    import msgpack

    return {
        "typical call": lambda: msgpack.packb({"id": "c-1", "tool": "read_file", "args": ["src/main.py"],
                                               "kwargs": {"start": 0, "lines": 200}}),
        "16M empty arrays (16 MB)": lambda: _call(_array(16_000_000, b"\x90")),
        "1000 x 16k empty arrays (16 MB)": lambda: _call(_array(1000, _array(16_000, b"\x90"))),
        "4000 x 4k empty maps (16 MB)": lambda: _call(_array(4000, _array(4000, b"\x80"))),
        "52k empty arrays (at the budget)": lambda: _call(_array(52_000, b"\x90")),
        "250k 2-char strings (at the budget)": lambda: _call(_array(250_000, b"\xa2ab")),
        "60 x 250k 2-char strings (45 MB)": lambda: _call(_array(60, _array(250_000, b"\xa2ab"))),
        "100 maps x 130k repeated keys (39 MB)": lambda: _call(_array(100, b"\xdf" + (130_000).to_bytes(4, "big")
                                                                       + b"\xa1a\x90" * 130_000)),
        "1 M nested arrays": lambda: _call(b"\x91" * 1_000_000),
        "64 MiB string": lambda: _call(msgpack.packb(["x" * (64 * 1024 * 1024 - 100)])),
    }


CHILD = r"""
import json, sys, time, tracemalloc
from scripts.benchmarks.decode import bodies
from protocol import VERSION, ProtocolError, decode
name, repeat = sys.argv[1], int(sys.argv[2])
body = bodies()[name]()

def once():
    try:
        decode([VERSION, b"call", body])
        return "decoded"
    except ProtocolError as e:
        return str(e).split(":")[0][:60]

times = []
for _ in range(repeat):
    started = time.perf_counter()
    outcome = once()
    times.append(time.perf_counter() - started)
tracemalloc.start()  # a separate, untimed pass: the peak of what decoding allocates
once()
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"bytes": len(body), "outcome": outcome, "max_ms": max(times) * 1000,
                  "median_ms": sorted(times)[len(times) // 2] * 1000, "peak_mb": peak / 1024**2}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "decode.json"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name in bodies():
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(args.repeat)], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=600)
        results[name] = json.loads(out.stdout)
    report = {"machine": platform.platform(), "python": platform.python_version(), "repeat": args.repeat,
              "target_ms": TARGET_MS, "target_mb": TARGET_MB, "cases": results}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("| body | size | outcome | slowest | median | peak allocated |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['bytes'] / 1e6:.1f} MB | {r['outcome']} | {r['max_ms']:.1f} ms | "
              f"{r['median_ms']:.1f} ms | {r['peak_mb']:.0f} MB |")
    worst_ms = max(r["max_ms"] for name, r in results.items() if name != "64 MiB string")
    worst_mb = max(r["peak_mb"] for r in results.values())
    print(f"\nworst (besides copying a 64 MiB string): {worst_ms:.0f} ms; peak allocated: {worst_mb:.0f} MB "
          f"(targets: {TARGET_MS:g} ms, {TARGET_MB:g} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
