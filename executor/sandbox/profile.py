"""The hardened profile of ``ciayn-executor serve --profile hardened``: ``activate`` builds it,
``Sandbox`` is the ``Confinement`` (``executor.workers.confinement``) the template is given.

In the template, ``before_fork``/``after_fork`` build the read-only root once (``mounts``), make
each worker's CPU group (``cpu``) and put the next child in a PID namespace of its own; in the
fresh worker, ``enter`` applies every layer of ``executor.sandbox.layers`` in order (with
``--workspace-rw`` after splitting off the call's keeper, ``executor.sandbox.keeper``) and returns
their names, or raises ``LayerError`` naming the one that failed. ``to_wire``/``restore`` carry the
profile to a template started afresh; ``restore`` must stay in this module, beside ``Sandbox``
(``confinement.from_wire`` imports the module ``to_wire`` names).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from executor.sandbox import cpu, keeper, layers, mounts, overlay
from executor.sandbox.config import HardenedConfig
from executor.sandbox.kernel import CLONE_NEWPID, LayerError, check, libc
from executor.sandbox.layers import Layer


class Sandbox:
    """The hardened profile's state in the template (the root it built, the CPU groups of its
    workers) and, after a fork, in the worker that enters it."""

    def __init__(self, config: HardenedConfig, layers: tuple[Layer, ...]) -> None:
        self.config = config
        self.layers = layers
        self.names = [layer.name for layer in layers]
        self.view = mounts.View()
        self.prepared = False
        self.cap_last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        self.own_pidns = -1
        self.cpu = cpu.CpuGroups(config.group_tag, config.cpu_cores)  # template side
        self.cpu_group: Path | None = None  # the next (or, in a worker, its own) v1 CPU group
        self.timings: dict[str, float] = {}  # layer -> seconds, in the worker that entered
        # --workspace-rw: each worker is a keeper outside the sandbox plus the sandboxed process that
        # runs the call, whose writes the keeper applies afterwards (``executor.sandbox.keeper``)
        self.keeper = config.workspace_rw and "filesystem" in self.names

    # ---------------------------------------------------------------- template side

    def before_fork(self) -> None:
        """In the template, just before forking a worker: build the root once, take back the CPU
        groups of dead workers, pick this worker's, and point the next child at a new PID
        namespace."""
        if not self.prepared:
            self._prepare()
        self.cpu.sweep_dead()
        self.cpu_group = self.cpu.take() if "cgroups" in self.names else None
        if "pid-ns" in self.names:
            # Back to its own namespace first, in case a fork failed after the last unshare (a second
            # unshare(CLONE_NEWPID) before any child would be refused with EINVAL).
            check("pid-ns", "setns back", libc.setns(self.own_pidns, CLONE_NEWPID))
            if not self.keeper:  # else the keeper makes it for the process it forks
                check("pid-ns", "unshare(CLONE_NEWPID)", libc.unshare(CLONE_NEWPID))

    def after_fork(self, pid: int) -> None:
        """In the template, right after the fork: later children start in its own PID namespace
        again (setns back), and the new worker's CPU group is remembered for reuse."""
        if "pid-ns" in self.names:
            check("pid-ns", "setns back", libc.setns(self.own_pidns, CLONE_NEWPID))
        if self.cpu_group is not None:
            self.cpu.remember(pid, self.cpu_group)

    def _prepare(self) -> None:
        """Once, in the template: stale CPU groups removed and, in a private mount namespace, the
        read-only root."""
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        cpu.CpuGroups.sweep_stale()
        if "filesystem" in self.names:
            self.view = mounts.build_root(self.config, self.keeper)
        self.prepared = True

    def to_wire(self) -> dict[str, Any]:
        """This profile as plain data, for a template started afresh (``restore``)."""
        return {"module": __name__, "state": {"config": dataclasses.asdict(self.config), "layers": list(self.names)}}

    def remove_groups(self) -> None:
        """At the executor's exit: remove every CPU group this executor made (they are empty by
        then) and, with ``--workspace-rw``, what a keeper killed mid-apply by the stop left in the
        workspace (``overlay.recover``)."""
        cpu.remove_cpu_groups(self.config.group_tag)
        if self.keeper:
            overlay.recover(os.path.realpath(self.config.workspace), self.view.root + overlay.TALLY + "/workspace-size")

    # ---------------------------------------------------------------- worker side

    def enter(self) -> list[str]:
        """In a freshly forked worker, before it reads its call: apply every layer, in order.
        Returns the names of the layers applied; raises ``LayerError`` naming the one that failed.
        With ``--workspace-rw`` this process first becomes the call's keeper: only the process it
        forks returns from here."""
        t0 = time.perf_counter()
        if self.keeper:
            keeper.split(self.config, self.view.root, pid_namespace="pid-ns" in self.names)
        flags = 0
        for layer in self.layers:
            flags |= layer.flags
        for layer in self.layers:
            start = time.perf_counter()
            if layer.name == "mount-ns" and flags:  # one unshare for every namespace layer
                check("mount-ns", "unshare", libc.unshare(flags))
            if layer.apply is not None:
                try:
                    layer.apply(self)
                except OSError as e:
                    raise LayerError(layer.name, str(e)) from None
            self.timings[layer.name] = time.perf_counter() - start
        self.timings["total"] = time.perf_counter() - t0
        return list(self.names)


def activate(config: HardenedConfig) -> Sandbox:
    """The hardened profile for this executor's workers (the CLI builds it before the template is
    forked, and passes it in as the workers' ``Confinement``). Refuses, naming them, when layers
    are missing, unless degraded mode was asked for: then the missing ones are left out and the
    result's ``worker.layers`` says so."""
    missing = layers.probe_all()
    if missing and not config.allow_degraded:
        raise LayerError(", ".join(missing), "; ".join(f"{k}: {v}" for k, v in missing.items()))
    return Sandbox(config, tuple(layer for layer in layers.LAYERS if layer.name not in missing))


def restore(state: dict[str, Any]) -> Sandbox:
    """The profile ``Sandbox.to_wire`` described, with the same layers (already probed, and checked
    by the selfcheck, in the process that described it): in a template started afresh."""
    config = dict(state["config"])
    config["hide"] = tuple(config.get("hide", ()))
    names = set(state["layers"])
    return Sandbox(HardenedConfig(**config), tuple(layer for layer in layers.LAYERS if layer.name in names))
