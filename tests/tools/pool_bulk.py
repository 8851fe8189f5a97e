"""A tool module for the broker's result-cache tests: `bulk` answers with a large value, so that a
few calls fill a small cache, and leaves a line in a side-effect log each time it runs."""

from __future__ import annotations

import os

from executor import tool


@tool(timeout=30)
def bulk(tag: str, log: str, kib: int = 64) -> str:
    """Record `tag` in the side-effect log `log` and answer `kib` KiB of text."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{tag} {os.getppid()}\n".encode())  # one write with O_APPEND: lines never interleave
    finally:
        os.close(fd)
    return tag + "." * (kib * 1024)
