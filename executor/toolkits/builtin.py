"""The small built-in toolkit: files in the workspace, a shell, and the two signals.

    ciayn-executor serve --tools executor.toolkits.builtin --workspace DIR

Every path is confined to the workspace (see ``executor.toolkits.paths``). Errors are ordinary
exceptions whose messages are written for the model; the executor turns them into ``tool_error``
results. The docstrings are shown to the model verbatim, so they stay short.
"""

# No ``from __future__ import annotations`` here: the signature text shown to the model would read
# ``(path: 'str')`` instead of ``(path: str)``.

import codecs
import os
import selectors
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import IO

from executor import signals
from executor.context import workspace
from executor.registry import tool
from executor.toolkits.paths import confine, open_confined, shown

__all__ = ["complete_task", "emit_note", "list_dir", "read_file", "run_shell", "write_file"]

LIST_DIR_MAX_ENTRIES = 1000
SHELL_TIMEOUT_MAX = 300.0  # seconds; run_shell's own limit, below the tool's executor timeout
SHELL_OUTPUT_CAP = 64 * 1024  # bytes kept of each of stdout and stderr
SHELL_DRAIN_GRACE = 1.0  # seconds to collect output after the process group was killed


@tool(bundleable=True, idempotent=True)
def read_file(path: str, max_bytes: int = 200_000) -> str:
    """Read a UTF-8 text file in the workspace. Files longer than max_bytes are cut, with a note saying so."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, not {max_bytes}")
    target = confine(path)
    st = _stat(path, target)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{path!r} is a directory, not a file; use list_dir({path!r})")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path!r} is not a regular file (a device, socket or pipe); it cannot be read")
    fd = open_confined(target, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path!r} is not a regular file; it cannot be read")
        data = f.read(max_bytes)
        truncated = bool(f.read(1))
        size = os.fstat(f.fileno()).st_size
    if b"\0" in data:
        raise ValueError(f"{path!r} is a binary file (it contains NUL bytes), not text; read_file reads text only")
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(data, final=not truncated)  # a cut multi-byte character is held back
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path!r} is not UTF-8 text (undecodable byte at offset {e.start}); it looks binary, "
            "and read_file reads text only"
        ) from None
    if not truncated:
        return text
    kept = len(data) - len(decoder.getstate()[0])
    return (
        f"{text}\n[read_file: truncated; showed the first {kept} of {size} bytes, "
        f"{size - kept} bytes cut; raise max_bytes or use run_shell with head/tail/grep to see the rest]"
    )


@tool
def write_file(path: str, content: str) -> str:
    """Create or overwrite a text file in the workspace (UTF-8), creating missing parent directories."""
    target = confine(path)
    if target.is_dir():
        raise IsADirectoryError(f"{path!r} is a directory; give a file path to write to")
    data = content.encode("utf-8")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(f"cannot create the parent directory of {path!r}: a file is in the way") from None
    fd = open_confined(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return f"wrote {len(data)} bytes to {shown(target)}"


@tool(bundleable=True, idempotent=True)
def list_dir(path: str = ".") -> list[str]:
    """List a workspace directory: sorted names, directories with a trailing "/"."""
    target = confine(path)
    st = _stat(path, target)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path!r} is a file, not a directory; use read_file({path!r})")
    with os.scandir(target) as it:
        names = sorted(e.name + "/" if e.is_dir() else e.name for e in it)
    if len(names) > LIST_DIR_MAX_ENTRIES:
        more = len(names) - LIST_DIR_MAX_ENTRIES
        names = [*names[:LIST_DIR_MAX_ENTRIES], f"[... {more} more entries not shown]"]
    return names


@tool(timeout=SHELL_TIMEOUT_MAX + 30)
def run_shell(command: str, timeout: float = 30.0) -> dict[str, int | str | bool]:
    """Run a /bin/sh command in the workspace directory, with no stdin. Returns exit_code, stdout,
    stderr (each cut to 64 KB) and timed_out. At the timeout (seconds, at most 300) or when the
    command ends, it and every process it started in the background are killed."""
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


@tool(bundleable=True)
def emit_note(text: str) -> str:
    """Show a short note to the user in the transcript."""
    signals.note(text)
    return "noted"


@tool
def complete_task(summary: str) -> str:
    """Declare the task done, with a one-line summary for the user. Call it once, at the end."""
    signals.complete(summary)
    return "task marked complete"


def _stat(path: str, target: Path) -> os.stat_result:
    try:
        return os.stat(target)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path!r} does not exist in the workspace; use list_dir to see what does") from None
    except NotADirectoryError:
        raise FileNotFoundError(f"{path!r} does not exist: a part of it is a file, not a directory") from None


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
