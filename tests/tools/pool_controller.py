"""One controller of the pool load test, as its own process: ``python pool_controller.py ENDPOINT NAME
CALLS LOG OUT [IN_FLIGHT]``. It sends CALLS calls through one ``ExecutorClient`` (every fifth to the
idempotent ``lookup``, the others to ``work``), at most IN_FLIGHT at a time, each with a tag naming
this controller and the call, and writes one JSON line per answer to OUT: the tag it asked for, the
id it sent, the id and tag that came back, ok and the error kind."""

from __future__ import annotations

import json
import sys
import threading
import uuid
from concurrent.futures import Future

from controller import ExecutorClient
from protocol import Call, Result


def main() -> int:
    endpoint, name, calls, log, out = sys.argv[1:6]
    in_flight = int(sys.argv[6]) if len(sys.argv) > 6 else 16
    gate = threading.Semaphore(in_flight)
    lines: list[str] = []
    lock = threading.Lock()
    with ExecutorClient(endpoint, timeout=30) as client:
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
