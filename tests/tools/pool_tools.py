"""Tools for the pool tests: each call leaves a line in a side-effect log, so a test can prove which
calls ran, how often, and where."""

from __future__ import annotations

import os
import time

from executor import tool


def _log(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write with O_APPEND: lines never interleave
    finally:
        os.close(fd)


def _template() -> str:
    """Which executor's template forked this worker, as the worker sees it: its PID namespace (one
    per template where the machine allows) and its parent's pid."""
    return f"{os.readlink('/proc/self/ns/pid')}/{os.getppid()}"


@tool(timeout=30)
def work(tag: str, log: str = "", seconds: float = 0.0) -> dict[str, object]:
    """Sleep `seconds`, record `tag` in the side-effect log `log`, and say which process ran it."""
    if seconds:
        time.sleep(seconds)
    if log:
        _log(log, f"{tag} {_template()}")
    return {"tag": tag, "pid": os.getpid()}


@tool(idempotent=True, timeout=30)
def lookup(tag: str, log: str = "", seconds: float = 0.0) -> dict[str, object]:
    """Like `work`, but safe to run again: the pool may re-run it on another executor."""
    if log:
        _log(log, f"start {tag} {_template()}")
    if seconds:
        time.sleep(seconds)
    return {"tag": tag, "pid": os.getpid()}
