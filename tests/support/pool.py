"""A real pool for tests and benchmarks: a ``ciayn-executor broker`` process and ``serve --connect``
executor processes, each in its own process group and always cleaned up. Waiting is on conditions
(the broker's ``status`` report, a line in a log), each with a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from executor.status import StatusError, fetch
from protocol import Report
from tests.support.waiting import START_BOUND, wait_until

ROOT = Path(__file__).resolve().parents[2]
POOL_TOOLS = str(ROOT / "tests" / "tools" / "pool_tools.py")
ALPHA = str(ROOT / "tests" / "tools" / "pool_alpha.py")
BETA = str(ROOT / "tests" / "tools" / "pool_beta.py")
CONFLICT = str(ROOT / "tests" / "tools" / "pool_conflict.py")


class Pool:
    """A broker and its executors. ``frontend``/``backend`` default to ipc endpoints in ``tmp``."""

    def __init__(self, tmp: Path, *, frontend: str | None = None, backend: str | None = None,
                 prefix: Sequence[str] = (), status_keys: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        self.frontend = frontend or f"ipc://{tmp}/frontend.sock"
        self.backend = backend or f"ipc://{tmp}/backend.sock"
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NAME] for every process
        self.status_keys = status_keys or {}
        self.broker: subprocess.Popen[bytes] | None = None
        self.executors: list[subprocess.Popen[bytes]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self._n = 0

    def _spawn(self, name: str, args: list[str], prefix: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        self._n += 1
        log = self.tmp / f"{name}-{self._n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*(self.prefix if prefix is None else prefix), sys.executable, "-m",
                                     "executor.cli", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def start_broker(self, *args: str, recovery_s: float = 0.5, prefix: Sequence[str] | None = None) -> None:
        self.broker = self._spawn("broker", ["broker", "--frontend", self.frontend, "--backend", self.backend,
                                             "--recovery-s", str(recovery_s), *args], prefix)

    def add_executor(self, tools: Sequence[str] = (POOL_TOOLS,), workers: int = 2, *args: str,
                     prefix: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        cmd = ["serve", "--connect", self.backend, "--workers", str(workers)]
        for t in tools:
            cmd += ["--tools", t]
        proc = self._spawn("executor", [*cmd, *args], prefix)
        self.executors.append(proc)
        return proc

    def status(self, timeout: float = 2.0) -> Report | None:
        try:
            return fetch(self.frontend, timeout=timeout, **self.status_keys)
        except StatusError:
            return None

    def wait_for_executors(self, n: int, timeout: float = START_BOUND) -> Report:
        def joined() -> Report | None:
            report = self.status()
            return report if report is not None and len(report.executors) == n else None

        report: Report = wait_until(f"{n} executors in the pool", joined, timeout, every=0.1)
        return report

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        """Signal one process we started (only it: its workers notice on their own)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own process group: what it left behind
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
