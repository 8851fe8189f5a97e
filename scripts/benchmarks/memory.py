"""Executor memory: the supervisor's RSS and USS and each worker's USS (memory only that process
holds; forked workers share the template's pages until they write them), after a run of calls."""

from __future__ import annotations

import time
from typing import Any

import psutil

from protocol import Call

from . import report
from .executors import direct
from .record import log, measured
from .registry import Context, figure

WORKERS = 4
MB = 2**20
SETTLE_TIMEOUT = 5.0


def _uss(proc: psutil.Process) -> float:
    return round(float(proc.memory_full_info().uss) / MB, 2)


def _live(proc: psutil.Process) -> bool:
    """A worker waiting for a call: not one that answered its call and stopped itself, to be killed."""
    try:
        return bool(proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED) and proc.memory_info().rss > 0)
    except psutil.Error:
        return False


def _settled(supervisor: psutil.Process) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """The template and its live workers, once every worker slot is filled again (fresh workers
    replace themselves after each call), waiting at most SETTLE_TIMEOUT seconds."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        template = next((c for c in supervisor.children() if c.children()), None)
        workers = [w for w in template.children() if _live(w)] if template is not None else []
        if len(workers) >= WORKERS or time.monotonic() > deadline:
            return template, workers
        time.sleep(0.05)


@figure(
    "memory",
    "the supervisor's, the template's and each worker's memory after a run of calls",
    order=90, chart=report.chart_memory, table=report.table_memory,
)
def memory(context: Context) -> dict[str, Any]:
    calls = context.sizes.memory_calls
    log(f"memory: executor with {WORKERS} workers after {calls} calls")
    with direct(workers=WORKERS) as running:
        for start in range(0, calls, 4 * WORKERS):  # a few calls in flight per worker, never a full queue
            futures = [running.client.submit(Call(tool="noop")) for _ in range(min(4 * WORKERS, calls - start))]
            for future in futures:
                result = future.result()
                if not result.ok:
                    raise RuntimeError(f"a call failed: {result}")
        supervisor = running.supervisor()
        template, workers = _settled(supervisor)
        info = supervisor.memory_full_info()
        return measured(
            title="Executor memory",
            workers=WORKERS,
            after_calls=calls,
            supervisor_rss_mb=round(info.rss / MB, 2),
            supervisor_uss_mb=round(info.uss / MB, 2),
            template_uss_mb=_uss(template) if template is not None else None,
            template_rss_mb=round(template.memory_info().rss / MB, 2) if template is not None else None,
            worker_uss_mb=[_uss(w) for w in workers],
            worker_rss_mb=[round(w.memory_info().rss / MB, 2) for w in workers],
        )
