"""What this tree's executor can do, read from ``ciayn-executor serve --help`` and ``ciayn-executor
broker --help`` at run time (never hard-coded), so that a figure for a part that lands later fills
in on the next run by itself."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

HELP_TIMEOUT = 30.0


def _help(*command: str) -> str | None:
    """The help text of ``ciayn-executor COMMAND``, or None if that command does not exist."""
    try:
        done = subprocess.run([sys.executable, "-m", "executor.cli", *command, "--help"], capture_output=True,
                              text=True, timeout=HELP_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass(frozen=True)
class Features:
    reuse_workers: bool  # serve --reuse-workers (and so: fresh workers by default)
    hardened: bool  # serve --profile hardened
    broker: bool  # ciayn-executor broker, and serve --connect
    insecure_flag_serve: bool  # tcp without CurveZMQ needs --insecure
    insecure_flag_broker: bool
    broker_recovery_flag: bool  # broker --recovery-s (0 for a pool that never ran: no wait at start)

    @classmethod
    def detect(cls) -> Features:
        serve = _help("serve") or ""
        broker = _help("broker")
        # ``--profile {default,hardened}`` once; ``--profile PROFILE`` and its help line since the CLI's
        # one help style (358add8), which a search for the first alone missed: "not built yet" since.
        profiles = re.search(r"--profile (?:\{([^}]*)\}|PROFILE\s+[^\n]*?default or hardened)", serve)
        return cls(
            reuse_workers="--reuse-workers" in serve,
            hardened=profiles is not None,
            broker=broker is not None and "--connect" in serve,
            insecure_flag_serve="--insecure" in serve,
            insecure_flag_broker=broker is not None and "--insecure" in broker,
            broker_recovery_flag=broker is not None and "--recovery-s" in broker,
        )

    def missing(self, name: str) -> str:
        """Why a figure that needs ``name`` cannot be measured yet."""
        return {
            "reuse_workers": "`ciayn-executor serve --help` has no --reuse-workers option yet (issue 9)",
            "hardened": "`ciayn-executor serve --help` offers no `--profile hardened` yet (issue 11)",
            "broker": "`ciayn-executor broker` (and `serve --connect`) do not exist yet (issue 12)",
        }[name]
