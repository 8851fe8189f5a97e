"""The supervisor: one event loop, one thread, never runs tool code.

It wires three parts together: the side facing clients (``executor.clientside``: a bound ROUTER, or a
link to a broker), the call table (``executor.calls``: at-most-once, the queue) and the worker pool
(``executor.pool``: the template and the workers). It answers ``hello`` and ``ping`` at any time,
checks each call against the tool specs before queueing it, and sends every finished call's result to
everyone waiting for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from executor.calls import MAX_QUEUE_BYTES, MAX_QUEUE_WAIT, CallTable, Job, fingerprint
from executor.clientside.base import ClientSide, EndpointError
from executor.clientside.brokerlink import BrokerLink
from executor.clientside.router import RouterEndpoint
from executor.keeper import StartStopped, StartupError
from executor.metrics import CallStats, MetricsServer
from executor.pool import WorkerPool
from executor.slot import TEND_WHILE_SPINNING
from executor.workers.confinement import Confinement
from executor.workers.limits import WorkerLimits
from executor.workers.privacy import not_dumpable, scrub_initial_environment
from executor.workers.spawn import enter_workspace, fork_template
from executor.workers.worker import WorkerConfig
from protocol import (
    BindError,
    Call,
    Cancel,
    ExecutorStatus,
    Hello,
    Limits,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Report,
    Result,
    Status,
    ToolSpec,
    Welcome,
    encode,
)
from protocol.curve import CurveError, load_pair, load_public
from protocol.messages import MAX_TIMEOUT_S, effective_limits, requested_timeout
from protocol.timing import APPLY_GRACE, HELD_RECENT
from protocol.wire import LogBudget

log = logging.getLogger("ciayn-executor")

__all__ = ["StartupError", "Supervisor"]


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``ciayn-executor serve`` was told (``executor.cli`` builds it from the command line):
    what to serve, where, with what limits and isolation. ``workspace`` is an absolute path."""

    tools: list[str]
    endpoint: str  # to bind, or with ``connect`` the broker's backend to connect to
    limits: Limits
    max_timeout: float = MAX_TIMEOUT_S  # a ceiling on every call's timeout, whoever set it (--max-timeout)
    workers: int = 1
    max_queue: int = 256
    max_queue_mb: int = MAX_QUEUE_BYTES // 1024**2
    max_queue_wait: float = MAX_QUEUE_WAIT
    workspace: str | None = None
    parent_pid: int | None = None
    profile: str = "default"
    use_cgroups: bool = True
    reuse_workers: bool = False
    pass_env: tuple[str, ...] = ()
    connect: bool = False
    curve_secret: str | None = None
    curve_clients: str | None = None
    curve_server_key: str | None = None
    insecure: bool = False
    metrics: str | None = None  # [HOST:]PORT of the Prometheus endpoint
    confinement: Confinement | None = None  # --profile hardened: its sandbox (``executor.sandbox.profile.Sandbox``)


class Supervisor:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics: MetricsServer | None = None
        self.stats = CallStats()
        self.started = time.monotonic()
        self.executor_id = uuid.uuid4().hex[:12]
        self.incarnation = time.time_ns() // 1000 % (1 << 53)  # distinct across restarts
        self.calls = CallTable(config.max_queue, max_queue_bytes=config.max_queue_mb * 1024**2,
                               max_wait=config.max_queue_wait)
        workers = WorkerConfig(targets=config.tools, limits=WorkerLimits.of(config.limits), name=self.executor_id,
                               use_cgroups=config.use_cgroups, reuse=config.reuse_workers,
                               pass_env=list(config.pass_env), confinement=config.confinement)
        self.pool = WorkerPool(workers, size=config.workers, on_done=self._finish, next_job=self.calls.next_queued,
                               requeue=self.calls.requeue, queued=lambda: len(self.calls.queue))
        self.clients: ClientSide | None = None
        self.complaints = LogBudget(log, "protocol errors from clients")  # a flood of bad messages, a bounded log
        self.stopping = False
        self.exit_code = 0  # 1 when it stops because it cannot go on (its client side failed)
        self.stopped_by = ""  # the signal that asked it to stop

    # ---------------------------------------------------------------- start-up and shutdown

    def serve(self) -> int:
        parent_fd = self._watch_parent()  # first: a dead parent must not leave a socket file behind
        enter_workspace(self.config.workspace)
        not_dumpable()  # no ptrace, /proc/PID/mem or pidfd_getfd of our processes by a tool of our user
        scrub_initial_environment()  # nor the environment we started with, through /proc/PID/environ
        # The template (a new interpreter) starts while we open the endpoint, and waits for its Configure.
        template = fork_template(confined=self.config.confinement is not None)
        # A signal or the parent's exit from now on, the import included, is a shutdown that removes
        # what was made (the socket file first), never Python's default death.
        wake_r = _wake_on_signals(self._on_signal)
        watch = {wake_r: lambda: self._signalled(wake_r)}
        if parent_fd is not None:
            watch[parent_fd] = lambda: f"parent process {self.config.parent_pid} exited"
        ctx = zmq.Context()
        try:
            self._start(ctx, template, watch)
        except StartStopped as e:
            log.info("stopped while the tools were imported: %s", e)
            return 0
        assert self.clients is not None
        self.clients.start()  # a link announces itself to its broker: with the tools known now
        poller = zmq.Poller()
        for fd in (self.clients.socket, wake_r, parent_fd):
            if fd is not None:
                poller.register(fd, zmq.POLLIN)
        self.pool.attach(poller)
        log.info("%s", _serving(self.config, self.pool, self.clients))
        try:
            self._loop(poller, wake_r, parent_fd)
        finally:
            self._shutdown(ctx)
        return self.exit_code

    def _start(self, ctx: zmq.Context[Any], template: tuple[int, socket.socket],
               watch: dict[int, Callable[[], str]]) -> None:
        """Every part of the start that can be refused (keys, addresses, the metrics port), then the
        template's import of the tools: a start refused is refused before any tool module was read
        (their import-time code would have run on this machine for an executor that never served).
        A refusal undoes what was made and raises ``StartupError`` (``StartStopped``: a signal)."""
        held: tuple[int, socket.socket] | None = template
        try:
            self.clients = self._open_clients(ctx)
            if self.config.metrics:
                self.metrics = MetricsServer(self.config.metrics)
            self.pool.hold(template)
            held = None
            self.pool.start_template(watch)  # the tools are imported now
        except (EndpointError, CurveError, ValueError, StartupError) as e:
            if self.metrics is not None:
                self.metrics.close()
            if self.clients is not None:
                self.clients.close()
            if held is not None:
                _dismiss(held)
            else:
                self.pool.stop_template()
            ctx.term()
            if isinstance(e, StartStopped):
                raise
            raise StartupError(str(e)) from None

    def _open_clients(self, ctx: zmq.Context[Any]) -> ClientSide:
        c = self.config
        if not c.connect:
            return RouterEndpoint(ctx, c.endpoint, curve_secret=c.curve_secret, curve_clients=c.curve_clients,
                                  insecure=c.insecure)
        server_key = load_public(c.curve_server_key) if c.curve_server_key else None
        keys = load_pair(c.curve_secret) if c.curve_secret else None
        return BrokerLink(ctx, c.endpoint, announce=self._ready, applying=self._applying,
                          curve_server_key=server_key, curve_keys=keys, insecure=c.insecure)

    def _applying(self) -> list[str]:
        """Calls whose keeper said they answered and their workspace writes are being applied: the
        broker gives them its apply grace past their deadline (heartbeat ``applying``)."""
        return self.pool.applying()

    def _ready(self) -> Ready:
        """What a linked executor announces to the broker on every (re)connection."""
        held = list(self.calls.jobs) + list(self.calls.cache)[-HELD_RECENT:]
        return Ready(executor=self.executor_id, incarnation=self.incarnation, tools=list(self.pool.specs.values()),
                     limits=self.config.limits, capacity=self.pool.size, profile=self.config.profile, held=held,
                     apply_grace_s=self._apply_grace(), max_timeout_s=self.config.max_timeout)

    def _apply_grace(self) -> float:
        """What a call's answer may take past its timeout: its workspace writes being applied."""
        return APPLY_GRACE if self.pool.keeps_workspace else 0.0

    def report(self, now: float) -> Report:
        """The answer to ``status`` (and what ``--metrics-port`` exports)."""
        me = ExecutorStatus(executor=self.executor_id, incarnation=self.incarnation, tools=sorted(self.pool.specs),
                            capacity=self.pool.size, busy=self.pool.busy(), queued=len(self.calls.queue),
                            served=self.stats.served, worker_restarts=self.stats.worker_restarts,
                            max_timeout_s=self.config.max_timeout)
        return Report(role="executor", id=self.executor_id, incarnation=self.incarnation,
                      uptime_s=round(now - self.started, 3), capacity=me.capacity, busy=me.busy, queued=me.queued,
                      served=me.served, worker_restarts=me.worker_restarts, max_timeout_s=self.config.max_timeout,
                      executors=[me],
                      tools=self.stats.tool_stats())

    def _watch_parent(self) -> int | None:
        if not self.config.parent_pid:
            return None
        try:
            return os.pidfd_open(self.config.parent_pid)
        except ProcessLookupError:
            raise StartupError(f"parent process {self.config.parent_pid} is not running") from None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        self.stopped_by = signal.Signals(signum).name

    def _signalled(self, wake_r: int) -> str:
        """While the tools are imported: the wakeup pipe was written; why to stop, or "" to go on."""
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 4096)
        return self.stopped_by if self.stopping else ""

    def _shutdown(self, ctx: zmq.Context[Any]) -> None:
        log.info("shutting down")
        for job in list(self.calls.jobs.values()):
            self._finish(job, Result.failure(job.call_id, "cancelled", "the executor is shutting down"))
        self.pool.stop()
        if self.clients is not None:
            self.clients.close()
        if self.metrics is not None:
            self.metrics.close()
        ctx.term()

    # ---------------------------------------------------------------- the loop

    def _loop(self, poller: zmq.Poller, wake_r: int, parent_fd: int | None) -> None:
        assert self.clients is not None
        sock = self.clients.socket
        tended = -math.inf
        while not self.stopping:
            # Right after handing a call to a worker, poll without sleeping for a moment: a quick
            # call's reply is then read without the cost of waking this process up again. Those
            # turns only serve the descriptors; the timers are tended at most every TEND_WHILE_SPINNING.
            now = time.monotonic()
            if self.pool.spinning(now) and now < tended + TEND_WHILE_SPINNING:
                wait_ms = 0
            else:
                tended = now
                wait_ms = self._tend(now)
                if self.stopping:
                    break
            ready = poller.poll(wait_ms)
            if not ready:
                continue
            events = dict(ready)
            if wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            if parent_fd is not None and parent_fd in events:
                log.info("parent process %d exited; stopping", self.config.parent_pid)
                return
            self.pool.handle(events)
            if sock in events:
                self._on_clients()

    def _tend(self, now: float) -> int:
        """The timers: deadlines, heartbeats, calls that waited too long, the metrics; returns how
        long the loop may sleep (ms)."""
        assert self.clients is not None
        self.pool.check_deadlines(now)
        self.complaints.flush(now)  # say how many were not logged once the window is over
        due = min(self.pool.timeout_s(now), self.clients.tick(now), self._expire_queued(now))
        if self.clients.failed:
            self.stopping, self.exit_code = True, 1
            return 0
        if self.metrics is not None and self.metrics.due(now):
            self.metrics.publish(self.report(now), now)
            due = min(due, 1.0)
        return 0 if self.pool.spinning(now) else max(0, int(due * 1000) + 1)

    # ---------------------------------------------------------------- client messages

    def _on_clients(self) -> None:
        assert self.clients is not None
        for route, msg in self.clients.receive():
            if isinstance(msg, ProtocolError):
                self.complaints.warning("protocol error from client %s: %s", route.hex()[:8], msg)
                self._send(route, msg.reply())
            elif isinstance(msg, Call):
                self._on_call(route, msg)
            elif isinstance(msg, Ping):
                self._send(route, Pong(nonce=msg.nonce, executor=self.executor_id, incarnation=self.incarnation,
                                       busy=self.pool.busy(), queued=len(self.calls.queue)))
            elif isinstance(msg, Hello):
                self._send(route, Welcome(executor=self.executor_id, incarnation=self.incarnation,
                                          tools=list(self.pool.specs.values()), limits=self.config.limits,
                                          workers=self.pool.size, profile=self.config.profile,
                                          apply_grace_s=self._apply_grace(), max_timeout_s=self.config.max_timeout))
            elif isinstance(msg, Cancel):
                self._on_cancel(route, msg.id)
            elif isinstance(msg, Status):
                self._send(route, self.report(time.monotonic()))
            else:
                self._send(route, Result.failure("", "protocol", f"an executor does not accept {msg.KIND} messages"))

    @staticmethod
    def _encode(msg: Any) -> list[bytes]:
        try:
            return encode(msg)
        except ProtocolError as e:  # e.g. an oversized result: say so instead
            return encode(Result.failure(getattr(msg, "id", "") or "", "output_limit", str(e)))

    def _send(self, route: bytes, msg: Any) -> None:
        """Send a message, or frames already encoded (a cached result)."""
        assert self.clients is not None
        self.clients.send(route, msg if isinstance(msg, list) else self._encode(msg))

    def _on_call(self, route: bytes, call: Call) -> None:
        if not call.id:
            self._send(route, Result.failure("", "protocol", "a call must carry an id"))
            return
        cid = call.id
        nbytes, digest = fingerprint(call)
        seen = self.calls.seen(route, call, digest)
        if seen is not None:
            answer = "answered from cache" if seen.frames else "joined the running call" if seen.joined else "refused"
            log.info("call %s %r: duplicate id, %s", cid, call.tool[:64], answer)
            if seen.frames is not None:
                self._send(route, seen.frames)
            elif seen.refusal is not None:
                self._refuse(route, seen.refusal)
            return
        spec = self.pool.specs.get(call.tool)
        if spec is None:
            names = ", ".join(sorted(self.pool.specs))
            self._refuse(route, Result.failure(cid, "unknown_tool",
                                               f"no tool named {call.tool[:64]!r}; available: {names}"))
            return
        try:
            bound = spec.bind(call.args, call.kwargs)
            if call.tool not in self.pool.checked:  # (those: by their workers, with pydantic)
                spec.check_arguments(bound)
        except BindError as e:
            self._refuse(route, Result.failure(cid, "bad_arguments", f"{e}; signature: {spec.name}{spec.signature}"))
            return
        job = Job(call=call, call_id=cid, waiters=[route], nbytes=nbytes, digest=digest,
                  limits=effective_limits(self.config.limits, spec, call, _ceiling(self.config, call)))
        refusal = self.calls.admit(job, time.monotonic())
        if refusal is not None:
            self._refuse(route, refusal)
            return
        self.pool.dispatch()  # what waited too long in the queue is answered on the loop's next turn

    def _refuse(self, route: bytes, result: Result) -> None:
        """Answer a call that is not run; refusals are not remembered (SPEC.md section 8)."""
        result.executor = self.executor_id
        self._send(route, result)

    def _expire_queued(self, now: float) -> float:
        """Answer the calls that waited in the queue past their timeout (or --max-queue-wait);
        return the seconds until the next one would."""
        due = self.calls.expire(now)
        for job, result in self.calls.take_expired():
            result.executor = self.executor_id
            log.info("call %s %s: unavailable (waited in the queue)", job.call_id, job.call.tool)
            self.stats.observe(job.call.tool, result, 0.0)
            for route in job.waiters:
                self._send(route, result)
        return due

    def _on_cancel(self, route: bytes, cid: str) -> None:
        """Only a client waiting for the call (its sender, or one that resent it) may cancel it."""
        job = self.calls.running(cid)
        if job is None or route not in job.waiters:
            return
        outcome = Result.failure(cid, "cancelled", "the call was cancelled")
        if self.calls.unqueue(job):
            self._finish(job, outcome)
        else:
            self.pool.cancel(job, outcome)

    # ---------------------------------------------------------------- answers

    def _finish(self, job: Job, result: Result) -> None:
        self.calls.done(job)
        if result.error is not None and result.error.kind == "timeout":
            _name_the_ceiling(self.config, self.pool.specs, job, result)
        frames = self._encode(result)
        self.calls.remember(result.id, frames, job.waiters[0])
        if log.isEnabledFor(logging.DEBUG):  # counts: status, metrics
            status = "ok" if result.ok else f"{result.error.kind if result.error else '?'}"
            wall = f" {result.stats.wall_s * 1000:.1f}ms" if result.stats else ""
            log.debug("call %s %s: %s%s", job.call_id, job.call.tool, status, wall)
        self.stats.observe(job.call.tool, result, result.stats.wall_s if result.stats else 0.0)
        for route in job.waiters:
            self._send(route, frames)


DISMISS_WAIT = 2.0  # seconds a template that was never configured has to exit, before SIGKILL


def _wake_on_signals(handler: Callable[[int, Any], None]) -> int:
    """SIGTERM, SIGINT and SIGHUP go to ``handler`` and wake the loop through a pipe it polls;
    returns the pipe's end to poll."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
    return wake_r


def _ceiling(config: ServeConfig, call: Call) -> float:
    """The longest ``call`` may run: ``--max-timeout``, or the call's own ``max_timeout`` (a
    broker's) if that is less."""
    return min(config.max_timeout, call.max_timeout or MAX_TIMEOUT_S)


def _name_the_ceiling(config: ServeConfig, specs: dict[str, ToolSpec], job: Job, result: Result) -> None:
    """A call that ran into a ceiling and not the timeout it asked for is told so."""
    assert result.error is not None
    spec = specs.get(job.call.tool)
    asked = requested_timeout(config.limits.timeout_s, spec, job.call)
    ceiling = _ceiling(config, job.call)
    if asked > ceiling:
        source = ("its own timeout" if job.call.timeout is not None and asked == job.call.timeout
                  else "its tool's timeout" if spec is not None and asked == spec.timeout else "the default")
        which = ("this executor runs no call longer than" if ceiling == config.max_timeout
                 else "its max_timeout (a broker's ceiling) is")
        result.error.message += f"; {source} was {asked:g} s, but {which} {ceiling:g} s (--max-timeout)"


def _serving(config: ServeConfig, pool: WorkerPool, clients: ClientSide) -> str:
    """The line that says the executor serves, and how."""
    limits = config.limits
    ceiling = f" (at most {config.max_timeout:g}s, whoever asks)" if config.max_timeout < MAX_TIMEOUT_S else ""
    return (f"serving {len(pool.specs)} tools on {clients.describe()} (workers: {pool.size} "
            f"{'reused (tools are trusted)' if pool.config.reuse else 'fresh per call'}, profile: {config.profile}, "
            f"timeout {limits.timeout_s:g}s{ceiling}, memory {limits.memory_mb} MB, cgroups: "
            f"{pool.cgroups or 'none (rlimits and subreaper only)'})")


def _dismiss(template: tuple[int, socket.socket]) -> None:
    """Stop a template held for a start refused before it was configured (an endpoint, a key, the
    metrics port): it has read no tool module and exits quietly on EOF. Closing our end with its
    first message unread would reset its read instead (ECONNRESET), which it reports as an error
    before the refusal's own reason; so our sending side is shut, what it sent read until it is
    gone, and it is reaped (killed if it does not go within ``DISMISS_WAIT``)."""
    pid, chan = template
    deadline = time.monotonic() + DISMISS_WAIT
    with contextlib.suppress(OSError):
        chan.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            chan.settimeout(left)
            if not chan.recv(65536):
                break
    chan.close()
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
