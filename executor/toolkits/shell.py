"""``run_shell``: full shell access as the executor's user. Not confined to anything.
A command can read and write every file that user can, signal its processes and use the network;
the workspace confinement of ``executor.toolkits.builtin`` does not apply. Serve this module only
under ``--profile hardened``, where the worker's OS confinement is the boundary, or to tools and
models you trust. It bounds only the command's wall time (at most ``SHELL_TIMEOUT_MAX``), the output
kept (``SHELL_OUTPUT_CAP`` of each stream) and its lifetime: the whole process group is killed when
the shell exits or times out. Why and how: docs/executor.md#the-toolkits.
"""

# No ``from __future__ import annotations`` here: the signature text shown to the model would read
# ``(command: 'str')`` instead of ``(command: str)``.

import os
import selectors
import signal
import subprocess
import time
from typing import IO

from executor.context import workspace
from executor.registry import tool

__all__ = ["run_shell"]

SHELL_TIMEOUT_MAX = 300.0  # seconds; run_shell's own limit, below the tool's executor timeout
SHELL_OUTPUT_CAP = 64 * 1024  # bytes kept of each of stdout and stderr
SHELL_DRAIN_GRACE = 1.0  # seconds to collect output after the process group was killed


@tool(timeout=SHELL_TIMEOUT_MAX + 30)
def run_shell(command: str, timeout: float = 30.0) -> dict[str, int | str | bool]:
    """Run a /bin/sh command in the workspace directory, with no stdin and full shell access as the
    executor's user: it is not confined to the workspace (safe only under --profile hardened).
    Returns exit_code, stdout, stderr (each cut to 64 KB) and timed_out. At the timeout (seconds,
    at most 300) or when the command ends, it and every process it started in the background are
    killed."""
    if not 0 < timeout <= SHELL_TIMEOUT_MAX:
        raise ValueError(f"timeout must be more than 0 and at most {SHELL_TIMEOUT_MAX:g} seconds, not {timeout}")
    proc = subprocess.Popen(
        ["/bin/sh", "-c", command],
        cwd=workspace(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, so the whole tree can be killed at once
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _CappedOutput(), _CappedOutput()
    timed_out = _collect(proc, {proc.stdout: out, proc.stderr: err}, time.monotonic() + timeout)
    exit_code = proc.wait()
    stderr = err.text()
    if timed_out:
        stderr += f"\n[run_shell: timed out after {timeout:g} s; the command and its processes were killed]"
    return {"exit_code": exit_code, "stdout": out.text(), "stderr": stderr, "timed_out": timed_out}



class _CappedOutput:
    """A stream's bytes, keeping the first and last halves of the cap and counting what is cut."""

    def __init__(self, cap: int = SHELL_OUTPUT_CAP) -> None:
        self.half = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.cut = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[room:]
        if len(self.tail) > self.half:
            self.cut += len(self.tail) - self.half
            del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        middle = f"\n[... {self.cut} bytes cut ...]\n".encode() if self.cut else b""
        return bytes(self.head + middle + self.tail).decode("utf-8", errors="replace")


def _collect(proc: subprocess.Popen[bytes], sinks: dict[IO[bytes], _CappedOutput], deadline: float) -> bool:
    """Read the pipes into their sinks until the shell has ended and both pipes are closed. The process
    group is killed when the shell exits (background processes must not outlive the call) or at the
    deadline, whichever comes first. Returns whether the deadline came first."""
    timed_out = killed = False
    with selectors.DefaultSelector() as sel:
        for pipe in sinks:
            sel.register(pipe, selectors.EVENT_READ)
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)  # readable once the shell has exited
        try:
            while True:
                now = time.monotonic()
                if not killed and (proc.poll() is not None or now >= deadline):
                    timed_out = proc.returncode is None
                    _kill_group(proc.pid)
                    killed = True
                    if pidfd is not None:
                        sel.unregister(pidfd)
                    deadline = now + SHELL_DRAIN_GRACE  # a process that left the group may hold a pipe
                open_pipes = [k for k in sel.get_map().values() if k.fileobj is not pidfd]
                if killed and (not open_pipes or now >= deadline):
                    break
                wait = deadline - now if killed or pidfd is not None else min(deadline - now, 0.05)
                for key, _ in sel.select(max(wait, 0.0)):
                    if key.fileobj is pidfd:
                        continue
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        sinks[key.fileobj].add(chunk)  # type: ignore[index]
                    else:
                        sel.unregister(key.fileobj)
        finally:
            if pidfd is not None:
                os.close(pidfd)
            if not killed:
                _kill_group(proc.pid)
            for pipe in sinks:
                pipe.close()
    return timed_out


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), else None (then we poll)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
