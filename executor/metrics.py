"""What an executor or a broker has done so far, for ``ciayn-executor status`` and for Prometheus.

``CallStats`` counts answered calls per tool (calls, errors, wall-time histogram) and worker
restarts; the owner's event loop feeds it and builds a ``protocol.Report`` from it. ``MetricsServer``
exposes the same report as Prometheus metrics on ``--metrics-port``: the loop publishes a fresh
report about once a second (``publish``), and the HTTP thread only ever reads the latest one, so it
never touches the loop's state.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from protocol import LATENCY_BUCKETS, Report, Result, ToolStats

log = logging.getLogger("ciayn-executor")

MAX_TOOLS = 1024  # tool names counted; a pool with more is lumped into "other"
PUBLISH_EVERY = 1.0  # seconds between reports handed to the metrics thread


@dataclass
class _Tool:
    calls: int = 0
    errors: int = 0
    wall_s_sum: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))


class CallStats:
    """Answered calls by tool. Only feed it calls of tools that exist (a client chooses the name of
    an unknown tool, and must not choose our label set)."""

    def __init__(self) -> None:
        self.tools: dict[str, _Tool] = {}
        self.served = 0
        self.worker_restarts = 0

    def observe(self, tool: str, result: Result, wall_s: float) -> None:
        self.served += 1
        if result.worker is not None and result.worker.restarted:
            self.worker_restarts += 1
        name = tool if tool in self.tools or len(self.tools) < MAX_TOOLS else "other"
        entry = self.tools.setdefault(name, _Tool())
        entry.calls += 1
        entry.errors += not result.ok
        entry.wall_s_sum += wall_s
        entry.counts[bisect.bisect_left(LATENCY_BUCKETS, wall_s)] += 1

    def tool_stats(self) -> list[ToolStats]:
        out = []
        for name, t in sorted(self.tools.items()):
            cumulative, running = [], 0
            for n in t.counts:
                running += n
                cumulative.append(running)
            out.append(ToolStats(name=name, calls=t.calls, errors=t.errors, wall_s_sum=t.wall_s_sum,
                                 buckets=cumulative))
        return out


def quantile(stats: ToolStats, q: float) -> float:
    """An upper bound of the ``q`` quantile of a tool's wall time, from its histogram buckets."""
    if not stats.calls:
        return 0.0
    rank = q * stats.calls
    for bound, count in zip(LATENCY_BUCKETS, stats.buckets, strict=False):
        if count >= rank:
            return bound
    return float("inf")


def parse_metrics_address(text: str) -> tuple[str, int]:
    """``PORT`` (on 127.0.0.1) or ``HOST:PORT``; raise ValueError with a readable message."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"metrics address {text!r} must be PORT or HOST:PORT") from None
    if not 0 < port < 65536:
        raise ValueError(f"metrics port {port} is not in 1..65535")
    return host, port


class MetricsServer:
    """Prometheus metrics on an HTTP port, from the latest published report."""

    def __init__(self, address: str) -> None:
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        host, port = parse_metrics_address(address)
        self._report: Report | None = None
        self._lock = threading.Lock()
        self.next_publish = 0.0
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {e}") from None
        log.info("Prometheus metrics on http://%s:%d/metrics", host, port)

    def due(self, now: float) -> bool:
        return now >= self.next_publish

    def publish(self, report: Report, now: float | None = None) -> None:
        with self._lock:
            self._report = report
        self.next_publish = (time.monotonic() if now is None else now) + PUBLISH_EVERY

    def latest(self) -> Report | None:
        with self._lock:
            return self._report

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Collector:
    def __init__(self, owner: MetricsServer) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        report = self.owner.latest()
        if report is None:
            return
        for name, text, value in (
            ("ciayn_capacity", "Calls the pool (or executor) can run at once", report.capacity),
            ("ciayn_busy", "Calls running now", report.busy),
            ("ciayn_queued", "Calls waiting for a worker", report.queued),
            ("ciayn_executors", "Executors connected (1 for a single executor)", len(report.executors)),
            ("ciayn_uptime_seconds", "Seconds since start", report.uptime_s),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        yield CounterMetricFamily("ciayn_calls_served", "Calls answered", value=report.served)
        yield CounterMetricFamily("ciayn_worker_restarts", "Workers replaced after a call killed theirs",
                                  value=report.worker_restarts)
        calls = CounterMetricFamily("ciayn_tool_calls", "Calls answered, by tool", labels=["tool"])
        errors = CounterMetricFamily("ciayn_tool_errors", "Calls answered with an error, by tool", labels=["tool"])
        latency = HistogramMetricFamily("ciayn_tool_call_seconds", "Wall time of calls, by tool", labels=["tool"])
        for t in report.tools:
            calls.add_metric([t.name], t.calls)
            errors.add_metric([t.name], t.errors)
            buckets = [(_le(b), float(c)) for b, c in zip(LATENCY_BUCKETS, t.buckets, strict=False)]
            latency.add_metric([t.name], buckets, t.wall_s_sum)
        yield calls
        yield errors
        yield latency
        per = GaugeMetricFamily("ciayn_executor_busy", "Calls running, by executor", labels=["executor"])
        cap = GaugeMetricFamily("ciayn_executor_capacity", "Workers, by executor", labels=["executor"])
        for e in report.executors:
            per.add_metric([e.executor], e.busy)
            cap.add_metric([e.executor], e.capacity)
        yield per
        yield cap


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
