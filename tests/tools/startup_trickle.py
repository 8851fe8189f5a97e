"""Tools for tests/test_startup_redteam.py: at import this module writes on the template's channel
the header of a frame of 4096 bytes, then one byte of it every 0.2 s (at most 60 s in all), so
the supervisor, reading the template's first message, always has had a byte lately but never a
whole message. ``trickling`` in the working directory says it began."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

from executor import tool


def _channel() -> socket.socket:
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                return socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
    raise RuntimeError("startup_trickle: no channel found")


_chan = _channel()
_chan.sendall(struct.pack("!I", 4096))
with open("trickling", "w") as _f:
    _f.write(f"{os.getpid()}\n")
_deadline = time.monotonic() + 60
while time.monotonic() < _deadline:
    try:
        _chan.sendall(b"\xc0")
    except OSError:
        break
    time.sleep(0.2)
os._exit(0)


@tool
def never() -> None:
    """Never served."""
