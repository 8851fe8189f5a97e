"""``ciayn-executor status ENDPOINT``: what a broker (or a single executor) is doing.

Sends one ``status`` message and prints the ``report``: the executors, their tools and capacity,
calls running and queued, calls served, worker restarts and per-tool latency; ``--json`` prints the
report as JSON (the fields of ``protocol.Report``) for scripts. An endpoint that does not answer
within the timeout is an error (exit 1), with the same hint about CurveZMQ keys a client gives.
"""

from __future__ import annotations

import json
import time
from typing import Any

import zmq

from executor.metrics import quantile
from protocol import ProtocolError, Report, Status, decode, encode
from protocol.errors import CiaynError
from protocol.wire import bound_socket, recv_message

DEFAULT_TIMEOUT = 5.0


class StatusError(CiaynError):
    """No report: the endpoint did not answer, or answered something else."""


def fetch(endpoint: str, *, timeout: float = DEFAULT_TIMEOUT, curve_server_key: bytes | None = None,
          curve_keys: tuple[bytes, bytes] | None = None) -> Report:
    """Ask ``endpoint`` for its report."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        bound_socket(sock)
        if curve_server_key is not None:
            from protocol.curve import secure_client

            secure_client(sock, curve_server_key, curve_keys)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise StatusError(f"cannot use endpoint {endpoint!r}: {e}") from None
        sock.send_multipart(encode(Status()))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            frames = recv_message(sock)
            if frames is None:
                continue
            try:
                msg = decode(frames)
            except ProtocolError as e:
                raise StatusError(f"{endpoint} answered with a malformed message: {e}") from None
            if isinstance(msg, Report):
                return msg
            if getattr(msg, "error", None) is not None:
                raise StatusError(f"{endpoint} refused the status request: {msg.error.message}")  # type: ignore[union-attr]
        hint = "is a broker or an executor running there?"
        if endpoint.startswith("tcp://"):
            hint += " With CurveZMQ, a wrong server key or a client key it does not admit also gets no answer."
        raise StatusError(f"no answer from {endpoint} within {timeout:g} s; {hint}")
    finally:
        ctx.destroy(0)


def render(report: Report) -> str:
    """The report for a person: totals, one line per executor, one line per tool."""
    lines = [
        f"{report.role} {report.id}  up {_duration(report.uptime_s)}  capacity {report.capacity}  "
        f"busy {report.busy}  queued {report.queued}  served {report.served}  "
        f"worker restarts {report.worker_restarts}  max timeout {report.max_timeout_s:g}s",
        "",
        f"{'EXECUTOR':<14} {'CAPACITY':>8} {'BUSY':>5} {'QUEUED':>6} {'SERVED':>8} {'RESTARTS':>8} {'IDLE':>6}  TOOLS",
    ]
    for e in report.executors:
        lines.append(f"{e.executor:<14} {e.capacity:>8} {e.busy:>5} {e.queued:>6} {e.served:>8} "
                     f"{e.worker_restarts:>8} {e.idle_s:>5.1f}s  {', '.join(e.tools)}")
    if not report.executors:
        lines.append("(no executors connected)")
    lines += ["", f"{'TOOL':<24} {'CALLS':>8} {'ERRORS':>7} {'MEAN':>9} {'P50<=':>8} {'P95<=':>8}"]
    for t in report.tools:
        mean = t.wall_s_sum / t.calls if t.calls else 0.0
        lines.append(f"{t.name:<24} {t.calls:>8} {t.errors:>7} {_ms(mean):>9} {_ms(quantile(t, 0.5)):>8} "
                     f"{_ms(quantile(t, 0.95)):>8}")
    if not report.tools:
        lines.append("(no calls answered yet)")
    return "\n".join(lines)


def as_json(report: Report) -> str:
    return json.dumps(report.model_dump(mode="json"), indent=2)


def _ms(seconds: float) -> str:
    return "inf" if seconds == float("inf") else f"{seconds * 1000:.1f}ms"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
