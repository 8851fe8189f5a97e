"""Tools for tests/test_replacement_redteam.py: the first import is honest; every later one (a
replacement template) writes on the template's channel the header of a 4096-byte frame, then one
byte of it every 0.1 s (at most 30 s), leaving ``trickling`` in the working directory first."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

from executor import tool

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
with open("imports") as _f:
    _number = len(_f.read().split())


def _channel() -> socket.socket:
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                return socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
    raise RuntimeError("replace_trickle: no channel found")


if _number >= 2:
    _chan = _channel()
    _chan.sendall(struct.pack("!I", 4096))
    with open("trickling", "a") as _t:
        _t.write(f"{os.getpid()}\n")
    _deadline = time.monotonic() + 30
    while time.monotonic() < _deadline:
        try:
            _chan.sendall(b"\xc0")
        except OSError:
            break
        time.sleep(0.1)
    os._exit(0)


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x
