"""Reading ``/proc`` files without Python's file objects: the template and each fresh worker read
some for every call, and each page of objects they touch costs them a copy-on-write fault. A task's
``stat`` line is written for any task a process can see (most fields even for one it may not trace)."""

from __future__ import annotations

import os
import signal

PF_EXITING = 0x4  # a task's flag from the start of its exit
SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # its bit in the pending-signal mask


def read(path: str, size: int = 1 << 16) -> bytes:
    """The first ``size`` bytes of a file (``/proc`` and control-group files are made whole on the
    first read). Raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def write(path: str, data: bytes) -> None:
    """Write a control file in one call. Raises ``OSError``."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def stat_fields(path: str) -> list[bytes]:
    """The fields after the command name (which may hold spaces and parentheses): index 0 is the
    state (field 3 of proc(5)), 6 the flags (field 9), 28 the pending signals (field 31).
    Raises ``OSError`` if the task is gone."""
    return read(path, 4096).rsplit(b")", 1)[1].split()


def _exit_state(pid: int) -> tuple[bool, bool]:
    """(begun its exit or gone, SIGKILL pending) for process ``pid``."""
    try:
        fields = stat_fields(f"/proc/{pid}/stat")
        state, flags, pending = fields[0], int(fields[6]), int(fields[28])
    except (OSError, IndexError, ValueError):
        return True, False
    return state in (b"Z", b"X", b"x") or bool(flags & PF_EXITING), bool(pending & SIGKILL_PENDING)


def dying(pid: int) -> bool:
    """Whether process ``pid`` is gone or on its way out: a zombie, in its exit, or with a SIGKILL
    pending that it has not taken yet (a process frozen or in uninterruptible sleep keeps it
    pending; one just signalled has it until it next runs). Once ``kill(pid, SIGKILL)`` has returned
    anywhere, this is true."""
    exiting_, killed = _exit_state(pid)
    return exiting_ or killed


def exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun its exit (or is gone), as opposed to merely having a
    SIGKILL pending."""
    return _exit_state(pid)[0]
