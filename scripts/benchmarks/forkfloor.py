"""The fork floor of the template (``python -m scripts.benchmarks.forkfloor TOOL_MODULE``, from the
project root; ``weight.ForkFloor`` runs it as its peer): a process that imports what the executor's
template imports (its entry, ``executor.workers.template``, and the tool module, found the way the
template finds it: ``find_tools``, which describes nothing, so no pydantic) and then forks children
that exit at once, as the template forks workers (``executor.workers.quickfork.fork``, the bare
``fork()`` where that is safe).

Reads a count per line on stdin and answers one JSON line: each cycle's wall time (fork, the child's
``_exit``, the parent's ``waitpid``) and the CPU all of it took in both processes (the parent's own
and its reaped children's), plus this process's private memory. It imports no ZeroMQ, as the
template does not. Prints ``ready`` first; exits at end of input.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import executor.workers.template  # noqa: F401  (what the template has imported)
from executor.registry import find_tools
from executor.workers import quickfork


def private_kb(pid: int | str = "self") -> int:
    """Private (clean + dirty) memory of ``pid`` in KiB: what a fork of it has to copy-on-write."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


def cycles(n: int) -> dict[str, object]:
    walls = []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(n):
        t = time.perf_counter()
        pid = quickfork.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        walls.append(time.perf_counter() - t)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum((b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime) for a, b in zip(cpu0, cpu1, strict=True))
    return {"wall_s": walls, "cpu_s": cpu, "bare_fork": not quickfork.why_not(), "private_kb": private_kb()}


def main(tool_module: str) -> int:
    quickfork.watch_hooks()
    find_tools([tool_module])
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(cycles(int(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
