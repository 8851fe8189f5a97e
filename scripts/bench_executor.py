"""Executor speed, measured side by side in one run (issue 3's targets):

1. round trip of a no-op call through the executor over ipc, against a bare pyzmq DEALER/ROUTER
   msgpack echo between two processes (target: at most 3x the echo);
2. how soon a replacement worker is ready after a crash (target: within 30 ms);
3. how soon a hung call is answered ``timeout`` after its deadline (target: timeout + 100 ms).

Usage: .venv/bin/python scripts/bench_executor.py [--calls N] [--out bench-results/executor.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller import LocalExecutor  # noqa: E402
from protocol import Call, Ping, decode, encode  # noqa: E402

FAULTY = str(ROOT / "tests" / "tools" / "faulty.py")


def _echo_server(endpoint: str, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        ident, body = sock.recv_multipart()
        msg = msgpack.unpackb(body)
        if msg == "stop":
            break
        sock.send_multipart([ident, msgpack.packb(msg)])


def bench_echo(endpoint: str, n: int) -> list[float]:
    ready = multiprocessing.Event()
    proc = multiprocessing.Process(target=_echo_server, args=(endpoint, ready), daemon=True)
    proc.start()
    ready.wait(10)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    body = {"tool": "noop", "args": [], "kwargs": {}, "id": "x"}
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(msgpack.packb(body))
        msgpack.unpackb(sock.recv())
        times.append(time.perf_counter() - t0)
    sock.send(msgpack.packb("stop"))
    proc.join(5)
    sock.close(0)
    return times


def bench_raw_executor(endpoint: str, n: int) -> list[float]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart(encode(Ping()))
    sock.recv_multipart()
    times = []
    for i in range(n):
        call = Call(id=f"raw{i}", tool="noop")
        t0 = time.perf_counter()
        sock.send_multipart(encode(call))
        result = decode(sock.recv_multipart())
        times.append(time.perf_counter() - t0)
        assert getattr(result, "ok", False), result
    sock.close(0)
    return times


def summarize(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(len(ordered) * 0.9)] * 1e6,
        "min_us": ordered[0] * 1e6,
        "n": len(ordered),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000, help="round trips per measurement (default 5000)")
    parser.add_argument("--rounds", type=int, default=20, help="crash and hang rounds (default 20)")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "executor.json"))
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="ciayn-bench-")
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}

    print(f"bare pyzmq DEALER/ROUTER msgpack echo, {args.calls} round trips ...", file=sys.stderr)
    echo = bench_echo(f"ipc://{tmp}/echo.sock", args.calls)
    with LocalExecutor(tools=[FAULTY], timeout=1, log_level="warning") as client:
        endpoint = client.endpoint
        print(f"no-op call through the executor (raw DEALER), {args.calls} round trips ...", file=sys.stderr)
        raw = bench_raw_executor(endpoint, args.calls)
        print(f"no-op call through ExecutorClient, {args.calls} round trips ...", file=sys.stderr)
        via_client = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            r = client.call(Call(tool="noop"))
            via_client.append(time.perf_counter() - t0)
            assert r.ok, r
        # The echo again, interleaved, so load drift shows.
        echo2 = bench_echo(f"ipc://{tmp}/echo2.sock", args.calls)

        print(f"crash -> replacement ready, {args.rounds} rounds ...", file=sys.stderr)
        replacement = []
        for _ in range(args.rounds):
            crash = client.call(Call(tool="segfault"))
            assert crash.error is not None and crash.error.kind == "crashed", crash
            t0 = time.perf_counter()
            ok = client.call(Call(tool="noop"))
            replacement.append(time.perf_counter() - t0)
            assert ok.ok and ok.worker is not None and ok.worker.incarnation > crash.worker.incarnation  # type: ignore[union-attr]

        print(f"hung call -> timeout answer, {args.rounds // 4 or 1} rounds of a 1 s timeout ...", file=sys.stderr)
        overshoot = []
        for _ in range(max(1, args.rounds // 4)):
            t0 = time.perf_counter()
            hung = client.call(Call(tool="sleep_forever"))
            overshoot.append(time.perf_counter() - t0 - 1.0)
            assert hung.error is not None and hung.error.kind == "timeout", hung

    echo_all = echo + echo2
    results["echo"] = summarize(echo_all)
    results["executor_raw"] = summarize(raw)
    results["executor_client"] = summarize(via_client)
    results["ratio_raw_vs_echo"] = results["executor_raw"]["median_us"] / results["echo"]["median_us"]
    results["ratio_client_vs_echo"] = results["executor_client"]["median_us"] / results["echo"]["median_us"]
    results["replacement_after_crash_ms"] = {k: v / 1000 for k, v in summarize(replacement).items() if k != "n"}
    results["timeout_overshoot_ms"] = {k: v / 1000 for k, v in summarize(overshoot).items() if k != "n"}
    results["targets"] = {
        "raw_ratio_at_most_3x": results["ratio_raw_vs_echo"] <= 3.0,
        "replacement_within_30ms": results["replacement_after_crash_ms"]["median_us"] <= 30.0,
        "timeout_within_100ms": max(overshoot) * 1000 <= 100.0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("| measurement | median | p90 |")
    print("|---|---|---|")
    print(f"| bare pyzmq echo | {results['echo']['median_us']:.0f} us | {results['echo']['p90_us']:.0f} us |")
    labels = (("executor_raw", "no-op via executor (DEALER)"), ("executor_client", "no-op via ExecutorClient"))
    for key, label in labels:
        print(f"| {label} | {results[key]['median_us']:.0f} us | {results[key]['p90_us']:.0f} us |")
    rep = results["replacement_after_crash_ms"]
    ovs = results["timeout_overshoot_ms"]
    print(f"| crash -> next call answered | {rep['median_us']:.1f} ms | {rep['p90_us']:.1f} ms |")
    print(f"| timeout answer past the deadline | {ovs['median_us']:.1f} ms | {ovs['p90_us']:.1f} ms |")
    ratio, client_ratio = results["ratio_raw_vs_echo"], results["ratio_client_vs_echo"]
    print(f"\nratio executor/echo: {ratio:.2f}x (client: {client_ratio:.2f}x)")
    print(f"targets: {results['targets']}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
