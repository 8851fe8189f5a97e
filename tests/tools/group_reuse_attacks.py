"""Tools for tests/test_group_reuse_redteam.py: hostile calls (root, the default profile) that try to
leave something in their control groups that binds or burdens the next worker given those groups."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from executor import tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # own_groups.py, beside this file
from own_groups import ROOT, own_groups

FREEZER = ROOT / "freezer"
FREEZER_PREFIX = "ciayn-redteam-"  # the tests thaw and remove these groups at their end
SHM_PREFIX = "/dev/shm/ciayn-redteam-"

# Control files of a memory group (v1) that bind a call's memory, besides the limits the executor writes.
V1_MEMORY_FILES = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control",
                   "memory.kmem.tcp.limit_in_bytes", "memory.soft_limit_in_bytes", "memory.swappiness",
                   "memory.move_charge_at_immigrate", "memory.use_hierarchy")
V2_FILES = ("cgroup.max.descendants", "cgroup.max.depth", "cgroup.freeze", "cgroup.subtree_control", "cgroup.type")




def _memory() -> Path:
    found = own_groups()
    return found.get("memory") or found[""]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        return f"<{e.strerror}>"


@tool
def probe() -> dict[str, object]:
    """What this worker's groups hold: the memory group's name, the pids in each group other than
    this process's, the process count, and the control files that bind a call."""
    found = own_groups()
    memory = _memory()
    me = os.getpid()
    said: dict[str, object] = {"name": memory.name}
    others: dict[str, list[int]] = {}
    for name, path in found.items():
        pids = [int(p) for p in _read(path / "cgroup.procs").split() if p.isdigit() and int(p) != me]
        others[name or "v2"] = pids
    said["others"] = others
    pids_group = found.get("pids") or found[""]
    said["pids.current"] = _read(pids_group / "pids.current")
    files = {}
    if (memory / "memory.limit_in_bytes").exists():
        for name in V1_MEMORY_FILES:
            files[name] = _read(memory / name)
    if "" in found:
        for name in V2_FILES:
            files["v2 " + name] = _read(found[""] / name)
    said["files"] = files
    return said


@tool
def tamper() -> str:
    """Write, as a root tool can, the memory group's control files the executor does not write back:
    TCP buffer memory cut to nothing, a soft limit, swappiness, charges moved in with a joining process;
    and the v2 group's limits on groups inside it. The memory group's name."""
    found = own_groups()
    memory = _memory()
    wrote = {"memory.kmem.tcp.limit_in_bytes": "4096", "memory.soft_limit_in_bytes": "4096",
             "memory.swappiness": "0", "memory.move_charge_at_immigrate": "3"}
    for name, value in wrote.items():
        try:
            (memory / name).write_text(value)
        except OSError:
            pass
    if "" in found:
        for name in ("cgroup.max.descendants", "cgroup.max.depth"):
            try:
                (found[""] / name).write_text("0")
            except OSError:
                pass
    return memory.name


@tool
def tcp_echo(kb: int = 4096, note: str = "") -> int:
    """Send ``kb`` KiB through a loopback TCP connection and read them back; how many bytes came back
    (after writing the memory group's name to ``note``, if given)."""
    import socket
    import threading

    if note:
        Path(note).write_text(_memory().name)

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got = [0]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    break
                got[0] += len(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = socket.create_connection(server.getsockname(), timeout=5)
    chunk = b"x" * 1024
    for _ in range(kb):
        client.sendall(chunk)
    client.close()
    thread.join(5)
    return got[0]


def _freeze(pids: list[int]) -> Path:
    """Put ``pids`` into a v1 freezer group of their own and freeze it: SIGKILL does not end a task
    the v1 freezer holds, until it is thawed."""
    group = FREEZER / f"{FREEZER_PREFIX}{os.getpid()}"
    group.mkdir(exist_ok=True)
    for pid in pids:
        (group / "cgroup.procs").write_text(str(pid))
    (group / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + 2
    while _read(group / "freezer.state") != "FROZEN" and time.monotonic() < deadline:
        time.sleep(0.01)
    return group


@tool
def frozen_leftovers(count: int = 1, leave_v2: bool = True, leave_memory: bool = False) -> str:
    """Start ``count`` small processes (sleep) and freeze them in a v1 freezer group, so that the
    kill after the call cannot end them. ``leave_v2``: move them out of the v2 group (the one whose
    "populated" the executor reads), so that they stay only in the v1 memory and pids groups;
    ``leave_memory``: out of the memory group too (no charge there), in the pids group only. The
    memory group's name."""
    found = own_groups()
    procs = [subprocess.Popen(["sleep", "1000"]) for _ in range(count)]
    time.sleep(0.05)  # exec'd: their charge is sleep's, not a copy of this Python's
    pids = [p.pid for p in procs]
    _freeze(pids)
    moves = []
    if leave_v2 and "" in found:
        moves.append(found[""].parent)
    if leave_memory and "memory" in found:
        moves.append(found["memory"].parent)
    for parent in moves:
        for pid in pids:
            (parent / "cgroup.procs").write_text(str(pid))
    for p in procs:
        p.returncode = 0  # never waited for: Popen's finalizer must not try
    return _memory().name


@tool
def leave_dirty(mb: int = 90, path: str = "") -> str:
    """Write ``mb`` MB to files on disk (page cache, dirty; files of at most 200 MB, under the
    file size limit) and keep them; the memory group's name."""
    target = path or f"/var/tmp/ciayn-redteam-dirty-{os.getpid()}"
    block = b"y" * (1 << 20)
    for part in range(0, mb, 200):
        with open(f"{target}-{part}", "wb") as f:
            for _ in range(min(200, mb - part)):
                f.write(block)
    return _memory().name


@tool
def allocate(mb: int, note: str = "") -> int:
    """Touch ``mb`` MB of private memory (after writing the memory group's name to ``note``, if
    given: a call the OOM killer ends cannot say it); how many bytes."""
    if note:
        Path(note).write_text(_memory().name)
    buf = bytearray(mb << 20)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    return len(buf)


@tool
def name() -> str:
    """The memory group's name."""
    return _memory().name


@tool
def lift_and_cache(mb: int = 1024, sync: bool = False, path: str = "") -> str:
    """Lift the memory group's limit (as a root tool can), then fill ``mb`` MB of page cache charged to
    it by writing a file on disk (left dirty, or written back with ``sync``), and keep the file. All of
    it is page cache, which the executor counts as reclaimable. The memory group's name."""
    memory = _memory()
    big = str(1 << 40)
    for name in ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes"):
        try:
            (memory / name).write_text(big)
        except OSError:
            pass
    if (memory / "memory.max").exists():
        (memory / "memory.max").write_text("max")
    leave_dirty(mb, path)
    if sync:
        os.sync()
    return memory.name
