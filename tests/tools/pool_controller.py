"""One controller of the pool load test, as its own process:

    python pool_controller.py ENDPOINT NAME CALLS LOG OUT [IN_FLIGHT] [--curve-server-key F --curve-key F]

It sends CALLS calls through one ``ExecutorClient`` (every fifth to the idempotent ``lookup``, the
others to ``work``), at most IN_FLIGHT at a time, each with a tag naming this controller and the call,
and writes one JSON line per answer to OUT: the tag it asked for, the id it sent, the id and tag that
came back, ok and the error kind."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import uuid
from concurrent.futures import Future

from controller import ExecutorClient
from protocol import Call, Result
from protocol.curve import load_pair, load_public


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("endpoint", "name", "calls", "log", "out"):
        parser.add_argument(name)
    parser.add_argument("in_flight", nargs="?", type=int, default=16)
    parser.add_argument("--curve-server-key")
    parser.add_argument("--curve-key")
    a = parser.parse_args()
    endpoint, name, calls, log, out, in_flight = a.endpoint, a.name, a.calls, a.log, a.out, a.in_flight
    curve = {}
    if a.curve_server_key:
        curve = {"curve_server_key": load_public(a.curve_server_key), "curve_keys": load_pair(a.curve_key)}
    gate = threading.Semaphore(in_flight)
    lines: list[str] = []
    lock = threading.Lock()
    with ExecutorClient(endpoint, timeout=30, **curve) as client:  # type: ignore[arg-type]
        client.tools(timeout=30)
        futures: list[Future[Result]] = []
        for i in range(int(calls)):
            gate.acquire()
            tag = f"{name}-{i}"
            tool = "lookup" if i % 5 == 0 else "work"
            cid = uuid.uuid4().hex
            future = client.submit(Call(tool=tool, kwargs={"tag": tag, "log": log, "seconds": 0.002}, id=cid))

            def done(f: Future[Result], tag: str = tag, cid: str = cid, tool: str = tool) -> None:
                r = f.result()
                value = r.value if isinstance(r.value, dict) else {}
                line = json.dumps({"tag": tag, "tool": tool, "id": cid, "got_id": r.id, "got_tag": value.get("tag"),
                                   "ok": r.ok, "kind": r.error.kind if r.error else None,
                                   "message": r.error.message if r.error else None})
                with lock:
                    lines.append(line)
                gate.release()

            future.add_done_callback(done)
            futures.append(future)
        for f in futures:
            f.result(timeout=120)
    with open(out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
