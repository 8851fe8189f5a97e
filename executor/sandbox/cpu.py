"""The ``cgroups`` layer: the worker's memory and pids groups checked, and a CPU-rate limit set.

The memory and pids groups are the worker code's (``executor.workers.cgroups``); the CPU limit is
made here. With a v1 ``cpu`` hierarchy each worker gets a CPU group of its own under the
executor's, made (or reused) by ``CpuGroups`` in the template before the fork; with v2 only, the
limit goes on the worker's own v2 group. ``remove_cpu_groups`` takes this executor's away at exit.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from executor.sandbox.kernel import LayerError
from executor.workers import cgroups


def cpu_parent() -> Path | None:
    """Where this executor's per-worker CPU groups go: under its own group of the v1 ``cpu``
    hierarchy. (Without one, a v2 tree that delegates ``cpu`` gets the limit on each worker's own
    v2 group instead: a process is in one v2 group only.)"""
    own = cgroups._own_path("cpu")
    if own is None:
        return None
    parent = cgroups.ROOT / "cpu" / own.lstrip("/")
    return parent if (parent / "cpu.cfs_quota_us").exists() and os.access(parent, os.W_OK) else None


def _v2_root() -> Path:
    return cgroups.ROOT / "unified" if (cgroups.ROOT / "unified" / "cgroup.procs").exists() else cgroups.ROOT


def _v2_delegates_cpu() -> bool:
    own = cgroups._own_path("")
    with contextlib.suppress(OSError):
        return "cpu" in (_v2_root() / (own or "/").lstrip("/") / "cgroup.subtree_control").read_text().split()
    return False


def limit_cpu(group: Path, cores: float) -> None:
    period = 100_000
    quota = max(1000, int(period * cores))
    if (group / "cpu.max").exists():  # v2
        (group / "cpu.max").write_text(f"{quota} {period}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))


def probe_cgroups() -> str | None:
    support = cgroups.CgroupSupport.detect()
    if support is None:
        return "no writable control groups (needs root and mounted cgroup hierarchies)"
    missing = [n for n, p in (("memory", support.memory_parent), ("pids", support.pids_parent)) if p is None]
    if cpu_parent() is None and not _v2_delegates_cpu():
        missing.append("cpu")
    return f"no {', '.join(missing)} controller to nest groups under" if missing else None


def apply_cgroups(cpu_group: Path | None, cores: float) -> None:
    """The memory and pids groups were joined by the worker code (``cgroups.Group.join``): check that
    it did (a worker outside them is refused), then put this worker under its CPU limit (its own v1
    ``cpu_group``, else its v2 group)."""
    own, unified = {}, ""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        unified = path if controllers == "" else unified
        for c in controllers.split(","):
            own[c] = path
    for controller in ("memory", "pids"):  # v1 hierarchies, or the v2 group
        if not own.get(controller, unified).rsplit("/", 1)[-1].startswith(cgroups.PREFIX):
            raise LayerError("cgroups", f"the worker is not in a {controller} group of its own")
    if cpu_group is not None:  # v1: a CPU group of its own
        (cpu_group / "cgroup.procs").write_text("0")
        return
    group = _v2_root() / unified.lstrip("/")  # v2: one group for everything, its own already
    if not (group.name.startswith(cgroups.PREFIX) and (group / "cpu.max").exists()):
        raise LayerError("cgroups", "no CPU limit can be set for this worker")
    limit_cpu(group, cores)


class CpuGroups:
    """The template's v1 CPU groups, one per worker: made before each fork (or taken back from a
    worker that is gone, limit and all), remembered by worker pid after it."""

    def __init__(self, tag: str, cores: float) -> None:
        self.tag, self.cores = tag, cores
        self.by_pid: dict[int, Path] = {}  # worker pid -> its CPU group
        self.free: list[Path] = []  # empty ones, of workers gone: the next workers take them
        self.count = 0

    def take(self) -> Path | None:
        """A CPU group for the next worker (None without a v1 ``cpu`` hierarchy)."""
        if self.free:
            return self.free.pop()
        parent = cpu_parent()
        if parent is None:
            return None
        self.count += 1
        group = parent / f"{cgroups.PREFIX}{self.tag}-{os.getpid()}-{self.count}"
        with contextlib.suppress(FileExistsError):
            group.mkdir()
        limit_cpu(group, self.cores)
        return group

    def remember(self, pid: int, group: Path) -> None:
        self.by_pid[pid] = group

    def sweep_dead(self) -> None:
        """Take back the CPU groups of workers that are gone, and keep them for the next workers: no
        mkdir, rmdir or limit to write again."""
        for pid, group in list(self.by_pid.items()):
            if os.path.exists(f"/proc/{pid}"):
                continue  # alive (or not reaped yet): it may not even have joined its group
            with contextlib.suppress(OSError):
                if not (group / "cgroup.procs").read_text().strip():  # what it started is gone too
                    del self.by_pid[pid]
                    self.free.append(group)

    @staticmethod
    def sweep_stale() -> None:
        """At start: remove stale CPU groups any executor left (empty and older than
        ``cgroups.SWEEP_MIN_AGE``)."""
        parent = cpu_parent()
        if parent is None:
            return
        cutoff = time.time() - cgroups.SWEEP_MIN_AGE
        for child in parent.glob(f"{cgroups.PREFIX}*"):
            with contextlib.suppress(OSError):
                if child.stat().st_mtime < cutoff:
                    child.rmdir()


def remove_cpu_groups(tag: str) -> None:
    """Every CPU group of the executor ``tag`` (at its exit, when they are empty)."""
    parent = cpu_parent()
    if parent is None:
        return
    for child in parent.glob(f"{cgroups.PREFIX}{tag}-*"):
        cgroups.Group(child, None, None).remove()
