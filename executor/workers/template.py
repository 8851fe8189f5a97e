"""Entry of a template started afresh: ``python -P -m executor.workers.template CHANNEL_FD SUPERVISOR_PID``.

The first template is forked from the supervisor before it has read a key or a call. A template
that replaces a dead or wedged one is not: by then the supervisor's memory holds other clients'
calls and results (freed, not overwritten) and its CurveZMQ keys, and every worker forked from a
fork of it could read them in its own address space. So the supervisor forks only to exec this
module: a new interpreter whose memory never held any of it. It reads its configuration
(``Configure``) from the channel and goes on as the first template did (``template_main``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from executor.workers import confinement, framing
from executor.workers.channel import ChannelError, Configure
from executor.workers.privacy import not_dumpable, scrub_initial_environment
from executor.workers.processes import PR_SET_PDEATHSIG, prctl
from executor.workers.worker import WorkerConfig, template_main

CONFIGURE_TIMEOUT = 10.0  # seconds to wait for the supervisor's Configure (it sends it right after the fork)


def main(argv: list[str]) -> None:
    fd, supervisor = int(argv[0]), int(argv[1])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() not in (supervisor, 0):  # it died before we could ask to die with it (0: we are
        os._exit(1)                           # PID 1 of our own namespace; then its channel says so)
    not_dumpable()  # exec made us dumpable again: no ptrace or /proc/PID/mem of us by a tool of our user
    scrub_initial_environment()
    chan = socket.socket(fileno=fd)
    chan.settimeout(CONFIGURE_TIMEOUT)
    try:
        config = Configure.from_wire(framing.recv(chan))
    except (EOFError, OSError, framing.FrameError, ChannelError) as e:
        print(f"ciayn-executor: template: no configuration from the supervisor ({e})", file=sys.stderr)
        os._exit(1)
    chan.settimeout(None)
    if config.sys_path:
        sys.path[:] = config.sys_path  # the first template's, for the tools it imports
    logging.basicConfig(stream=sys.stderr, level=config.log_level,
                        format=f"%(asctime)s ciayn-executor[{supervisor}] template %(levelname)s %(message)s")
    confined = confinement.from_wire(config.confinement) if config.confinement is not None else None
    template_main(chan, WorkerConfig.from_wire(config.worker, confined))


if __name__ == "__main__":
    main(sys.argv[1:])
