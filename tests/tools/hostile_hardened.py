"""Tools that probe the hardened profile from inside a worker (tests/test_hardened.py). Each reports
what it saw as data; the tests judge it on the host."""

from __future__ import annotations

import os
import subprocess

from executor import tool, workspace


@tool
def sh(command: str) -> dict[str, int | str]:
    """Run a /bin/sh command (10 s at most); return its exit code and output."""
    proc = subprocess.run(["/bin/sh", "-c", command], capture_output=True, timeout=10, check=False)
    return {"exit_code": proc.returncode, "stdout": proc.stdout.decode(errors="replace")[-4000:],
            "stderr": proc.stderr.decode(errors="replace")[-4000:]}


@tool
def where_am_i() -> dict[str, str | int]:
    """The worker's view: pid, uid, cwd, HOME, TMPDIR and the workspace tools are told about."""
    return {"pid": os.getpid(), "uid": os.getuid(), "cwd": os.getcwd(), "home": os.environ.get("HOME", ""),
            "tmpdir": os.environ.get("TMPDIR", ""), "workspace": str(workspace())}


@tool
def scratch_roundtrip(megabytes: int) -> int:
    """Write then read back a file of ``megabytes`` MiB in the scratch directory (the cwd)."""
    chunk = b"x" * (1 << 20)
    with open("scratch.bin", "wb") as f:
        for _ in range(megabytes):
            f.write(chunk)
    return os.path.getsize("scratch.bin")


@tool
def write_workspace(name: str, text: str) -> str:
    """Write ``text`` into the workspace file ``name``."""
    path = workspace() / name
    path.write_text(text)
    return str(path)
