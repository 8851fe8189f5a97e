"""Per-worker control groups, where the machine offers them (root, cgroup hierarchies mounted):
memory (caps the whole process tree; an OOM kill is answered ``memory``), pids (caps the number of
processes, even for root) and, on v2, kill (the whole group at once). The template makes a worker's
groups before it forks it (``CgroupSupport.create``), the worker joins them before any tool code runs
(``Group.join``); when it is gone they are removed, or kept for the next worker if nothing of
its call is left in them (``Group.reusable``), their limits written again. Without cgroups
``CgroupSupport.detect()`` returns None and the executor relies on rlimits and the subreaper kill.
Why and how: docs/executor.md#control-groups.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from executor.workers import procfs

ROOT = Path("/sys/fs/cgroup")
PREFIX = "ciayn-"
SWEEP_MIN_AGE = 60.0  # seconds: empty groups older than this are leftovers
EMPTY_WAIT = 1.0  # seconds to wait for a killed group to empty before removing it
REUSE_MAX_CHARGE = 1 << 20  # bytes a dead worker's memory group may still hold, beyond page cache, to be reused


def _own_path(controller: str) -> str | None:
    """This process's group path in the hierarchy of ``controller`` (v1), or the v2 path for ''."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


_KILL_FILE: list[bool] = []  # whether groups have cgroup.kill (kernel >= 5.14), learnt from the first


def _has_kill(group: str) -> bool:
    if not _KILL_FILE:
        _KILL_FILE.append(os.path.exists(f"{group}/cgroup.kill"))
    return _KILL_FILE[0]


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


@dataclass(frozen=True)
class Group:
    """One worker's groups (directories); any of them may be missing."""

    memory: str | Path | None
    pids: str | Path | None
    kill: str | Path | None
    memory_v2: bool = False

    def paths(self) -> list[str | Path]:
        return [p for p in (self.memory, self.pids, self.kill) if p is not None]

    def join(self) -> None:
        """Move the calling process into every group (the worker, before running tools). The
        control files here are written with bare system calls (``procfs``): the template and each
        fresh worker run this for every call, where each page of Python objects touched costs a
        copy-on-write fault."""
        for path in self.paths():
            procfs.write(f"{path}/cgroup.procs", b"0")

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process in the memory group (v1 ``memory.oom_control``
        or v2 ``memory.events``: both have an ``oom_kill N`` line)."""
        if self.memory is None:
            return False
        for name in ("memory.oom_control", "memory.events"):
            try:
                text = procfs.read(f"{self.memory}/{name}")
            except FileNotFoundError:
                continue
            except OSError:
                return False
            at = text.find(b"oom_kill ")
            return at >= 0 and text[at + 9:].split(b"\n", 1)[0].strip() not in (b"0", b"")
        return False

    def kill_all(self) -> None:
        """SIGKILL everything in the group (v2 cgroup.kill); the template reaps what was its child."""
        if self.kill is not None:
            with contextlib.suppress(OSError):
                procfs.write(f"{self.kill}/cgroup.kill", b"1")

    def reusable(self) -> bool:
        """Whether another worker may join these groups now that the last one is gone: no process is
        left in any of them, and the memory group holds at most ``REUSE_MAX_CHARGE`` bytes that
        reclaim cannot free (page cache it can; a file left in /dev/shm or kernel memory it cannot),
        so that nothing a call left counts against the next. Ask only of a group no OOM kill hit
        (``oom_killed`` counts over a group's whole life)."""
        try:
            # v2: whether a process is in the group or any group below it
            if self.kill is not None and b"populated 0" not in procfs.read(f"{self.kill}/cgroup.events", 256):
                return False
            # v1 (a process can leave the v2 group and stay in these): its members, not those below
            if any(procfs.read(f"{path}/cgroup.procs", 64) for path in {self.memory, self.pids} - {self.kill, None}):
                return False
            if self.memory is None:
                return True
            usage = int(procfs.read(f"{self.memory}/{'memory.current' if self.memory_v2 else 'memory.usage_in_bytes'}"))
            if usage <= REUSE_MAX_CHARGE:
                return True
            stat = dict(line.split() for line in procfs.read(f"{self.memory}/memory.stat").splitlines())
            return usage - int(stat[b"active_file"]) - int(stat[b"inactive_file"]) <= REUSE_MAX_CHARGE
        except (OSError, ValueError, KeyError):
            return False

    def limit(self, memory_mb: int, processes: int, again: bool = False) -> None:
        """Write the limits. ``again``: on groups a dead worker had, whose tool, as root, may have
        written their control files; the other files that bind a call are set back too (v1's OOM
        killer turned off, v2's throttle, v2's freeze). Raises ``OSError``."""
        memory, v2 = self.memory, self.memory_v2
        if memory is not None:
            limit = b"%d" % (memory_mb * 1024 * 1024)
            if not v2 and again:  # memsw must stay at least the limit: lowered first if it was raised
                with contextlib.suppress(OSError):
                    procfs.write(f"{memory}/memory.memsw.limit_in_bytes", limit)
            procfs.write(f"{memory}/{'memory.max' if v2 else 'memory.limit_in_bytes'}", limit)
            if not v2:
                with contextlib.suppress(OSError):  # no swap accounting on some kernels
                    procfs.write(f"{memory}/memory.memsw.limit_in_bytes", limit)
            else:
                with contextlib.suppress(FileNotFoundError):  # no swap controller
                    procfs.write(f"{memory}/memory.swap.max", b"0")
            if again:
                procfs.write(f"{memory}/{'memory.high' if v2 else 'memory.oom_control'}", b"max" if v2 else b"0")
        if self.pids is not None:
            procfs.write(f"{self.pids}/pids.max", b"%d" % processes)
        if again and self.kill is not None:
            procfs.write(f"{self.kill}/cgroup.freeze", b"0")

    def remove(self, wait: float = EMPTY_WAIT) -> bool:
        """Remove the groups, and the groups a root tool made inside them, waiting up to ``wait``
        for them to empty; whether all are gone."""
        deadline = time.monotonic() + wait
        gone = True
        for path in self.paths():
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # groups inside it, or still populated (processes exiting): retry briefly
                    if _remove_inner(str(path)):
                        continue
                    if time.monotonic() > deadline:
                        gone = False
                        break
                    time.sleep(0.005)
        return gone


def _remove_inner(path: str) -> bool:
    """Remove the empty groups inside ``path``, deepest first; whether it removed any. A tool that
    made one (as root, in the default profile) would otherwise keep its worker's groups from ever
    being removed, and each try of that costs whoever tries (the template, the supervisor) a wait."""
    removed = False
    for inner, _, _ in os.walk(path, topdown=False):
        if inner != path:
            with contextlib.suppress(OSError):
                os.rmdir(inner)
                removed = True
    return removed


@dataclass(frozen=True)
class CgroupSupport:
    """Where per-worker groups can be made on this machine."""

    memory_parent: Path | None
    memory_v2: bool
    pids_parent: Path | None
    kill_parent: Path | None

    @classmethod
    def detect(cls) -> CgroupSupport | None:
        if os.geteuid() != 0:
            return None
        memory_parent = pids_parent = kill_parent = None
        memory_v2 = False
        v2_root = ROOT / "unified" if (ROOT / "unified" / "cgroup.procs").exists() else ROOT
        v2_own = _own_path("")
        v2_parent = v2_root / v2_own.lstrip("/") if v2_own is not None else None
        v2_controllers: set[str] = set()
        if v2_parent is not None and (v2_parent / "cgroup.controllers").exists():
            with contextlib.suppress(OSError):
                v2_controllers = set((v2_parent / "cgroup.controllers").read_text().split())
        if v2_parent is not None and _writable_dir(v2_parent) and (v2_parent / "cgroup.procs").exists():
            kill_parent = v2_parent  # cgroup.kill itself is checked on each new group (kernel >= 5.14)
        mem_own = _own_path("memory")
        if mem_own is not None and _writable_dir(ROOT / "memory" / mem_own.lstrip("/")):
            memory_parent = ROOT / "memory" / mem_own.lstrip("/")
        elif "memory" in v2_controllers and v2_parent is not None and _writable_dir(v2_parent):
            memory_parent, memory_v2 = v2_parent, True
        pids_own = _own_path("pids")
        if pids_own is not None and _writable_dir(ROOT / "pids" / pids_own.lstrip("/")):
            pids_parent = ROOT / "pids" / pids_own.lstrip("/")
        elif "pids" in v2_controllers and v2_parent is not None and _writable_dir(v2_parent):
            pids_parent = v2_parent
        if memory_parent is None and pids_parent is None and kill_parent is None:
            return None
        return cls(memory_parent, memory_v2, pids_parent, kill_parent)

    def describe(self) -> str:
        parts = []
        if self.memory_parent is not None:
            parts.append(f"memory ({'v2' if self.memory_v2 else 'v1'})")
        if self.pids_parent is not None:
            parts.append("pids")
        if self.kill_parent is not None:
            parts.append("cgroup.kill")
        return ", ".join(parts)

    def create(self, name: str, memory_mb: int, processes: int) -> Group:
        """Make one worker's groups (removing stale ones of the same name first)."""
        memory = self._make(self.memory_parent, name)
        pids = self._make(self.pids_parent, name) if self.pids_parent != self.memory_parent else memory
        if self.kill_parent in (self.memory_parent, self.pids_parent):
            kill = memory if self.kill_parent == self.memory_parent else pids
        else:
            kill = self._make(self.kill_parent, name)
        if kill is not None and not _has_kill(kill):
            kill = None
        group = Group(memory=memory, pids=pids, kill=kill, memory_v2=self.memory_v2)
        group.limit(memory_mb, processes)
        return group

    @staticmethod
    def _make(parent: Path | None, name: str) -> str | None:
        if parent is None:
            return None
        path = f"{parent}/{PREFIX}{name}"
        try:
            os.mkdir(path)
        except FileExistsError:  # a stale group of the same name
            Group(path, None, None).remove()
            os.mkdir(path)
        return path

    def sweep(self) -> int:
        """Remove empty groups left by executors that died without cleaning up (SIGKILL). rmdir only
        succeeds on a group with no process in it, so live executors' groups are untouched; a group
        younger than ``SWEEP_MIN_AGE`` may be one another executor made and is about to join."""
        removed = 0
        cutoff = time.time() - SWEEP_MIN_AGE
        for parent in {self.memory_parent, self.pids_parent, self.kill_parent} - {None}:
            assert parent is not None
            for child in parent.glob(f"{PREFIX}*"):
                with contextlib.suppress(OSError):
                    if child.stat().st_mtime < cutoff:
                        _remove_inner(str(child))
                        child.rmdir()
                        removed += 1
        return removed

    def remove_named(self, name_prefix: str, wait: float = EMPTY_WAIT) -> None:
        """Kill and remove every group whose name starts with ``name_prefix`` (an executor's own,
        at its shutdown: a backstop for groups its template could not remove), waiting at most
        ``wait`` for each to empty."""
        groups: dict[str, dict[str, Path]] = {}
        for attr in ("memory_parent", "pids_parent", "kill_parent"):
            parent = getattr(self, attr)
            if parent is not None:
                for child in parent.glob(f"{PREFIX}{name_prefix}*"):
                    groups.setdefault(child.name, {})[attr] = child
        for paths in groups.values():
            kill = paths.get("kill_parent")
            group = Group(paths.get("memory_parent"), paths.get("pids_parent"),
                          kill if kill is not None and (kill / "cgroup.kill").exists() else None)
            group.kill_all()
            group.remove(wait)
