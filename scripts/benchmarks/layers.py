"""The cost of the hardened profile's layers, as far as they can be switched from outside: the whole
profile (``--profile hardened`` against the default) and the control-group layer (``--no-cgroups``
in the default profile; the hardened one refuses to run without them). No-op calls through a plain
DEALER, the four executors in interleaved rounds. The other layers (namespaces, uid, capabilities,
seccomp, Landlock, read-only mounts) have no switch, so they are not separated."""

from __future__ import annotations

import contextlib
import statistics
from typing import Any

from . import hardened, report
from .contestants import Dealer
from .executors import SHARED, direct
from .record import MEASURED, failed, log, measured, not_built, summarize
from .registry import Context, figure

TITLE = "Cost of the hardened profile and of each of its layers"
FLAVOURS: dict[str, tuple[str, list[str]]] = {
    "default": ("default", []),
    "default --no-cgroups": ("default", ["--no-cgroups"]),
    "hardened": ("hardened", []),
}


def per_layer(tiny: bool) -> dict[str, Any]:
    """Each layer's own cost, from the hardened profile's benchmark (scripts/benchmarks/hardened.py,
    issue 11), which times the layers inside a worker as it is prepared. Skipped at the tiny size: its
    executors start with a selfcheck that takes seconds, and it is that script's own code path."""
    if tiny:
        return {"status": "skipped at the tiny size (scripts/benchmarks/hardened.py is run by full runs)"}
    try:
        figures = hardened.bench(calls=40, seconds=2.0, rounds=10)
    except Exception as e:
        return failed(e)
    prep = figures.get("preparation", {})
    return {"status": MEASURED, "layers_ms": prep.get("layers_ms"), "prepare_hardened_ms": prep.get("hardened_ms"),
            "prepare_default_ms": prep.get("default_ms"), "bench_hardened": figures}


@figure(
    "hardened_layers",
    "what --profile hardened, and each of its layers, adds to a call",
    order=100, table=report.table_layers,
)
def hardened_layers(context: Context) -> dict[str, Any]:
    features, sizes, tiny = context.features, context.sizes, context.tiny
    if not features.hardened:
        return not_built(features.missing("hardened"), title=TITLE)
    times: dict[str, list[float]] = {name: [] for name in FLAVOURS}
    failures: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        dealers: dict[str, tuple[Dealer, int]] = {}
        for name, (profile, extra) in FLAVOURS.items():
            try:
                start = SHARED.get if profile == "hardened" else direct  # its start runs a selfcheck: share it
                running = stack.enter_context(start(workers=1, profile=profile, extra=extra))
                dealer = Dealer(running.endpoint, name)
                stack.callback(dealer.close)
                n = max(2, int(sizes.path_block_s / max(1e-6, statistics.median(dealer.block(3)))))
                dealers[name] = (dealer, n)
            except Exception as e:  # e.g. hardened refuses to start without a layer
                failures[name] = " ".join(f"{type(e).__name__}: {e}".split())
        rounds = max(2, sizes.path_rounds // 2)
        log(f"hardened layers: {rounds} interleaved rounds of {', '.join(dealers)}")
        for _ in range(rounds):
            for name, (dealer, n) in dealers.items():
                times[name] += dealer.block(n)
    latency = {name: summarize(t) for name, t in times.items() if t}

    def diff(a: str, b: str) -> float | None:
        if a in latency and b in latency:
            return round(float(latency[a]["p50"]) - float(latency[b]["p50"]), 1)
        return None

    log("hardened layers: scripts/benchmarks/hardened.py" + (" (skipped at the tiny size)" if tiny else ""))
    return measured(
        title=TITLE,
        entries={"per_layer": per_layer(tiny)},
        latency=latency,
        could_not_start=failures,
        cost_us={
            "hardened profile over default (p50)": diff("hardened", "default"),
            "cgroups layer, default profile (p50)": diff("default", "default --no-cgroups"),
        },
        not_separable="namespaces (pid, mount, net), another uid, dropped capabilities, seccomp, Landlock and the "
                      "read-only mounts have no switch of their own; entries.per_layer has their costs as "
                      "scripts/benchmarks/hardened.py times them inside a worker being prepared",
    )
