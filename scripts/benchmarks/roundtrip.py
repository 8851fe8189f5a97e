"""Figure 1: the round trip of a no-op tool call, ours against what users would pick instead, all
measured in interleaved blocks in one run (each round: a block of the floor, then a block of every
contestant, in rotating order), reported as p50/p99 and as ratios to the floor of the same round."""

from __future__ import annotations

import contextlib
import statistics
from typing import Any

from protocol import Call

from . import report
from .contestants import ClientCalls, Dealer, FreshPython, InProcess, JupyterKernel, ZmqEcho
from .executors import SHARED, Running, brokered, direct
from .record import MEASURED, failed, log, measured, not_built, summarize
from .registry import Context, figure

FLOOR = "floor_zmq_echo"


def worker_mode(running: Running) -> str:
    """``fresh`` if two calls in a row ran in different worker processes, else ``reused``."""
    pids = [running.client.call(Call(tool="pid")).value for _ in range(2)]
    return "fresh" if pids[0] != pids[1] else "reused"


@figure(
    "round_trip",
    "a no-op call's round trip: ours against the bare ZeroMQ echo, Jupyter, in-process, fresh python",
    order=10, chart=report.chart_round_trip, table=report.table_round_trip,
)
def round_trip(context: Context) -> dict[str, Any]:
    features, sizes, tmp = context.features, context.sizes, context.tmp
    entries: dict[str, dict[str, Any]] = {}
    contestants: list[tuple[str, Any]] = []
    notes: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        echo = ZmqEcho(tmp)
        stack.callback(echo.close)
        default = stack.enter_context(direct(workers=1))
        notes["default_worker_mode"] = mode = worker_mode(default)
        label = f"ours, direct ipc, {mode} workers (default flags)"
        contestants.append(("ours_dealer", Dealer(default.endpoint, f"{label}, plain DEALER")))
        contestants.append(("ours_client", ClientCalls(default.client, f"{label}, ExecutorClient")))

        if features.reuse_workers:
            _add(stack, entries, contestants, "ours_reuse_workers",
                 lambda: direct(workers=1, extra=["--reuse-workers"]),
                 "ours, direct ipc, --reuse-workers, plain DEALER", client_key="ours_reuse_workers_client")
        else:
            entries["ours_reuse_workers"] = not_built(features.missing("reuse_workers"),
                                                      name="ours, direct ipc, --reuse-workers")
        if features.hardened:
            _add(stack, entries, contestants, "ours_hardened",
                 lambda: SHARED.get(workers=1, profile="hardened"), "ours, --profile hardened, plain DEALER")
        else:
            entries["ours_hardened"] = not_built(features.missing("hardened"), name="ours, --profile hardened")
        if features.broker:
            _add(stack, entries, contestants, "ours_broker_tcp",
                 lambda: brokered(features, workers=1, executors=1),
                 "ours, through the broker over tcp (loopback), plain DEALER")
        else:
            entries["ours_broker_tcp"] = not_built(features.missing("broker"), name="ours, through the broker over tcp")

        contestants.append(("in_process", InProcess()))
        try:
            kernel = JupyterKernel()
            stack.callback(kernel.close)
            notes["jupyter_kernel_start_s"] = round(kernel.start_s, 3)
            contestants.append(("jupyter_kernel", kernel))
        except Exception as e:
            entries["jupyter_kernel"] = failed(e, name=JupyterKernel.name)
        contestants.append(("fresh_python", FreshPython()))

        # Each contestant's block is sized from a warm-up to take about sizes.block_s.
        sized = [(key, c, sizes.block(statistics.median(c.block(2)))) for key, c in contestants]
        echo_n = sizes.block(statistics.median(echo.block(20)))
        notes["calls_per_block"] = {key: n for key, _, n in sized} | {FLOOR: echo_n}
        times: dict[str, list[float]] = {key: [] for key, _ in contestants}
        floor: list[float] = []
        round_ratios: dict[str, list[float]] = {key: [] for key, _ in contestants}
        log(f"round trip: {sizes.rounds} interleaved rounds of {len(contestants)} contestants and the floor")
        for i in range(sizes.rounds):
            floor_block = echo.block(echo_n)
            floor += floor_block
            order = sized[i % len(sized):] + sized[: i % len(sized)]
            for key, contestant, n in order:
                block = contestant.block(n)
                times[key] += block
                round_ratios[key].append(statistics.median(block) / statistics.median(floor_block))

    entries[FLOOR] = {"status": MEASURED, "name": ZmqEcho.name, "latency": summarize(floor), "ratio_to_floor": 1.0}
    for key, contestant in contestants:
        entries[key] = {"status": MEASURED, "name": contestant.name, "latency": summarize(times[key]),
                        "ratio_to_floor": _sig(statistics.median(round_ratios[key])),
                        "ratio_to_floor_by_round": [_sig(r) for r in round_ratios[key]]}
    return measured(
        title="Round trip of a no-op tool call",
        method=(f"{sizes.rounds} interleaved rounds in one run; each round times a block of the floor, then a block "
                "of every contestant (rotating order); ratio_to_floor is the median over rounds of "
                "(contestant's median / the floor's median in the same round)"),
        notes=notes, entries=entries, targets=_targets(entries))


def _sig(ratio: float) -> float:
    """Three significant figures: an in-process call is well under a thousandth of the floor, and a fixed
    number of decimals rounded it to 0."""
    return float(f"{ratio:.3g}")


def _add(stack: contextlib.ExitStack, entries: dict[str, dict[str, Any]], contestants: list[tuple[str, Any]],
         key: str, start: Any, name: str, client_key: str = "") -> None:
    """Start an executor flavour that exists in this tree (and time it through a plain DEALER, and
    through ``ExecutorClient`` under ``client_key``); a start-up failure is recorded, not fatal."""
    try:
        running = stack.enter_context(start())
        dealer = Dealer(running.endpoint, name)
        stack.callback(dealer.close)
        contestants.append((key, dealer))
        if client_key:
            client_name = name.replace("plain DEALER", "ExecutorClient")
            contestants.append((client_key, ClientCalls(running.client, client_name)))
    except Exception as e:
        entries[key] = failed(e, name=name)


def _ratio(entries: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    if entries.get(a, {}).get("status") != MEASURED or entries.get(b, {}).get("status") != MEASURED:
        return None
    return round(float(entries[a]["latency"]["p50"]) / float(entries[b]["latency"]["p50"]), 3)


def _target(value: float | None, limit: float, at_most: bool) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"value": value, ("at_most" if at_most else "at_least"): limit, "met": met}


def _targets(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def floor_ratio(key: str) -> float | None:
        entry = entries.get(key, {})
        return entry.get("ratio_to_floor") if entry.get("status") == MEASURED else None

    def p50_ratio(a: str, b: str) -> float | None:
        return _ratio(entries, a, b)

    return {
        "ours_dealer_vs_floor (issue 14)": _target(floor_ratio("ours_dealer"), 3.0, True),
        "ours_client_vs_floor (issue 14)": _target(floor_ratio("ours_client"), 3.0, True),
        "ours_reuse_workers_vs_floor (issue 14)": _target(floor_ratio("ours_reuse_workers"), 3.0, True),
        "ours_reuse_workers_client_vs_floor (issue 14)": _target(floor_ratio("ours_reuse_workers_client"), 3.0, True),
        "jupyter_vs_ours_dealer (issue 14)": _target(p50_ratio("jupyter_kernel", "ours_dealer"), 15.0, False),
        "hardened_vs_default_p50 (issue 11)": _target(p50_ratio("ours_hardened", "ours_dealer"), 2.0, True),
        "broker_tcp_vs_direct_ipc_p50 (issue 12)": _target(p50_ratio("ours_broker_tcp", "ours_dealer"), 2.0, True),
    }
