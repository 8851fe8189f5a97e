"""The template keeper (``TemplateKeeper``): starts the template process, replaces it when it dies,
backs off when a replacement cannot start, and stops it. One small state machine (``Phase``), driven
by the supervisor's loop through the worker pool (``executor.pool``), which owns the workers. It
bounds every start in time and bytes, lets only the template's first message turn PID namespaces
off, and never gives up on a replacement: calls queue within their bounds meanwhile. The first start
is waited for in ``start``; a replacement by the event loop (``step``/``tick``).
Why and how: docs/executor.md#the-template-keeper.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable

import zmq

from executor.workers import framing, pidns, procfs, spawn
from executor.workers.channel import (
    ChannelError,
    Configure,
    Isolated,
    LoadFailed,
    TemplateMessage,
    ToolsLoaded,
    template_message,
)
from executor.workers.processes import SHUTDOWN_WAIT, kill_children
from executor.workers.worker import WorkerConfig
from protocol import ToolSpec
from protocol.errors import CiaynError
from protocol.timing import backoff

log = logging.getLogger("ciayn-executor")

TEMPLATE_START_TIMEOUT = 60.0  # importing tool modules may be slow (the bound is for the whole report)
NAMESPACE_WAIT = 10.0  # a new template's first word (``Isolated``): setting a PID namespace up is quick
ISOLATED_LIMIT = 64 * 1024  # ``Isolated`` or the namespace's failure: a few bytes
TOOLS_LOADED_LIMIT = 16 * 1024 * 1024  # the tool specs (each spec's schema), far below the internal frame cap
TEMPLATE_READ_TIMEOUT = 0.5  # a message begun on its channel must be complete within this
RESTART_INITIAL = 0.5  # a replacement template that could not start: the next try this much later...
RESTART_MAX = 30.0  # ...doubling up to this
KILL_GRACE = 1.0  # after SIGKILL, how long to wait for a process's exit before going on without it
REPLACE_WAIT = 0.25  # how long replacing (or a failed start) waits for the old template's tree to die
STOP_WAIT = 2.0  # at shutdown, how long the template gets to exit on its channel's EOF
MAX_SAID_CHARS = 500  # of what a template's malformed report made pydantic say, in the log


class Phase(enum.Enum):
    STOPPED = "stopped"
    HELD = "held"
    ISOLATING = "setting its PID namespace up"
    IMPORTING = "importing the tools"
    SERVING = "serving"
    BACKING_OFF = "backing off"


class StartupError(CiaynError):
    """The executor cannot start (tool modules fail to import, endpoint in use, ...)."""


class StartStopped(StartupError):
    """The start was ended from outside while the tools were imported (a signal, the parent's exit)."""


class TemplateKeeper:
    """The template process: its channel, its phase and the timers of its start and restart."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.phase = Phase.STOPPED
        self.pid = 0
        self.channel: socket.socket | None = None  # to send it Spawn and Sweep (SERVING)
        self.fd = -1
        self.poller: zmq.Poller | None = None  # the supervisor's, once attached
        self.specs: dict[str, ToolSpec] = {}  # the tools the first template reported (kept across replacements)
        self.checked: frozenset[str] = frozenset()  # of those, the ones whose workers check their arguments
        self.cgroups = ""  # what control groups the template found, for the log
        self.host_pids: pidns.HostPids | None = None  # its workers' host pids, when it has a namespace
        self.deadline = 0.0  # ISOLATING/IMPORTING: the start's; BACKING_OFF: the next try's
        self.within = 0.0  # the bound the deadline came from, for the error
        self.reader: framing.Reader | None = None
        self.pid_ns = ""  # why it is not PID 1 of a namespace of its own ("" when it is)
        self.pid_ns_warned = False
        self.start_failures = 0  # replacements that could not start, since one last did
        self.restarts = 0
        self.made_worker = False  # it has forked a worker since it loaded the tools

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING and self.channel is not None

    @property
    def starting(self) -> bool:
        return self.phase in (Phase.ISOLATING, Phase.IMPORTING)

    def due(self, now: float) -> float:
        """Seconds until ``tick`` is needed (a start's deadline, the next try), or inf."""
        return self.deadline - now if self.starting or self.phase is Phase.BACKING_OFF else float("inf")

    # ---------------------------------------------------------------- start

    def hold(self, forked: tuple[int, socket.socket]) -> None:
        """Take as ours (to configure with ``start``, or to stop) the template ``serve`` started
        (``executor.workers.spawn.fork_template``): it waits for its ``Configure`` and has read no
        tool module yet."""
        self.pid, self.channel = forked
        self.phase = Phase.HELD

    def start(self, watch: dict[int, Callable[[], str]] | None = None) -> None:
        """Start the first template and wait until it has loaded the tools: the executor serves
        nothing before. ``watch``: descriptors that end the wait when readable (a signal's wakeup
        pipe, the parent's pidfd), each with a function that says why ("" to go on): raises
        ``StartStopped``. Raises ``StartupError`` when the start fails."""
        self._begin()
        poller = select.poll()
        for fd in (self.fd, *(watch or {})):
            poller.register(fd, select.POLLIN)
        while self.starting:
            left = self.deadline - time.monotonic()
            ready = {fd for fd, _ in poller.poll(max(0, int(left * 1000) + 1))} if left > 0 else set()
            for fd, why in (watch or {}).items():
                if fd in ready and (reason := why()):
                    self._end_start()
                    raise StartStopped(reason)
            if self.fd in ready:
                fd = self.fd
                self._step()
                if self.starting and self.fd != fd:  # a new template (no namespace)
                    poller.unregister(fd)
                    poller.register(self.fd, select.POLLIN)
            elif left <= 0:
                self._expired()

    def step(self) -> bool:
        """A replacement's channel is readable: go on with its start; True once it is serving. A
        start that fails is tried again later (``BACKING_OFF``)."""
        try:
            self._step()
        except StartupError as e:
            self._failed(e)
        return self.serving

    def tick(self, now: float, stopping: bool = False) -> None:
        """The start's deadline, or the next try's."""
        if self.phase is Phase.BACKING_OFF and now >= self.deadline and not stopping:
            self._restart()
        elif self.starting and now >= self.deadline:
            try:
                self._expired()
            except StartupError as e:
                self._failed(e)

    def discard(self) -> None:
        """The template died or stopped answering: close its channel and kill it, first (the pool
        then answers what it owed and calls ``replace``)."""
        self._drop_channel()
        self._kill(wait=REPLACE_WAIT)

    def replace(self, why: str) -> None:
        """Start another template after ``discard``, or, if the last one died before it made a worker
        (a tool module that breaks every fork, say), count it as a start that failed and back off."""
        self.restarts += 1
        if not self.made_worker:
            self._failed(StartupError(f"the last template {why} before it made a worker"))
        else:
            self.start_failures = 0
            self._restart()

    def _begin(self) -> None:
        """Take the held template, or start a new one (``executor.workers.spawn``), and wait for its
        first message. Raises ``StartupError`` when the fork fails."""
        if self.phase is not Phase.HELD or self.channel is None:
            try:
                self.pid, self.channel = spawn.fork_template(confined=self.config.confinement is not None)
            except OSError as e:  # fork(): out of processes or memory
                raise StartupError(f"cannot fork the tool template: {e}") from None
        self.fd = self.channel.fileno()
        self.phase, self.within = Phase.ISOLATING, NAMESPACE_WAIT
        self.deadline = time.monotonic() + NAMESPACE_WAIT
        self.reader = framing.Reader(self.channel, ISOLATED_LIMIT, one=True)
        if self.poller is not None:
            self.poller.register(self.fd, zmq.POLLIN)

    def _step(self) -> None:
        """The starting template's channel is readable. Its first message, sent before it reads its
        ``Configure`` and so before any tool code runs, says whether it has a PID namespace of its
        own: only that one can turn namespaces off. Then the tools are imported, within
        ``TEMPLATE_START_TIMEOUT`` for the whole of it (a template trickling bytes cannot stretch
        it), and their report is read with bounds on its size and its decoding. Raises
        ``StartupError`` (the template killed) if the start fails."""
        assert self.reader is not None and self.channel is not None
        doing = self.phase.value
        try:
            frames, closed = self.reader.feed()
            msg = template_message(frames[0]) if frames else None
        except (framing.FrameError, ChannelError) as e:
            self._end_start()
            raise StartupError(f"the tool template sent a bad message while {doing}: {e}") from None
        if msg is None:
            if closed:
                self._end_start()
                raise StartupError(f"the tool template process died while {doing}")
            return
        if self.phase is Phase.ISOLATING:
            self._isolated(msg)
        else:
            self._loaded(msg)

    def _isolated(self, msg: TemplateMessage) -> None:
        assert self.channel is not None
        if isinstance(msg, LoadFailed) and msg.message.startswith(pidns.FAILED) and not pidns.refused():
            self._end_start()  # it cannot set its namespace up: run templates in ours, saying so
            pidns.refuse(msg.message.removeprefix(pidns.FAILED))
            self._begin()  # (once: pidns.refused() now, so no new template tries a namespace)
            return
        if not isinstance(msg, Isolated):
            self._end_start()
            raise StartupError(f"the tool template could not start: {_said(msg)}")
        self.pid_ns = msg.pid_ns
        confined = self.config.confinement
        configure = Configure(worker=self.config.to_wire(), confinement=confined.to_wire() if confined else None,
                              log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                              sys_path=list(sys.path))
        with contextlib.suppress(OSError):  # it died at once: its EOF comes next
            self.channel.settimeout(TEMPLATE_READ_TIMEOUT)
            framing.send(self.channel, configure.to_wire())
        self.phase, self.within = Phase.IMPORTING, TEMPLATE_START_TIMEOUT
        self.deadline = time.monotonic() + TEMPLATE_START_TIMEOUT
        self.reader = framing.Reader(self.channel, TOOLS_LOADED_LIMIT, one=True)

    def _loaded(self, msg: TemplateMessage) -> None:
        if not isinstance(msg, ToolsLoaded):  # a LoadFailed, whatever its text says, is only that
            self._end_start()
            raise StartupError(_said(msg))
        try:  # what tool code in the template may have written: its failure is the start's, never ours
            specs = {s["name"]: ToolSpec.model_validate(s) for s in msg.specs}
        except (TypeError, KeyError, ValueError) as e:  # (pydantic's ValidationError is a ValueError)
            self._end_start()
            raise StartupError(f"the tool template reported specs that are not tool specs: {type(e).__name__}: "
                               f"{str(e)[:MAX_SAID_CHARS]}") from None
        self.host_pids = None
        if not self.pid_ns:  # PID 1 of its own namespace: it names its workers by their pids there
            template = pidns.template_in(self.pid)
            if not template:
                pid = self.pid
                self._end_start()
                raise StartupError("the template says it is PID 1 of a namespace of its own, but no such child is "
                                   f"under process {pid}")
            self.host_pids = pidns.HostPids(template)
        if self.pid_ns and not self.pid_ns_warned:
            self.pid_ns_warned = True
            log.warning("workers run in the executor's own PID namespace (%s): a tool can signal the executor's "
                        "processes and every other process of its user; run as root, allow unprivileged user "
                        "namespaces, or use --profile hardened", self.pid_ns)
        if self.specs and specs != self.specs:
            log.warning("the new template's tools differ from the first one's; keeping the first list")
        else:
            self.specs, self.checked = specs, frozenset(msg.checked) & specs.keys()
        self.cgroups = msg.cgroups
        self.phase, self.reader = Phase.SERVING, None
        if self.restarts:
            log.info("the new template has loaded the tools")
        self.made_worker = False

    def _expired(self) -> None:
        doing, within = self.phase.value, self.within
        self._end_start()
        raise StartupError(f"the tool template was still {doing} after {within:g} s; it was killed")

    def _end_start(self) -> None:
        """A start that failed or was stopped: its template is killed (with, where it had no PID
        namespace to take them along, what its tool modules started), and its channel closed."""
        self._kill(wait=REPLACE_WAIT)
        self._drop_channel()
        kill_children(wait=REPLACE_WAIT)  # its orphans came to us (this process is a subreaper)

    def _failed(self, e: StartupError) -> None:
        """A replacement could not start: try again later, never stop for it (calls wait in the
        queue meanwhile, within their timeouts and ``--max-queue-wait``)."""
        wait = backoff(self.start_failures, RESTART_INITIAL, RESTART_MAX)
        self.start_failures += 1
        self.phase, self.deadline = Phase.BACKING_OFF, time.monotonic() + wait
        log.error("cannot start a new template (attempt %d): %s; trying again in %.1f s", self.start_failures, e,
                  wait)

    def _restart(self) -> None:
        """Start a replacement (waited for by the loop); a fork that fails is tried again."""
        try:
            self._begin()
        except StartupError as e:
            self._failed(e)

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """Shut the template down: it kills what is left and exits on its channel's EOF (a held one
        at once); one that does not within ``STOP_WAIT`` is killed."""
        if self.starting:  # it is importing the tools, and would read its EOF only after
            self._end_start()
        self._drop_channel()
        if self.pid:
            deadline = time.monotonic() + STOP_WAIT
            while time.monotonic() < deadline:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    break
                if procfs.exiting(self.pid):
                    # The init of the workers' PID namespace stays in its exit until the kernel has
                    # killed everything in it: one that SIGKILL cannot stop yet (frozen, uninterruptible)
                    # holds it there. It is on its way; as our child it is reaped when it is done.
                    break
                time.sleep(0.01)
            else:
                self._kill()
            self.pid = 0
        kill_children(wait=SHUTDOWN_WAIT)  # as a subreaper we hold whatever the template's tree left behind

    def _drop_channel(self) -> None:
        """Close our end of the template's channel (the template sees EOF)."""
        self.phase = Phase.STOPPED
        self.reader = None
        if self.channel is not None:
            if self.poller is not None:
                with contextlib.suppress(KeyError, zmq.ZMQError):
                    self.poller.unregister(self.fd)
            self.channel.close()
            self.channel = None

    def _kill(self, wait: float = KILL_GRACE) -> None:
        """SIGKILL the template and reap it, waiting at most ``wait`` (one that SIGKILL cannot stop
        yet, frozen or in uninterruptible sleep, is left; as our child it is reaped when it dies)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + wait
            with contextlib.suppress(ChildProcessError):
                while not os.waitpid(self.pid, os.WNOHANG)[0] and time.monotonic() < deadline:
                    time.sleep(0.005)
            self.pid = 0


def _said(msg: TemplateMessage) -> str:
    """A template's message where another was due, for an error."""
    return msg.message if isinstance(msg, LoadFailed) else f"unexpected {msg.OP!r} message"
