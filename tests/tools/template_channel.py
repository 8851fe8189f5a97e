"""Shared by the tool modules of the start-up and replacement red teams (``startup_*.py``,
``replace_*.py``): imported at a template's import of those modules, these write on the template's
channel to the supervisor, as a hostile tool module would. Not a tool module itself.

A tool module loaded by path finds this file beside it with::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from template_channel import channel
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time


def channel() -> socket.socket:
    """The template's channel to the supervisor: the first socket among its descriptors past 2."""
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                return socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
    raise RuntimeError("template_channel: no channel found")


def trickle(mark: str, seconds: float, every: float) -> None:
    """Write the header of a 4096-byte frame, leave ``mark`` (with our pid) in the working directory,
    then one byte of the frame every ``every`` seconds for at most ``seconds``; then exit."""
    chan = channel()
    chan.sendall(struct.pack("!I", 4096))
    with open(mark, "a") as f:
        f.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chan.sendall(b"\xc0")
        except OSError:
            break
        time.sleep(every)
    os._exit(0)
