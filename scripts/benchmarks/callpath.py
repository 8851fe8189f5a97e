"""Where a no-op call's time goes, instrumented from outside the executor (nothing in executor/ or
controller/ is patched):

- **timestamps**: the ``stamp`` tool returns CLOCK_MONOTONIC as the tool runs; a plain DEALER
  client takes its own before encoding, after sending, on receipt and after decoding; so each round
  trip splits into client encode+send / request path (client -> tool) / reply path (tool -> client)
  / client decode, and ``ExecutorClient``'s extra cost (its loop and future) shows as
  the difference to the plain DEALER on each path;
- **CPU per call** of every process and thread on the path (client, supervisor, its ZeroMQ I/O
  thread, the worker), from ``/proc/PID/task/TID/schedstat`` (nanoseconds run, times scheduled)
  around blocks of calls;
- **the floors of both hops**: a bare ZeroMQ ipc echo (client <-> supervisor) and a bare
  socketpair echo with the worker channel's framing (supervisor <-> worker), between two processes;
- **the codec on each hop**, timed in-process on the real frames of a real call.

All of it runs in interleaved rounds in one run."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack

from protocol import Call, ToolSpec, decode, encode

from . import report, tools
from .archtemplate import HEADER
from .contestants import CHANNEL_REQUEST, PAUSE_S, ChannelEcho, ClientCalls, Dealer, Paced, RawDealer, ZmqEcho
from .executors import direct
from .parse import measure
from .record import log, measured, summarize
from .registry import Context, figure

WORKER_REPLY: dict[str, Any] = {"ok": True, "value": None, "wall_s": 1.2e-6, "cpu_s": 0.0, "peak_rss_kb": 31337,
                                "signals": [], "seq": 1}


def _schedstat(pid: int) -> dict[str, list[int]]:
    """{thread name: [ns on CPU, times scheduled]} summed over the threads of ``pid``."""
    out: dict[str, list[int]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run_ns, _wait, slices = (int(x) for x in f.read().split()[:3])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError):
                continue
            name = "main" if tid == str(pid) else name
            acc = out.setdefault(name, [0, 0])
            acc[0] += run_ns
            acc[1] += slices
    return out


_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def _reaped_children_ns(pid: int) -> int:
    """CPU of the children ``pid`` has reaped (cutime + cstime): the workers of a template that
    forks one per call, whose own counters vanish with them. Clock-tick resolution."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int((int(fields[13]) + int(fields[14])) * _TICK_NS)
    except (OSError, IndexError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc/PID/task/*/children (no scan of every process)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    return pids


class CpuMeter:
    """CPU time and scheduling count per call of the processes on a call's path: this client, the
    supervisor (each thread), the template and its workers (live ones by thread; dead ones through
    the template's reaped-children counters)."""

    def __init__(self, supervisor: int) -> None:
        """``supervisor``: the pid of the executor's supervisor (or of ``archfloor``'s)."""
        self.roles: dict[str, int] = {"client (this process)": os.getpid(), "supervisor": supervisor}
        self.template = 0
        for child in _children(supervisor):
            if _children(child):  # the template: it forks the workers
                self.template = self.roles["template"] = child
        self.total: dict[str, list[int]] = {}
        self.calls = 0

    def snapshot(self, before: bool) -> dict[str, dict[str, list[int]]]:
        """All counters; this process's own are read last before a block and first after it, so
        that reading the others is not counted as the client's CPU."""
        me = "client (this process)"
        snap = {} if before else {me: _schedstat(os.getpid())}
        snap |= {role: _schedstat(pid) for role, pid in self.roles.items() if role != me}
        if self.template:
            for pid in _children(self.template):
                snap[f"worker pid {pid}"] = _schedstat(pid)
            snap["workers, exited (template's reaped children)"] = {"all": [_reaped_children_ns(self.template), 0]}
        if before:
            snap[me] = _schedstat(os.getpid())
        return snap

    def add(self, before: dict[str, dict[str, list[int]]], after: dict[str, dict[str, list[int]]], calls: int) -> None:
        self.calls += calls
        for role, threads in after.items():
            was_role = before.get(role, {})
            label = "worker (live)" if role.startswith("worker pid") else role
            for thread, (ns, slices) in threads.items():
                was = was_role.get(thread, [0, 0])
                acc = self.total.setdefault(f"{label}: {thread}", [0, 0])
                acc[0] += ns - was[0]
                acc[1] += slices - was[1]

    def per_call(self) -> dict[str, dict[str, float]]:
        n = max(1, self.calls)
        return {name: {"cpu_us": round(ns / n / 1000, 2), "scheduled": round(slices / n, 2)}
                for name, (ns, slices) in sorted(self.total.items()) if ns > 0}


def codec_steps(dealer: Dealer, repeat: int) -> dict[str, dict[str, Any]]:
    """The codec and bookkeeping steps of each hop, timed in this process on a real call's frames."""
    request, reply = dealer.last_frames()
    result = decode(reply)
    call = decode(request)
    assert isinstance(call, Call)
    spec = ToolSpec.from_function(tools.noop)
    channel_request = HEADER.pack(0) + msgpack.packb(CHANNEL_REQUEST, use_bin_type=True)
    channel_reply = msgpack.packb(WORKER_REPLY, use_bin_type=True)
    clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)

    def reset_peak_rss() -> None:
        os.write(clear_refs, b"5")

    def rusage() -> None:
        resource.getrusage(resource.RUSAGE_SELF)
        resource.getrusage(resource.RUSAGE_CHILDREN)
        resource.getrusage(resource.RUSAGE_SELF)

    steps: dict[str, tuple[str, Callable[[], Any]]] = {
        "client: encode the call": ("client", lambda: encode(Call(id=call.id, tool="noop"))),
        "supervisor: decode the call": ("supervisor", lambda: decode(request)),
        "supervisor: bind the arguments to the spec": ("supervisor", lambda: spec.bind([], {})),
        "supervisor: pack the request for the worker": ("supervisor", lambda: HEADER.pack(40) + msgpack.packb(
            CHANNEL_REQUEST, use_bin_type=True)),
        "worker: unpack the request": ("worker", lambda: msgpack.unpackb(channel_request[HEADER.size:], raw=False)),
        "worker: reset peak RSS (write /proc/self/clear_refs, in a process of this one's size)": (
            "worker", reset_peak_rss),
        "worker: getrusage x3 (CPU time and peak memory of the call)": ("worker", rusage),
        "worker: pack the reply": ("worker", lambda: HEADER.pack(60) + msgpack.packb(WORKER_REPLY, use_bin_type=True)),
        "supervisor: unpack the reply": ("supervisor", lambda: msgpack.unpackb(channel_reply, raw=False)),
        "supervisor: encode the result": ("supervisor", lambda: encode(result)),
        "client: decode the result": ("client", lambda: decode(reply)),
    }
    out = {}
    for name, (where, fn) in steps.items():
        timing = measure(fn, repeat)
        out[name] = {"where": where, "us": timing["median_us"]}
    os.close(clear_refs)
    return out


@figure(
    "call_path",
    "where a no-op call's time goes: timestamps per hop, CPU per process, the codec, both hops' floors",
    order=30, chart=report.chart_call_path, table=report.table_call_path,
)
def call_path(context: Context) -> dict[str, Any]:
    """The breakdown is taken on the leanest path that exists (``--reuse-workers`` once built: the
    call path without a fork per call); where the default forks a fresh worker per call, that
    default is stamped alongside and the difference is the cost of a fresh worker."""
    features, sizes, tmp = context.features, context.sizes, context.tmp
    lean = ["--reuse-workers"] if features.reuse_workers else []
    with contextlib.ExitStack() as stack:
        echo = ZmqEcho(tmp)
        stack.callback(echo.close)
        chan = ChannelEcho()
        stack.callback(chan.close)
        running = stack.enter_context(direct(workers=1, extra=lean))
        dealer = Dealer(running.endpoint, "plain DEALER")
        stack.callback(dealer.close)
        client = ClientCalls(running.client, "ExecutorClient")
        fresh_dealer: Dealer | None = None
        if lean:
            fresh = stack.enter_context(direct(workers=1))
            fresh_dealer = Dealer(fresh.endpoint, "plain DEALER, default flags")
            stack.callback(fresh_dealer.close)
            fresh_meter = CpuMeter(fresh.roots[0])
        meter = CpuMeter(running.roots[0])
        floor: list[float] = []
        channel: list[float] = []
        stamped: list[tuple[int, int, int, int, int]] = []
        fresh_stamped: list[tuple[int, int, int, int, int]] = []
        client_stamped: list[tuple[int, int, int]] = []
        paced_stamped: list[tuple[int, int, int, int, int]] = []  # calls PAUSE_S apart, as an agent's come
        paced_floor: list[float] = []

        def n_for(block: Any) -> int:
            block(10)
            return max(2, int(sizes.path_block_s / max(1e-6, statistics.fmean(block(10)))))

        n = n_for(dealer.block)
        n_echo = min(n * 4, 2000)
        n_fresh = n_for(fresh_dealer.block) if fresh_dealer else 0
        n_paced = max(2, int(sizes.path_block_s / PAUSE_S))
        log(f"call path ({'--reuse-workers' if lean else 'default flags'}): {sizes.path_rounds} interleaved rounds "
            f"of {n} calls per contestant")
        echo_cpu = [0, 0]  # the echo server's own CPU for the floor's round trips, and how many
        for _ in range(sizes.path_rounds):
            echo_before = sum(ns for ns, _ in _schedstat(echo.pid).values())
            floor += echo.block(n_echo)
            echo_cpu[0] += sum(ns for ns, _ in _schedstat(echo.pid).values()) - echo_before
            echo_cpu[1] += n_echo
            channel += chan.block(n_echo)
            before = meter.snapshot(before=True)
            stamped += dealer.stamped(n)
            meter.add(before, meter.snapshot(before=False), n)
            client_stamped += client.stamped(n)
            paced_floor += Paced(echo).block(n_paced)
            for _ in range(n_paced):
                time.sleep(PAUSE_S)
                paced_stamped += dealer.stamped(1)
            if fresh_dealer is not None:
                before = fresh_meter.snapshot(before=True)
                fresh_stamped += fresh_dealer.stamped(n_fresh)
                fresh_meter.add(before, fresh_meter.snapshot(before=False), n_fresh)
        steps = codec_steps(dealer, sizes.microbench_repeat)
        fresh_cpu = fresh_meter.per_call() if fresh_dealer is not None else None

    def p50_us(values: list[int]) -> float:
        return round(statistics.median(values) / 1000, 2)

    def split_of(rows: list[tuple[int, int, int, int, int]]) -> dict[str, float]:
        return {
            "client: encode + send": p50_us([t1 - t0 for t0, t1, _tt, _t2, _t3 in rows]),
            "request path: sent -> tool runs": p50_us([tt - t1 for _t0, t1, tt, _t2, _t3 in rows]),
            "reply path: tool ran -> client has the frames": p50_us([t2 - tt for _t0, _t1, tt, t2, _t3 in rows]),
            "client: decode": p50_us([t3 - t2 for _t0, _t1, _tt, t2, t3 in rows]),
            "round trip": p50_us([t3 - t0 for t0, _t1, _tt, _t2, t3 in rows]),
        }

    dealer_total = p50_us([t3 - t0 for t0, _t1, _tt, _t2, t3 in stamped])
    split = split_of(stamped)
    client_request = p50_us([tt - t0 for t0, tt, _t2 in client_stamped])
    client_reply = p50_us([t2 - tt for _t0, tt, t2 in client_stamped])
    dealer_request = p50_us([tt - t0 for t0, _t1, tt, _t2, _t3 in stamped])
    dealer_reply = p50_us([t3 - tt for _t0, _t1, tt, _t2, t3 in stamped])
    floor_us = summarize(floor)["p50"]
    channel_us = summarize(channel)["p50"]
    cpu = meter.per_call()

    def step(name: str) -> float:
        return float(steps[name]["us"])

    sup_codec = sum(float(s["us"]) for s in steps.values() if s["where"] == "supervisor")
    sup_main = cpu.get("supervisor: main", {}).get("cpu_us", 0.0)
    cpu_sum = round(sum(c["cpu_us"] for c in cpu.values()), 2)
    fresh_worker: dict[str, Any] | None = None
    if fresh_stamped:
        fresh_request = p50_us([tt - t0 for t0, _t1, tt, _t2, _t3 in fresh_stamped])
        fresh_reply = p50_us([t3 - tt for _t0, _t1, tt, _t2, t3 in fresh_stamped])
        fresh_worker = {
            "round_trip_us": p50_us([t3 - t0 for t0, _t1, _tt, _t2, t3 in fresh_stamped]),
            "request_path_us": fresh_request,
            "reply_path_us": fresh_reply,
            "extra_over_reuse_workers_us": round(fresh_request + fresh_reply - dealer_request - dealer_reply, 2),
            "cpu_per_call": fresh_cpu,
            "cpu_per_call_total_us": round(sum(c["cpu_us"] for c in (fresh_cpu or {}).values()), 2),
        }
    # A one-way hop is taken as half its floor's round trip.
    request_known = {
        "ZeroMQ hop client -> supervisor (half the echo floor)": floor_us / 2,
        "supervisor: decode + bind + pack (codec)": step("supervisor: decode the call")
        + step("supervisor: bind the arguments to the spec") + step("supervisor: pack the request for the worker"),
        "channel hop supervisor -> worker (half the socketpair floor)": channel_us / 2,
        "worker: unpack the request (codec)": step("worker: unpack the request"),
    }
    reply_known = {
        "worker: pack the reply (codec)": step("worker: pack the reply"),
        "channel hop worker -> supervisor (half the socketpair floor)": channel_us / 2,
        "supervisor: unpack + encode result (codec)": step("supervisor: unpack the reply")
        + step("supervisor: encode the result"),
        "ZeroMQ hop supervisor -> client (half the echo floor)": floor_us / 2,
    }
    request_path = split["request path: sent -> tool runs"]
    reply_path = split["reply path: tool ran -> client has the frames"]
    hops = {
        "client: encode + send": split["client: encode + send"],
        **{k: round(v, 2) for k, v in request_known.items()},
        "request path: everything else (wake-ups, supervisor loop, worker's per-call set-up)":
            round(request_path - sum(request_known.values()), 2),
        **{k: round(v, 2) for k, v in reply_known.items()},
        "reply path: everything else (worker's per-call accounting, supervisor loop, wake-ups)":
            round(reply_path - sum(reply_known.values()), 2),
        "client: decode": split["client: decode"],
    }
    return measured(
        title="Where a no-op call's time goes (per-hop breakdown)",
        method=("plain DEALER calls of the `stamp` tool (returns CLOCK_MONOTONIC in the worker) interleaved with both "
                "floors and ExecutorClient calls; CPU from "
                "/proc/PID/task/TID/schedstat around the DEALER blocks; codec steps timed in-process on a real "
                "call's frames; one-way hops taken as half their floor's round trip"),
        calls=len(stamped),
        round_trip_us={
            "plain DEALER (p50)": dealer_total,
            "ExecutorClient (p50)": round(client_request + client_reply, 2),
            "floor: bare ZeroMQ echo (p50)": floor_us,
            "floor: bare socketpair echo, worker channel framing (p50)": channel_us,
        },
        ratio_dealer_to_floor=round(dealer_total / floor_us, 2) if floor_us else None,
        split_us=split,
        paced={"pause_s": PAUSE_S, "calls": len(paced_stamped), "split_us": split_of(paced_stamped),
               "floor_echo_p50_us": summarize(paced_floor)["p50"]},
        executor_client_us={
            "request: call() -> tool runs": client_request,
            "reply: tool ran -> call() returns": client_reply,
            "extra over plain DEALER, request side (its loop, future)":
                round(client_request - dealer_request, 2),
            "extra over plain DEALER, reply side (its loop, future)": round(client_reply - dealer_reply, 2),
        },
        hops_us=hops,
        codec_us=steps,
        cpu_per_call=cpu,
        cpu_per_call_total_us=cpu_sum,
        supervisor_main_thread_beyond_codec_us=round(sup_main - sup_codec, 2),
        floor_echo_server_cpu_per_round_trip_us=round(echo_cpu[0] / max(1, echo_cpu[1]) / 1000, 2),
        fresh_worker_per_call=fresh_worker,
        path_flags=" ".join(lean) or "default flags",
    )


# name: (what-if patches, LocalExecutor options, on the lean path (--reuse-workers) or the default flags)
CUTS: dict[str, tuple[list[str], dict[str, Any], bool]] = {
    "as shipped": ([], {}, True),
    "no spin after dispatch (supervisor)": (["nospin"], {}, True),
    "no bookkeeping (supervisor; unsafe: its bound)": (["nobookkeeping"], {}, True),
    "both": (["nospin", "nobookkeeping"], {}, True),
    "no codec of ours in the client (unsafe: its bound)": ([], {"client": RawDealer}, True),
    "that, and a hand-written codec in the supervisor (its bound)": (["handcodec"], {"client": RawDealer}, True),
    "all three bounds: no client codec, hand-written codec, no bookkeeping": (
        ["handcodec", "nobookkeeping"], {"client": RawDealer}, True),
    "default flags (a fresh worker per call), 1 worker": ([], {}, False),
    "default flags, --workers 2 (a spare prewarmed worker for sequential calls)": ([], {"workers": 2}, False),
    "default flags, --no-cgroups (no control groups per worker)": ([], {"no_cgroups": True}, False),
}


@figure(
    "call_path_cuts",
    "what candidate cuts of the call path would buy (what-if runs; executor/ unchanged)",
    order=50, chart=report.chart_cuts, table=report.table_cuts,
)
def call_path_cuts(context: Context) -> dict[str, Any]:
    """What each candidate cut of the call path would buy: the executor as shipped against what-if
    variants (whatif.py patches it in memory, nothing in executor/ changes), each with the
    floor, in interleaved rounds; p50, ratio to the floor and CPU per call over all processes."""
    features, sizes, tmp = context.features, context.sizes, context.tmp
    lean = ["--reuse-workers"] if features.reuse_workers else []
    entries: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        echo = ZmqEcho(tmp)
        stack.callback(echo.close)
        variants: dict[str, tuple[Dealer, CpuMeter, int]] = {}
        for name, (patches, options, on_lean) in CUTS.items():
            if on_lean is False and not lean:
                continue  # the default flags are the lean path already
            try:
                flags = lean if on_lean else []
                options = dict(options)
                client = options.pop("client", Dealer)
                running = stack.enter_context(direct(extra=flags, patches=patches, **{"workers": 1, **options}))
                dealer = client(running.endpoint, name)
                stack.callback(dealer.close)
                dealer.block(20)
                n = max(2, int(sizes.path_block_s / max(1e-6, statistics.fmean(dealer.block(10)))))
                variants[name] = (dealer, CpuMeter(running.roots[0]), n)
            except Exception as e:  # a patch whose target moved: recorded, not measured wrong
                entries[name] = {"status": "failed", "reason": " ".join(f"{type(e).__name__}: {e}".split())[-400:]}
        n_echo = 200
        times: dict[str, list[float]] = {name: [] for name in variants}
        ratios: dict[str, list[float]] = {name: [] for name in variants}
        log(f"call path cuts ({' '.join(lean) or 'default flags'}): {sizes.path_rounds} interleaved rounds of "
            f"{', '.join(variants)}")
        for _ in range(sizes.path_rounds):
            floor_block = echo.block(n_echo)
            for name, (dealer, meter, n) in variants.items():
                before = meter.snapshot(before=True)
                block = dealer.block(n)
                meter.add(before, meter.snapshot(before=False), n)
                times[name] += block
                ratios[name].append(statistics.median(block) / statistics.median(floor_block))
    for name, (_dealer, meter, _n) in variants.items():
        cpu = meter.per_call()
        entries[name] = {"status": "measured", "latency": summarize(times[name]),
                         "ratio_to_floor": round(statistics.median(ratios[name]), 2),
                         "cpu_per_call_us": round(sum(c["cpu_us"] for c in cpu.values()), 1),
                         "supervisor_cpu_per_call_us": round(sum(v["cpu_us"] for k, v in cpu.items()
                                                                 if k.startswith("supervisor")), 1),
                         "worker_cpu_per_call_us": round(sum(v["cpu_us"] for k, v in cpu.items()
                                                             if k.startswith("worker")), 1)}
    return measured(
        title="What candidate cuts of the call path would buy (what-if runs)",
        method=("plain DEALER no-op calls against the executor as shipped and against variants patched in memory by "
                "scripts/benchmarks/whatif.py (executor/ is not changed), interleaved with the floor; "
                "ratio_to_floor is the median over rounds"),
        path_flags=" ".join(lean) or "default flags",
        entries=entries,
    )
