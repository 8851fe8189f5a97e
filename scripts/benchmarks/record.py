"""How benchmark figures are recorded: the machine they ran on, summaries of timings, and the three
states a figure (or one entry of it) can be in.

Every figure in ``bench-results/results.json`` is a dict with ``status``:

- ``measured``: the numbers are there;
- ``not built yet``: the feature it measures does not exist in this tree (found out at run time
  from ``ciayn-executor ... --help``), with ``reason`` saying what is missing; the next run after it
  lands measures it, nothing to edit;
- ``failed``: the benchmark itself broke (``reason`` has the error); ``scripts/bench`` then exits 1.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import zmq

MEASURED = "measured"
NOT_BUILT = "not built yet"
FAILED = "failed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """The machine as it is right now (the load average changes from figure to figure)."""
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def summarize(seconds: Sequence[float], unit: str = "us") -> dict[str, Any]:
    """p50, p90, p99, min, max and count of durations given in seconds, in ``unit`` (us or ms)."""
    scale = {"us": 1e6, "ms": 1e3}[unit]
    ordered = sorted(seconds)
    if not ordered:
        return {"n": 0, "unit": unit}

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 3)

    return {
        "unit": unit,
        "n": len(ordered),
        "p50": round(statistics.median(ordered) * scale, 3),
        "p90": pick(0.90),
        "p99": pick(0.99),
        "min": round(ordered[0] * scale, 3),
        "max": round(ordered[-1] * scale, 3),
    }


def measured(**fields: Any) -> dict[str, Any]:
    return {"status": MEASURED, "machine": machine(), **fields}


def not_built(reason: str, **fields: Any) -> dict[str, Any]:
    return {"status": NOT_BUILT, "reason": reason, "machine": machine(), **fields}


def failed(error: BaseException | str, **fields: Any) -> dict[str, Any]:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {"status": FAILED, "reason": text, "machine": machine(), **fields}


def broken(figure: dict[str, Any]) -> bool:
    """True if the figure, or one of its entries, failed."""
    return figure.get("status") == FAILED or any(e.get("status") == FAILED for e in figure.get("entries", {}).values())


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
