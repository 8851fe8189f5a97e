"""Tools for tests/test_startup_redteam.py: at import, in a template that is PID 1 of a PID namespace
of its own, this module writes on the template's channel to the supervisor (the one socket among its
descriptors) the message a template sends when it could not set its namespace up
(``LoadFailed("pid-ns: ...")``), and waits to be killed. A template without a namespace imports it
as an ordinary tool module. The tools say which PID namespace the worker is in and whether it can
signal a given process (the supervisor)."""

from __future__ import annotations

import os
import sys
import time

from executor import tool
from executor.workers import framing, pidns
from executor.workers.channel import LoadFailed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import channel

if pidns.in_own_namespace():
    with open("forged", "a") as _f:
        _f.write(f"{os.getpid()}\n")
    framing.send(channel(), LoadFailed(message=pidns.FAILED + "mounting /proc: forged by a tool module").to_wire())
    _deadline = time.monotonic() + 30  # the supervisor SIGKILLs us now
    while time.monotonic() < _deadline:
        time.sleep(0.01)


@tool
def pid_ns() -> str:
    """The worker's PID namespace (``/proc/self/ns/pid``)."""
    return os.readlink("/proc/self/ns/pid")


@tool
def can_signal(pid: int) -> bool:
    """Whether this worker may send a signal to process ``pid`` (signal 0: nothing is delivered)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
