"""Figures 2 and 3: how fast the executor gets over a fault.

- **Recovery**: from the answer to a call that crashed its worker (SIGSEGV) to the next successful
  call, against a Jupyter kernel's ``restart_kernel(now=True)`` until the same function answers in
  the new kernel (and, once it exists, the same under ``--profile hardened``).
- **Timeout precision**: for calls that hang, the time their ``timeout`` answer arrives minus the
  timeout, as the client sees it (after each, a no-op call waits for the replacement worker, so the
  next hung call does not start in a queue).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from protocol import Call

from . import report
from .contestants import JupyterKernel
from .executors import SHARED, Running, direct
from .record import MEASURED, failed, log, measured, not_built, summarize
from .registry import Context, figure


def crash_recovery(running: Running, rounds: int) -> dict[str, Any]:
    """``rounds`` crashes, each followed by a no-op call. A round whose crash is not answered
    ``crashed`` (or whose next call fails) is kept as an anomaly, with its answer, and left out of
    the timings; the figure fails only if no round went right."""
    crash_answer: list[float] = []
    recovery: list[float] = []
    anomalies: list[str] = []
    client = running.client
    client.call(Call(tool="noop"))
    for _ in range(rounds):
        t0 = time.perf_counter()
        crashed = client.call(Call(tool="crash"))
        t1 = time.perf_counter()
        ok = client.call(Call(tool="noop"))
        t2 = time.perf_counter()
        if crashed.error is None or crashed.error.kind != "crashed":
            anomalies.append(f"the crash call was answered {crashed.error or 'ok'} after {t1 - t0:.2f} s")
        elif not ok.ok:
            anomalies.append(f"the call after a crash was answered {ok.error} after {t2 - t1:.2f} s")
        else:
            crash_answer.append(t1 - t0)
            recovery.append(t2 - t1)
    if not recovery:
        raise RuntimeError(f"no crash round went right: {anomalies[:3]}")
    return {"status": MEASURED, "recovery": summarize(recovery, "ms"), "crash_answered": summarize(crash_answer, "ms"),
            "anomalies": anomalies}


@figure(
    "recovery",
    "from a crashed worker to the next successful call, against a Jupyter kernel's restart",
    order=40, chart=report.chart_recovery, table=report.table_recovery,
)
def recovery(context: Context) -> dict[str, Any]:
    features, sizes = context.features, context.sizes
    entries: dict[str, Any] = {}
    log(f"recovery: {sizes.crash_rounds} crashes, {sizes.kernel_restarts} Jupyter kernel restarts")
    with direct(workers=1) as running:
        entries["ours"] = {"name": "ours: crash -> next successful call", **crash_recovery(running, sizes.crash_rounds)}
    if features.hardened:
        try:
            with SHARED.get(workers=1, profile="hardened") as running:
                entries["ours_hardened"] = {"name": "ours, --profile hardened: crash -> next successful call",
                                            **crash_recovery(running, sizes.crash_rounds)}
        except Exception as e:
            entries["ours_hardened"] = failed(e, name="ours, --profile hardened")
    else:
        entries["ours_hardened"] = not_built(features.missing("hardened"), name="ours, --profile hardened")
    try:
        kernel = JupyterKernel()
        try:
            restarts = [kernel.restart_and_answer() for _ in range(sizes.kernel_restarts)]
        finally:
            kernel.close()
        entries["jupyter_kernel"] = {"status": MEASURED, "name": "Jupyter kernel: restart_kernel(now=True) -> "
                                     "the same function answers", "recovery": summarize(restarts, "ms")}
    except Exception as e:
        entries["jupyter_kernel"] = failed(e, name="Jupyter kernel restart")
    ours = entries["ours"]["recovery"]["p50"]
    jupyter = entries["jupyter_kernel"].get("recovery", {}).get("p50")
    speedup = round(jupyter / ours, 1) if jupyter and ours else None
    return measured(
        title="Recovery: a crash until the next successful call",
        entries=entries,
        jupyter_over_ours=speedup,
        targets={
            "ours_recovery_p50_ms (issue 14)": {"value": ours, "at_most": 30.0, "met": ours <= 30.0},
            "jupyter_over_ours (issue 14)": {"value": speedup, "at_least": 20.0,
                                             "met": None if speedup is None else speedup >= 20.0},
        },
    )


@figure(
    "timeout_precision",
    "how late a hung call's `timeout` answer arrives after its deadline",
    order=60, chart=report.chart_timeouts, table=report.table_timeouts,
)
def timeout_precision(context: Context) -> dict[str, Any]:
    sizes = context.sizes
    log(f"timeout precision: {sizes.hung_calls} hung calls with a {sizes.hung_timeout_s:g} s timeout")
    overshoot: list[float] = []
    with direct(workers=1) as running:
        client = running.client
        client.call(Call(tool="noop"))
        for _ in range(sizes.hung_calls):
            t0 = time.perf_counter()
            hung = client.call(Call(tool="hang", timeout=sizes.hung_timeout_s))
            elapsed = time.perf_counter() - t0
            if hung.error is None or hung.error.kind != "timeout":
                raise RuntimeError(f"a hung call was answered {hung}")
            overshoot.append(elapsed - sizes.hung_timeout_s)
            with contextlib.suppress(Exception):
                client.call(Call(tool="noop"))
    summary = summarize(overshoot, "ms")
    return measured(
        title="Timeout precision: answer time minus the timeout, hung calls",
        timeout_s=sizes.hung_timeout_s,
        overshoot=summary,
        overshoot_ms=[round(x * 1000, 3) for x in overshoot],
        mean_ms=round(statistics.fmean(overshoot) * 1000, 3),
        targets={"overshoot_p99_ms (issue 14)": {"value": summary["p99"], "at_most": 100.0,
                                                  "met": summary["p99"] <= 100.0}},
    )
