"""``HardenedConfig``: what the hardened profile is configured with beyond the call limits.

Plain data (the CLI builds it from the ``serve`` options; ``Sandbox.to_wire`` sends it to a template
started afresh), read by every layer that needs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from executor.sandbox.identity import NOBODY
from executor.sandbox.overlay import DEFAULT_QUOTA_MB


@dataclass(frozen=True)
class HardenedConfig:
    """What the hardened profile needs to know beyond the call limits."""

    workspace: str  # absolute; mounted read-only unless workspace_rw
    workspace_rw: bool = False  # then each call's writes are a transaction (``executor.sandbox.overlay``)
    workspace_quota_mb: int = DEFAULT_QUOTA_MB  # with workspace_rw: the workspace's size after a call
    max_result_kb: int = 4096  # the executor's default (``Limits``): the largest reply a keeper holds
    hide: tuple[str, ...] = ()  # never visible inside: the executor's socket directory, its CurveZMQ key
    uid: int = NOBODY
    gid: int = NOBODY
    tmp_mb: int = 128  # /tmp (the cwd); tmpfs pages count against the memory group too
    shm_mb: int = 64  # /dev/shm
    cpu_cores: float = 1.0  # CPU rate per worker (cgroup cpu quota)
    allow_degraded: bool = False
    group_tag: str = field(default_factory=lambda: os.urandom(4).hex())  # names this executor's CPU groups
