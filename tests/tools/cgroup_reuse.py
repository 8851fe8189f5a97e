"""Tools for tests/test_cgroups.py: a worker names its control groups, reads the limits they hold,
rewrites them as a root tool can, or leaves memory charged to them (a file in /dev/shm)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from executor import tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # own_groups.py, beside this file
from own_groups import own_groups


def _memory_files(group: Path) -> tuple[str, ...]:
    if (group / "memory.max").exists():
        return ("memory.max", "memory.swap.max", "memory.high")
    return ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control")


@tool
def groups() -> str:
    """The name of the memory group this worker runs in."""
    group = own_groups().get("memory") or own_groups()[""]
    return group.name


@tool
def limits() -> dict[str, str]:
    """The group's name and what its limit files say."""
    found = own_groups()
    memory = found.get("memory") or found[""]
    said = {"name": memory.name}
    for name in _memory_files(memory):
        if (memory / name).exists():
            said[name] = (memory / name).read_text().strip()
    pids = found.get("pids") or found[""]
    said["pids.max"] = (pids / "pids.max").read_text().strip()
    kill = found.get("")
    if kill is not None and (kill / "cgroup.freeze").exists():
        said["cgroup.freeze"] = (kill / "cgroup.freeze").read_text().strip()
    return said


@tool
def lift_limits() -> str:
    """Raise the group's limits and turn its OOM killer off, as a root tool can; the group's name."""
    found = own_groups()
    memory = found.get("memory") or found[""]
    files = _memory_files(memory)
    if files[0] == "memory.max":
        for name in files:
            (memory / name).write_text("max")
    else:
        big = str(1 << 40)
        for name in files[1::-1]:  # memsw first: it must stay at least the limit
            try:
                (memory / name).write_text(big)
            except OSError:
                pass
        (memory / "memory.oom_control").write_text("1")
    ((found.get("pids") or found[""]) / "pids.max").write_text("max")
    return memory.name


@tool
def leave_shared(mb: int = 4) -> str:
    """Leave a file of ``mb`` MB in /dev/shm (its pages stay charged to the group); the group's name."""
    name = own_groups().get("memory") or own_groups()[""]
    with open(f"/dev/shm/ciayn-test-left-{os.getpid()}", "wb") as f:
        f.write(b"x" * (mb << 20))
    return name.name


@tool
def nest(leave_shared_mb: int = 0) -> str:
    """Make a group inside each of this worker's own (as a root tool can), and leave ``leave_shared_mb``
    MB in /dev/shm (so that the groups are not kept for the next worker); the memory group's name."""
    found = own_groups()
    for path in set(found.values()):
        (path / "nested").mkdir(exist_ok=True)
    if leave_shared_mb:
        leave_shared(leave_shared_mb)
    return (found.get("memory") or found[""]).name
