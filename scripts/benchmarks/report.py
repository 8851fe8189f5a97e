"""Turn ``results.json`` into PNG charts (matplotlib: titles, units, labelled axes, the machine in a
caption) and one markdown text (tables plus a sentence per figure on what it means), written to
``bench-results/results.md`` and, between the ``<!-- bench:begin -->`` and ``<!-- bench:end -->``
markers, into ``bench-results/README.md`` (the project README only links to it)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .record import MEASURED

if TYPE_CHECKING:
    from .registry import Figure

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _machine_caption(fig: dict[str, Any]) -> str:
    m = fig.get("machine") or {}
    return (f"{m.get('cores')} cores, {m.get('cpu_model')}; Python {m.get('python')}, pyzmq {m.get('pyzmq')}, "
            f"libzmq {m.get('libzmq')}; load {m.get('load_avg_1m')}")


def _fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    size = abs(us)
    if size >= 10_000:
        return f"{us / 1000:.0f} ms"
    if size >= 1000:
        return f"{us / 1000:.1f} ms"
    if size >= 10:
        return f"{us:.0f} us"
    return f"{us:.2f} us"


def _fmt_ratio(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


# ------------------------------------------------------------------------------------------- charts


def charts(results: dict[str, Any], out: Path, figures: Sequence[Figure]) -> list[str]:
    """Draw the chart of every figure that has one and was measured; return the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for figure in figures:
        fig_data = results["figures"].get(figure.name, {})
        if figure.chart is None or fig_data.get("status") != MEASURED:
            continue
        fig = plt.figure(figsize=(10, 5.6))
        figure.chart(fig, fig_data)
        fig.text(0.01, 0.005, _machine_caption(fig_data), fontsize=7, color="0.4")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(out / f"{figure.name}.png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(f"{figure.name}.png")
    return written


def chart_round_trip(fig: Any, data: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    rows = [(e["name"], e) for e in data["entries"].values()]
    rows.sort(key=lambda r: r[1]["latency"]["p50"] if r[1].get("status") == MEASURED else float("inf"))
    names = [name for name, _ in rows]
    for i, (_name, e) in enumerate(rows):
        if e.get("status") != MEASURED:
            ax.text(0.06, i, f"{e['status']}: {e.get('reason', '')[:90]}", va="center", fontsize=7, color="0.35")
            continue
        lat = e["latency"]
        ax.barh(i, lat["p50"], color="tab:orange" if "ours" in e["name"] else "tab:blue")
        ax.plot([lat["p99"]], [i], marker="|", markersize=14, color="black")
        ax.text(lat["p99"] * 1.3, i, f"{_fmt_us(lat['p50'])}  ({_fmt_ratio(e['ratio_to_floor'])} floor)", va="center",
                fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xscale("log")
    top = max((e["latency"]["p99"] for _, e in rows if e.get("status") == MEASURED), default=1.0)
    ax.set_xlim(0.05, top * 40)
    ax.set_xlabel("round trip, microseconds (log scale); bar = p50, | = p99")
    ax.set_title("No-op tool call round trip, interleaved in one run (orange: ours)")


def chart_call_path(fig: Any, data: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    hops = list(data["hops_us"].items())
    names = [textwrap.fill(k, 40) for k, _ in hops][::-1]
    values = [v for _, v in hops][::-1]
    colors = ["tab:red" if "everything else" in n else "tab:green" if "hop" in n else "tab:purple" for n in names]
    ax.barh(range(len(values)), values, color=colors)
    for i, v in enumerate(values):
        ax.text(max(v, 0) + 1, i, f"{v:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    total = data["round_trip_us"]["plain DEALER (p50)"]
    floor = data["round_trip_us"]["floor: bare ZeroMQ echo (p50)"]
    ax.set_xlabel("microseconds per no-op call (p50)\ngreen: wire hops at their floor, purple: codec, red: the rest")
    fig.set_size_inches(11, 7.5)
    ax.set_title(f"Where a no-op call's {total:.0f} us go ({data['path_flags']}, plain DEALER)\n"
                 f"{total / floor:.1f}x the {floor:.0f} us bare ZeroMQ echo of the same rounds", fontsize=10)


def chart_cuts(fig: Any, data: dict[str, Any]) -> None:
    rows = [(k, e) for k, e in data["entries"].items() if e.get("status") == MEASURED]
    ax = fig.add_subplot(1, 1, 1)
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [e["latency"]["p50"] for _, e in rows], height=0.4, color="tab:orange",
            label="round trip p50")
    ax.barh([i - 0.2 for i in y], [e["cpu_per_call_us"] for _, e in rows], height=0.4, color="tab:gray",
            label="CPU per call, all processes")
    for i, (_, e) in enumerate(rows):
        ax.text(e["latency"]["p50"] * 1.01, i + 0.2, f"{e['latency']['p50']:.0f} us ({e['ratio_to_floor']:.1f}x floor)",
                va="center", fontsize=8)
    ax.set_yticks(list(y), [textwrap.fill(k, 40) for k, _ in rows], fontsize=8)
    ax.set_xlabel("microseconds per no-op call")
    ax.legend(fontsize=8)
    ax.set_title(f"What candidate cuts would buy ({data['path_flags']}; what-if runs, executor/ unchanged)")


def chart_fresh(fig: Any, data: dict[str, Any]) -> None:
    modes = (("fresh", "fresh workers (default)", "tab:orange"), ("reuse_workers", "--reuse-workers", "tab:blue"))
    ax = fig.add_subplot(1, 2, 1)
    groups = (("low_load_p50_us", f"calls {data['pause_between_calls_s'] * 1000:.0f} ms apart"),
              ("back_to_back_p50_us", "back to back"))
    for j, (mode, label, color) in enumerate(modes):
        values = [data[key][mode] / 1000 for key, _ in groups]
        bars = ax.bar([i + j * 0.38 for i in range(len(groups))], values, width=0.38, color=color, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([i + 0.19 for i in range(len(groups))], [g for _, g in groups])
    ax.set_ylabel("p50 round trip, milliseconds")
    ax.set_title("No-op call latency")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    values = [data["throughput_calls_per_s"][mode] for mode, _, _ in modes]
    bars = ax.bar(range(len(modes)), values, color=[c for _, _, c in modes])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.axhline(200, color="black", linestyle="--", label="target for fresh workers: 200 calls/s")
    ax.set_xticks(range(len(modes)), [label for _, label, _ in modes])
    ax.set_ylabel("calls per second")
    ax.set_title("Sustained no-op calls (100 in flight, --workers 2)")
    ax.legend(fontsize=8)


def chart_weight(fig: Any, data: dict[str, Any]) -> None:
    p50, cpu, floor = data["p50_us"], data["cpu_per_call_us"], data["fork_floor"]
    ax = fig.add_subplot(1, 2, 1)
    names = [k for k in ("zmq_echo", "fork_floor", "reuse_back_to_back", "reuse_paced", "fresh_paced",
                         "fresh_back_to_back", "jupyter_execute") if k in p50]
    bars = ax.barh(range(len(names)), [p50[k] / 1000 for k in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_yticks(range(len(names)), [k.replace("_", " ") for k in names], fontsize=8)
    ax.set_xlabel("p50, milliseconds")
    ax.set_title("No-op call latency against the floors")
    ax = fig.add_subplot(1, 2, 2)
    labels = ("template fork+exit+wait", "fresh call", "--reuse-workers call")
    values = [floor["cpu_us"] / 1000, cpu["fresh"] / 1000, cpu["reuse_workers"] / 1000]
    bars = ax.bar(range(3), values, color=["0.5", "tab:orange", "tab:blue"])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(2 * floor["cpu_us"] / 1000, color="black", linestyle="--", label="target: 2x the fork floor")
    ax.set_xticks(range(3), labels, fontsize=8)
    ax.set_ylabel("CPU per call, all processes, milliseconds")
    ax.set_title("CPU per no-op call")
    ax.legend(fontsize=8)


def chart_recovery(fig: Any, data: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    entries = list(data["entries"].values())
    for i, e in enumerate(entries):
        if e.get("status") != MEASURED:
            ax.text(1, i, f"{e['status']}: {e.get('reason', '')[:80]}", va="center", fontsize=7, color="0.35")
            continue
        rec = e["recovery"]
        ax.barh(i, rec["p50"], color="tab:orange" if e["name"].startswith("ours") else "tab:blue")
        ax.plot([rec["p90"]], [i], marker="|", markersize=14, color="black")
        ax.text(rec["p50"] * 1.15, i, f"{rec['p50']:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(entries)), [e["name"] for e in entries], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(0.5, None)
    ax.set_xlabel("milliseconds (log scale); bar = p50, | = p90")
    ax.set_title("Recovery: from a crash to the next successful call")


def chart_timeouts(fig: Any, data: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    ax.hist(data["overshoot_ms"], bins=30, color="tab:orange")
    ax.axvline(data["overshoot"]["p99"], color="black", linestyle="--", label=f"p99 {data['overshoot']['p99']:.1f} ms")
    ax.legend()
    ax.set_xlabel(f"answer time minus the {data['timeout_s']:g} s timeout, milliseconds")
    ax.set_ylabel("hung calls")
    ax.set_title("Timeout precision: how late a hung call's `timeout` answer arrives")


def chart_pool(fig: Any, data: dict[str, Any]) -> None:
    workers = data["workers"]
    modes = list(data["modes"].items())
    fig.set_size_inches(11, 4.2 * len(modes))
    for row, (mode, result) in enumerate(modes):
        for col, (tool, title) in enumerate((("noop", "no-op tool"), ("sleep_10ms", "tool sleeping 10 ms"))):
            ax = fig.add_subplot(len(modes), 2, 2 * row + col + 1)
            for controllers, rates in result["calls_per_s"][tool].items():
                ax.plot(workers, rates, marker="o", label=f"{controllers} controller(s)")
            if tool == "sleep_10ms":
                ax.plot(workers, data["sleep_10ms_ideal_calls_per_s"], linestyle=":", color="0.4",
                        label="ideal (workers / 10 ms)")
                ax.set_yscale("log")
            ax.set_xlabel("total workers")
            ax.set_ylabel("calls per second")
            ax.set_xscale("log", base=2)
            ax.set_xticks(workers, [str(w) for w in workers])
            ax.set_title(f"{title}, executors at {mode}", fontsize=10)
            ax.legend(fontsize=7)
    fig.suptitle(f"Pool scaling: calls/s against total workers ({data['via']})", fontsize=11)


def chart_ciayn(fig: Any, data: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    stages = list(data["stages_us"].items())
    ax.barh(range(len(stages)), [v["p50"] for _, v in stages], color="tab:purple")
    for i, (_, v) in enumerate(stages):
        ax.text(v["p50"] * 1.02, i, f"{v['p50']:.1f} us", va="center", fontsize=8)
    ax.set_yticks(range(len(stages)), [k for k, _ in stages], fontsize=8)
    ax.set_xlabel("microseconds per step (p50)")
    ax.set_title(f"CIAYN overhead per step: {data['text']}")


def chart_memory(fig: Any, data: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    bars = [("supervisor RSS", data["supervisor_rss_mb"]), ("supervisor USS", data["supervisor_uss_mb"]),
            ("template USS", data["template_uss_mb"] or 0)]
    bars += [(f"worker {i} USS", v) for i, v in enumerate(data["worker_uss_mb"])]
    ax.bar(range(len(bars)), [v for _, v in bars], color=["tab:orange"] * 2 + ["tab:blue"] + ["tab:green"] * (
        len(bars) - 3))
    for i, (_, v) in enumerate(bars):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [k for k, _ in bars], fontsize=8)
    ax.set_ylabel("megabytes")
    ax.set_title(f"Executor memory with {data['workers']} workers after {data['after_calls']} calls")


# ----------------------------------------------------------------------------------------- markdown


def markdown(results: dict[str, Any], figures: Sequence[Figure], images: str = "") -> str:
    """The tables and sentences; ``images`` is the path prefix of the PNGs as seen from the file."""
    figs = results["figures"]
    m = results["machine"]
    lines = [
        f"Measured by `scripts/bench` ({results['size']} size, {results['elapsed_s']:.0f} s) on {m['cores']} cores "
        f"({m['cpu_model']}), kernel {m['kernel']}, Python {m['python']}, pyzmq {m['pyzmq']}, libzmq {m['libzmq']}; "
        f"every figure in `bench-results/results.json` records the machine and its load when it ran. "
        "Figures for parts not built yet are recorded as such and fill in on the next run after they land.",
        "",
    ]
    targets = [(name, t) for f in figs.values() for name, t in (f.get("targets") or {}).items()]
    if targets:
        lines += ["| target | measured | wanted | met | the bare architecture |", "|---|---|---|---|---|"]
        for name, t in targets:
            wanted = f"at most {t['at_most']:g}" if "at_most" in t else f"at least {t['at_least']:g}"
            value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            arch = f"{t['architecture']:.3g}" if t.get("architecture") is not None else ""
            lines.append(f"| {name} | {value} | {wanted} | {met} | {arch} |")
        lines.append("")
    for figure in figures:
        key, fig = figure.name, figs.get(figure.name, {})
        if fig.get("status") != MEASURED or figure.table is None:
            lines += [f"**{fig.get('title', key)}**: {fig.get('status', 'missing')}: {fig.get('reason', '')}", ""]
            continue
        lines += figure.table(fig)
        if Path(results["out"], f"{key}.png").exists():
            lines += [f"![{fig['title']}]({images}{key}.png)", ""]
    return "\n".join(lines)


def table_round_trip(f: dict[str, Any]) -> list[str]:
    rows = ["| no-op call round trip | p50 | p99 | x floor (same rounds) |", "|---|---|---|---|"]
    entries = f["entries"]
    measured_entries = sorted((e for e in entries.values() if e.get("status") == MEASURED),
                              key=lambda e: e["latency"]["p50"])
    for e in measured_entries:
        lat = e["latency"]
        ratio = _fmt_ratio(e["ratio_to_floor"])
        rows.append(f"| {e['name']} | {_fmt_us(lat['p50'])} | {_fmt_us(lat['p99'])} | {ratio} |")
    for e in entries.values():
        if e.get("status") != MEASURED:
            rows.append(f"| {e['name']} | {e['status']} | | {e.get('reason', '')} |")
    t = {k.split(" (")[0]: v["value"] for k, v in f["targets"].items()}

    def x(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}x"

    mode = f["notes"].get("default_worker_mode")
    sentence = (f"**What it means:** with the default flags ({mode} workers: a new worker process per call) a no-op "
                f"call costs {x(t['ours_dealer_vs_floor'])} the bare ZeroMQ echo measured in the same rounds "
                f"({x(t['ours_client_vs_floor'])} through `ExecutorClient`); with `--reuse-workers` "
                f"{x(t['ours_reuse_workers_vs_floor'])} ({x(t['ours_reuse_workers_client_vs_floor'])} through "
                f"`ExecutorClient`); the target is 3x. A Jupyter kernel's execute round trip costs "
                f"{x(t['jupyter_vs_ours_dealer'])} our default (target at least 15x). An in-process call has no "
                "isolation at all; a fresh `python -c` per call pays for a whole interpreter start every time.")
    return [f"**{f['title']}** ({f['method']})", "", *rows, "", sentence, ""]


def table_fresh(f: dict[str, Any]) -> list[str]:
    rows = ["| no-op calls, --workers 2 | fresh workers (default) | --reuse-workers |", "|---|---|---|"]
    for key, label in (("low_load_p50_us", f"p50, calls {f['pause_between_calls_s'] * 1000:.0f} ms apart"),
                       ("back_to_back_p50_us", "p50, back to back")):
        rows.append(f"| {label} | {_fmt_us(f[key]['fresh'])} | {_fmt_us(f[key]['reuse_workers'])} |")
    tp, rss = f["throughput_calls_per_s"], f["supervisor_rss_mb"]
    rows.append(f"| sustained, 100 in flight | {tp['fresh']:.0f} calls/s | {tp['reuse_workers']:.0f} calls/s |")
    rows.append(f"| supervisor RSS after it all | {rss['fresh']:.0f} MB | {rss['reuse_workers']:.0f} MB |")
    low = f["low_load_p50_us"]
    sentence = (f"**What it means:** when calls come apart, as an agent's do, the worker forked ahead is ready and "
                f"has rehearsed the call path, and a fresh worker costs {low['fresh'] / low['reuse_workers']:.2f}x "
                "reusing one (target 1.2x). Back to back, or sustained, every call pays a fork, its set-up and an "
                "exit: several ms of CPU on this machine, which caps the calls per second.")
    return [f"**{f['title']}** ({f['samples_per_mode']} calls per mode, interleaved rounds; machine load "
            f"{f['machine']['load_avg_1m']})", "", *rows, "", sentence, ""]


def table_weight(f: dict[str, Any]) -> list[str]:
    p50, cpu, floor = f["p50_us"], f["cpu_per_call_us"], f["fork_floor"]
    rows = ["| no-op call, --workers 2 | p50 | CPU per call, all processes |", "|---|---|---|",
            f"| template fork+exit+wait (floor) | {_fmt_us(p50['fork_floor'])} | {_fmt_us(floor['cpu_us'])} |",
            f"| fresh worker, back to back (default) | {_fmt_us(p50['fresh_back_to_back'])} | "
            f"{_fmt_us(cpu['fresh'])} |",
            f"| fresh worker, calls 20 ms apart | {_fmt_us(p50['fresh_paced'])} | |",
            f"| --reuse-workers, back to back | {_fmt_us(p50['reuse_back_to_back'])} | "
            f"{_fmt_us(cpu['reuse_workers'])} |",
            f"| --reuse-workers, calls 20 ms apart | {_fmt_us(p50['reuse_paced'])} | |",
            f"| bare ZeroMQ echo | {_fmt_us(p50['zmq_echo'])} | |"]
    if "zmq_echo_paced" in p50:  # (results written before it have none)
        rows.append(f"| bare ZeroMQ echo, 20 ms apart | {_fmt_us(p50['zmq_echo_paced'])} | |")
    if "arch_fresh_back_to_back" in p50:  # (results written before archfloor.py have none)
        rows += [f"| the bare architecture, fresh, back to back | {_fmt_us(p50['arch_fresh_back_to_back'])} | "
                 f"{_fmt_us(cpu['arch_fresh'])} |",
                 f"| the bare architecture, fresh, 20 ms apart | {_fmt_us(p50['arch_fresh_paced'])} | |",
                 f"| the bare architecture, reused, back to back | {_fmt_us(p50['arch_reuse_back_to_back'])} | "
                 f"{_fmt_us(cpu['arch_reuse'])} |",
                 f"| the bare architecture, reused, 20 ms apart | {_fmt_us(p50['arch_reuse_paced'])} | |"]
    if "jupyter_execute" in p50:
        rows.append(f"| Jupyter kernel execute | {_fmt_us(p50['jupyter_execute'])} | |")
    if "jupyter_execute_paced" in p50:
        rows.append(f"| Jupyter kernel execute, 20 ms apart | {_fmt_us(p50['jupyter_execute_paced'])} | |")
    sentence = (f"**What it means:** a fresh call costs {cpu['fresh'] / floor['cpu_us']:.1f}x the CPU of the "
                f"template's own fork+exit+wait ({f['fresh_calls_per_s']:.0f} fresh calls/s sustained); the "
                f"template holds {f['template_private_mb']} MB of memory no worker shares (the rest it shares "
                f"with the workers forked from it; the floor's process, which has no child then, "
                f"{floor['private_mb']} MB). The per-process split is in results.json.")
    if "zmq_echo_paced" in p50:
        sentence += (f" Calls 20 ms apart, as an agent's come, find every process asleep: the echo itself then takes "
                     f"{p50['zmq_echo_paced'] / p50['zmq_echo']:.1f}x its back-to-back time on this machine, and "
                     f"against the echo at that pace --reuse-workers costs "
                     f"{p50['reuse_paced'] / p50['zmq_echo_paced']:.1f}x and a fresh worker "
                     f"{p50['fresh_paced'] / p50['zmq_echo_paced']:.1f}x (back to back: "
                     f"{p50['reuse_back_to_back'] / p50['zmq_echo']:.1f}x and "
                     f"{p50['fresh_back_to_back'] / p50['zmq_echo']:.1f}x).")
    if "jupyter_execute_paced" in p50:
        sentence += (" A Jupyter kernel's execute at that pace takes "
                     f"{p50['jupyter_execute_paced'] / p50['fresh_paced']:.1f}x a fresh worker's call "
                     f"({p50['jupyter_execute'] / p50['fresh_back_to_back']:.1f}x back to back).")
    scaling = ["| workers (tool sleeps 100 ms, fresh workers) | calls/s | of linear |", "|---|---|---|"]
    scaling += [f"| {n} | {row['calls_per_s']:.1f} | {row['of_linear']:.2f} |"
                for n, row in f.get("scaling_100ms", {}).items()]
    return [f"**{f['title']}** ({f['samples']['rounds']} interleaved rounds of {f['samples']['per_round']} calls "
            "per mode)", "", *rows, "", sentence, "", *scaling, ""]


def table_call_path(f: dict[str, Any]) -> list[str]:
    rows = [f"| hop ({f['path_flags']}, plain DEALER, no-op call, p50) | us |", "|---|---|"]
    rows += [f"| {k} | {v:.1f} |" for k, v in f["hops_us"].items()]
    rt = f["round_trip_us"]
    rows += ["", "| round trip (p50, interleaved) | us |", "|---|---|"]
    rows += [f"| {k} | {v:.1f} |" for k, v in rt.items()]
    rows += ["", "| codec and bookkeeping step (timed in-process on a real call's frames) | us |", "|---|---|"]
    rows += [f"| {k} | {v['us']:.1f} |" for k, v in f["codec_us"].items()]
    rows += ["", "| CPU per call (schedstat) | us | times scheduled |", "|---|---|---|"]
    rows += [f"| {k} | {v['cpu_us']:.1f} | {v['scheduled']:.2f} |" for k, v in f["cpu_per_call"].items()]
    rows += [f"| for comparison: the floor's echo server, per round trip | "
             f"{f.get('floor_echo_server_cpu_per_round_trip_us', 0):.1f} | |"]
    ec = f["executor_client_us"]
    extra = (ec["extra over plain DEALER, request side (its loop, future)"]
             + ec["extra over plain DEALER, reply side (its loop, future)"])
    total, echo = rt["plain DEALER (p50)"], rt["floor: bare ZeroMQ echo (p50)"]
    channel = rt["floor: bare socketpair echo, worker channel framing (p50)"]
    codec = sum(float(s["us"]) for s in f["codec_us"].values())
    sentence = (f"**What it means:** the executor's path has four process hops where the echo has two. Of the "
                f"{total:.0f} us, the two wire hops at their floors cost {echo:.0f} + {channel:.0f} us, the codec on "
                f"all hops about {codec:.0f} us, and the rest (red) is the processes' loops, per-call bookkeeping and "
                f"wake-ups: the supervisor's main thread alone spends "
                f"{f['supervisor_main_thread_beyond_codec_us']:.0f} us of CPU per call beyond its codec steps, where "
                f"the echo server spends {f.get('floor_echo_server_cpu_per_round_trip_us', 0):.0f} us in all. "
                f"`ExecutorClient` adds {extra:.0f} us over a plain DEALER.")
    fresh = f.get("fresh_worker_per_call")
    if fresh:
        sentence += (" With the default flags every call gets a freshly forked worker: "
                     f"{fresh['round_trip_us']:.0f} us per no-op call, "
                     f"{fresh['extra_over_reuse_workers_us']:.0f} us more than reusing one, and "
                     f"{fresh['cpu_per_call_total_us']:.0f} us of CPU per call over all processes.")
    paced = f.get("paced")
    if paced:  # (results written before it have none)
        back, apart = f["split_us"], paced["split_us"]
        rows += ["", f"| one call (plain DEALER, p50) | back to back | {paced['pause_s'] * 1000:g} ms apart | "
                 "apart / back to back |", "|---|---|---|---|"]
        rows += [f"| {k} | {back[k]:.0f} us | {v:.0f} us | {v / back[k]:.1f}x |" for k, v in apart.items()
                 if back.get(k)]
        rows.append(f"| floor: bare ZeroMQ echo | {echo:.0f} us | {paced['floor_echo_p50_us']:.0f} us | "
                    f"{paced['floor_echo_p50_us'] / echo:.1f}x |")
        sentence += (f" Calls {paced['pause_s'] * 1000:g} ms apart, as an agent's come, find every process asleep "
                     "and its caches cold: each step of the path then takes several times as long, the echo "
                     f"{paced['floor_echo_p50_us'] / echo:.1f}x, the executor's whole round trip "
                     f"{apart['round trip'] / back['round trip']:.1f}x: its Python costs more the less often it runs.")
    return [f"**{f['title']}** ({f['method']})", "", *rows, "", sentence, ""]


def table_cuts(f: dict[str, Any]) -> list[str]:
    rows = ["| variant | p50 | p99 | x floor | CPU per call (all) | supervisor CPU | worker CPU |",
            "|---|---|---|---|---|---|---|"]
    for name, e in f["entries"].items():
        if e.get("status") != MEASURED:
            rows.append(f"| {name} | {e.get('status')}: {e.get('reason', '')} | | | | | |")
            continue
        lat = e["latency"]
        rows.append(f"| {name} | {_fmt_us(lat['p50'])} | {_fmt_us(lat['p99'])} | {e['ratio_to_floor']:.1f}x | "
                    f"{e['cpu_per_call_us']:.0f} us | {e['supervisor_cpu_per_call_us']:.0f} us | "
                    f"{e['worker_cpu_per_call_us']:.0f} us |")
    return [f"**{f['title']}** ({f['method']})", "", *rows, "",
            f"**What it means:** the rows before 'default flags' are the executor on the lean path "
            f"({f['path_flags']}) as shipped and with candidate cuts applied in memory to its supervisor; the "
            "difference to the first row, in the same rounds, is what the cut would buy on this machine. 'No "
            "bookkeeping' is not a cut to make (a resent id would run again, unchecked arguments reach the tool): "
            "it bounds what trimming the supervisor's at-most-once memory, argument check, statistics and output "
            "reads could buy. The three rows after it bound a hand-written codec: a client that packs the call "
            "and reads the reply with msgpack alone, a supervisor that builds a call from its msgpack body "
            "unchecked and packs only a result's id, value and executor (less than any real codec, on either "
            "side), and that with no bookkeeping as well. The last rows compare the default flags (a fresh "
            "worker per call) with a spare prewarmed worker and without control groups: what the fresh-worker path "
            "spends waiting for its replacement worker. Which cuts to make is a decision for the code's owners.", ""]


def table_recovery(f: dict[str, Any]) -> list[str]:
    rows = ["| recovery | p50 | p90 | n |", "|---|---|---|---|"]
    for e in f["entries"].values():
        if e.get("status") != MEASURED:
            rows.append(f"| {e['name']} | {e['status']} | | {e.get('reason', '')} |")
            continue
        r = e["recovery"]
        rows.append(f"| {e['name']} | {r['p50']:.1f} ms | {r['p90']:.1f} ms | {r['n']} |")
        for anomaly in e.get("anomalies", []):
            rows.append(f"| {e['name']}: anomaly | {anomaly} | | |")
    ours = f["entries"]["ours"]["recovery"]["p50"]
    sentence = (f"**What it means:** after a tool crashes its worker, the next call succeeds {ours:.1f} ms later "
                f"(target 30 ms) because a replacement is forked from a template that already imported the tools; a "
                f"Jupyter kernel needs a new interpreter: {f['jupyter_over_ours']}x longer (target at least 20x).")
    return [f"**{f['title']}**", "", *rows, "", sentence, ""]


def table_timeouts(f: dict[str, Any]) -> list[str]:
    o = f["overshoot"]
    return [f"**{f['title']}**", "",
            "| answer time - timeout | p50 | p90 | p99 | max | n |", "|---|---|---|---|---|---|",
            f"| {f['timeout_s']:g} s timeout | {o['p50']:.1f} ms | {o['p90']:.1f} ms | {o['p99']:.1f} ms | "
            f"{o['max']:.1f} ms | {o['n']} |", "",
            f"**What it means:** a hung tool's caller hears `timeout` {o['p99']:.1f} ms after the deadline at worst in "
            f"99 of 100 calls (target 100 ms): the supervisor kills the worker at the deadline itself.", ""]


def table_pool(f: dict[str, Any]) -> list[str]:
    workers = f["workers"]
    head = "| executors | tool | controllers | " + " | ".join(f"{w} workers" for w in workers) + " |"
    rows = [head, "|---|---|---|" + "---|" * len(workers)]
    worst = []
    for mode, result in f["modes"].items():
        for tool, series in result["calls_per_s"].items():
            for c, rates in series.items():
                rows.append(f"| {mode} | {tool} | {c} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
        worst.append(f"{result['sleep_10ms_worst_scaling']}x with {mode}")
    sentence = (f"**What it means:** calls per second ({f['via']}; {f['method']}). For a tool that sleeps 10 ms, "
                f"throughput should grow with workers; the worst point reaches {' and '.join(worst)} of linear "
                f"scaling from one worker (target 0.85x). A no-op tool is bound by the two cores, not by workers.")
    return [f"**{f['title']}**", "", *rows, "", sentence, ""]


def table_ciayn(f: dict[str, Any]) -> list[str]:
    rows = ["| CIAYN step stage | p50 | p90 |", "|---|---|---|"]
    rows += [f"| {k} | {v['p50']:.1f} us | {v['p90']:.1f} us |" for k, v in f["stages_us"].items()]
    rows += ["", "| `parse_call` on typical model replies (scripts/benchmarks/parse.py) | chars | p50 | p90 |",
             "|---|---|---|---|"]
    rows += [f"| {k} | {v['chars']} | {v['median_us']:.1f} us | {v['p90_us']:.1f} us |"
             for k, v in f["grammar_cases"].items()]
    return [f"**{f['title']}** (`{f['text']}`)", "", *rows, "",
            f"**What it means:** the controller spends {f['step_total_us']:.0f} us per step on its own checks "
            f"({f['step_total_is']}), nothing next to a model's reply; the call grammar's own target is a p50 under "
            "50 us for a typical one-line call.", ""]


def table_memory(f: dict[str, Any]) -> list[str]:
    uss = f["worker_uss_mb"]
    return [f"**{f['title']}**", "",
            "| process | MB |", "|---|---|",
            f"| supervisor RSS | {f['supervisor_rss_mb']:.1f} |", f"| supervisor USS | {f['supervisor_uss_mb']:.1f} |",
            f"| template USS (tools imported once) | {f['template_uss_mb']} |",
            f"| per worker USS ({len(uss)} workers) | {', '.join(f'{u:.1f}' for u in uss)} |", "",
            f"**What it means:** with {f['workers']} workers after {f['after_calls']} calls, the supervisor holds "
            f"{f['supervisor_rss_mb']:.0f} MB and each extra worker costs about {max(uss, default=0):.1f} MB of its "
            f"own, since workers are forked from the template and share its pages.", ""]


def table_broker(f: dict[str, Any]) -> list[str]:
    o, sc = f["overhead"], f["scaling"]
    rows = ["| per-call overhead (sequential no-op calls, --reuse-workers) | median | p90 |", "|---|---|---|"]
    rows += [f"| {k} | {_fmt_us(v)} | {_fmt_us(o['p90_us'][k])} |" for k, v in o["median_us"].items()]
    rows += ["", "| " + " | ".join(f"{k}" for k in sc if isinstance(sc[k], list)) + " |"]
    lists = [v for v in sc.values() if isinstance(v, list)]
    rows += ["|" + "---|" * len(lists)]
    rows += ["| " + " | ".join(str(v[i]) for v in lists) + " |" for i in range(min(len(v) for v in lists))]
    ratio = o.get("broker_tcp_over_direct_ipc")
    return [f"**{f['title']}**", "", *rows, "",
            f"**What it means:** through the broker over tcp a call costs {ratio}x a direct ipc call (issue 12's "
            "target: at most 2x); the scaling rows are issue 12's own run of a 10 ms tool through the broker from one "
            "client.",
            ""]


def table_layers(f: dict[str, Any]) -> list[str]:
    rows = ["| executor (no-op call, plain DEALER) | p50 | p99 |", "|---|---|---|"]
    rows += [f"| {k} | {_fmt_us(v['p50'])} | {_fmt_us(v['p99'])} |" for k, v in f["latency"].items()]
    rows += [f"| {k} | could not start: {v} | |" for k, v in f["could_not_start"].items()]
    rows += ["", "| layer | cost per call (p50 difference) |", "|---|---|"]
    rows += [f"| {k} | {_fmt_us(v) if v is not None else 'n/a'} |" for k, v in f["cost_us"].items()]
    layers = f.get("entries", {}).get("per_layer", {})
    if layers.get("status") == MEASURED and layers.get("layers_ms"):
        rows += ["", "| layer, while a hardened worker is prepared (scripts/benchmarks/hardened.py) | ms (p50) |",
                 "|---|---|"]
        rows += [f"| {k} | {v:.2f} |" for k, v in layers["layers_ms"].items()]
        rows += [f"| whole preparation: hardened / default | {layers['prepare_hardened_ms']:.1f} / "
                 f"{layers['prepare_default_ms']:.1f} |"]
        note = "each layer's own cost is timed inside the worker as it is prepared"
    else:
        note = f"per-layer costs: {layers.get('status')} {layers.get('reason', '')}".strip()
    return [f"**{f['title']}**", "", *rows, "",
            f"**What it means:** what hardening adds to a call, measured side by side; {note}.", ""]


def update_readme(readme: Path, text: str) -> bool:
    """Replace what is between the markers of ``readme`` (bench-results/README.md); False (nothing
    written) when the markers are missing."""
    content = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(content):
        return False
    readme.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", content, count=1))
    return True

