"""Entry of the template: ``python -P -m executor.workers.template CHANNEL_FD SUPERVISOR_PID``.

Every template is a new interpreter (``executor.workers.spawn``): its memory never held the
supervisor's modules, keys or other clients' calls and results, which every worker forked from it
would otherwise map. It reads its configuration (``Configure``) from the channel and goes on in
``template_main``. A supervisor whose start was refused before it configured us closes the channel:
then it exits quietly, having read no tool module.
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

CONFIGURE_TIMEOUT = 120.0  # seconds to wait for the supervisor's Configure (the first: while the supervisor starts)


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
    except EOFError:
        os._exit(0)
    except (OSError, framing.FrameError, ChannelError) as e:
        print(f"ciayn-executor: template: no configuration from the supervisor ({e})", file=sys.stderr)
        os._exit(1)
    chan.settimeout(None)
    if config.sys_path:
        sys.path[:] = config.sys_path  # the supervisor's, for the tools it imports
    logging.basicConfig(stream=sys.stderr, level=config.log_level,
                        format=f"%(asctime)s ciayn-executor[{supervisor}] template %(levelname)s %(message)s")
    confined = confinement.from_wire(config.confinement) if config.confinement is not None else None
    template_main(chan, WorkerConfig.from_wire(config.worker, confined))


if __name__ == "__main__":
    main(sys.argv[1:])
