"""The hardened profile's layers, in the order a worker applies them: the one place they are
composed.

Each ``Layer`` has a ``probe()`` (can this machine give it? None, or why not: what ``probe_all``,
the start-up gate and ``ciayn-executor selfcheck`` report) and an ``apply(worker)`` run in the
worker, in table order, each relying on the ones before it (``Sandbox.enter``). Namespace layers
only add ``flags`` to the one ``unshare`` call; ``pid-ns`` is applied by the template around the
fork. The kernel work is in the module of each concern (``cpu``, ``mounts``, ``identity``,
``landlock``, ``seccomp``); docs/security.md says what each layer denies and why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from executor.sandbox import cpu, identity, landlock, mounts, seccomp
from executor.sandbox.config import HardenedConfig
from executor.sandbox.kernel import CLONE_NEWCGROUP, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWUTS


class Entering(Protocol):
    """What a layer's ``apply`` reads: the ``executor.sandbox.profile.Sandbox`` of the worker
    entering it."""

    config: HardenedConfig
    view: mounts.View  # the root the template built
    cpu_group: Path | None  # this worker's v1 CPU group (None: its v2 group takes the limit)
    cap_last: int  # the kernel's last capability
    keeper: bool  # --workspace-rw: the call's writes go to an overlay its keeper applies


@dataclass(frozen=True)
class Layer:
    """One isolation layer: ``probe()`` says whether the machine can give it (None) or why not;
    ``apply(worker)`` runs in the worker. Namespace layers only contribute ``flags`` to the one
    ``unshare`` call; ``pid-ns`` is applied by the template around the fork."""

    name: str
    denies: str
    probe: Callable[[], str | None]
    apply: Callable[[Entering], None] | None = None
    flags: int = 0


def _probe_ns(kind: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        if os.geteuid() != 0:
            return "needs root"
        return None if os.path.exists(f"/proc/self/ns/{kind}") else f"the kernel has no {kind} namespaces"
    return probe


def _writable_workspace(w: Entering) -> str | None:
    return w.config.workspace if w.config.workspace_rw else None


LAYERS: tuple[Layer, ...] = (
    Layer("pid-ns", "seeing or signalling any process outside the call; outliving it", _probe_ns("pid")),
    Layer("cgroups", "memory, process count and CPU rate past the limits", cpu.probe_cgroups,
          lambda w: cpu.apply_cgroups(w.cpu_group, w.config.cpu_cores)),
    Layer("mount-ns", "changing the host's mounts", _probe_ns("mnt"), flags=CLONE_NEWNS),
    Layer("net-ns", "any network, loopback included", _probe_ns("net"), flags=CLONE_NEWNET),
    Layer("ipc-ns", "System V IPC and POSIX queues of the host", _probe_ns("ipc"), flags=CLONE_NEWIPC),
    Layer("uts-ns", "the host's hostname", _probe_ns("uts"), flags=CLONE_NEWUTS),
    Layer("cgroup-ns", "seeing its control groups", _probe_ns("cgroup"), flags=CLONE_NEWCGROUP),
    Layer("filesystem", "writes outside /tmp and /dev/shm; homes, shadow files, sockets, /sys",
          mounts.probe_filesystem, lambda w: mounts.apply_filesystem(w.view, w.config, w.keeper)),
    Layer("rlimits", "lifting the process limits the executor does not set per call", lambda: None,
          lambda w: identity.apply_rlimits()),
    Layer("capabilities", "every capability", identity.probe_root, lambda w: identity.apply_capabilities(w.cap_last)),
    Layer("identity", "root's files and processes", identity.probe_root,
          lambda w: identity.apply_identity(w.config.uid, w.config.gid)),
    Layer("no-new-privs", "privileges from setuid binaries", lambda: None, lambda w: identity.apply_no_new_privs()),
    Layer("landlock", "writes outside scratch, TCP, signals out", landlock.probe_landlock,
          lambda w: landlock.apply_landlock(_writable_workspace(w))),
    Layer("seccomp", "ptrace, process_vm_*, pidfd_*, mount, unshare, bpf, raw sockets, io_uring, ...",
          seccomp.probe_x86_64, lambda w: seccomp.apply_seccomp()),
)
LAYER_NAMES = tuple(layer.name for layer in LAYERS)


def probe_all() -> dict[str, str]:
    """The layers this machine cannot give, with the reason for each (empty: all of them)."""
    missing = {}
    for layer in LAYERS:
        try:
            reason = layer.probe()
        except OSError as e:
            reason = str(e)
        if reason is not None:
            missing[layer.name] = reason
    return missing
