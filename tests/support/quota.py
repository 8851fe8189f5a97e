"""A hardened executor serving ``--workspace-rw`` with a ``--workspace-quota`` (``Served``), what the
quota and red-team tests of ``executor.sandbox.overlay`` share: the quota, the workspace's owner on
the host, the layers this machine lacks, stopping a served executor and what appeared on the host."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from controller import ExecutorClient
from executor.sandbox import overlay
from executor.sandbox.layers import probe_all
from protocol import Result

QUOTA_MB = 8
OWNER = 4242  # the workspace's owner on the host: what the tools act as, and what applied files belong to
MISSING = probe_all()


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    client: ExecutorClient
    workspace: Path
    top: Path

    def call(self, text: str, timeout: float | None = None) -> Result:
        return self.client.call_text(text, timeout=timeout)

    def usage(self) -> int:
        fd = os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return overlay.tree_usage(fd)
        finally:
            os.close(fd)


def added(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, list[str]]:
    """What appeared since ``before`` (other tests on this machine may remove things meanwhile)."""
    return {k: sorted(set(v) - set(before[k])) for k, v in after.items() if set(v) - set(before[k])}


def stop(served: Served) -> None:
    served.client.close()
    served.proc.terminate()
    try:
        served.proc.wait(15)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait()
