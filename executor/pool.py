"""The worker pool: the template process and the workers it forks.

At most ``size`` calls run at once. By default each worker runs one call and exits, and the pool
keeps ``size`` workers forked ahead (ready) so a call never waits for a fork at low load; with
``reuse`` (``--reuse-workers``) ``size`` workers run call after call. The pool hands a call to a
ready worker, reads the worker's stdout, stderr and reply (each bounded before it is read), enforces
the call's wall-clock deadline and output caps by killing the worker, and turns every way a worker
can die into a result of a known kind.

It also keeps the template honest: a template that dies, or that does not answer a spawn request in
time (stopped, wedged), is killed and replaced; the calls it owed are answered. A worker that does
not die when killed (uninterruptible sleep) has its call answered on time anyway and is abandoned.

It never runs tool code (the template and workers, in ``executor.workers.worker``, do) and knows nothing of
clients: finished calls go to ``on_done``, and it asks ``next_job`` for work whenever it can run some.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from executor.calls import Job
from executor.keeper import KILL_GRACE, REPLACE_WAIT, TemplateKeeper
from executor.workers import framing, pidns
from executor.workers.channel import (
    Applying,
    CallRequest,
    ChannelError,
    Exited,
    Reply,
    Spawn,
    Spawned,
    Started,
    Sweep,
    reply_cap,
    template_message,
)
from executor.workers.processes import SHUTDOWN_WAIT, kill_children
from executor.workers.worker import WorkerConfig
from protocol import ErrorInfo, Result, Signal, Stats, ToolSpec, WorkerInfo
from protocol.timing import APPLY_GRACE  # hardened --workspace-rw: what a call that answered in time gets to apply

log = logging.getLogger("ciayn-executor")

TEMPLATE_ANSWER_TIMEOUT = 3.0  # a spawn request unanswered this long: the template is stopped or wedged
EXIT_STATUS_WAIT = 2.0  # after a worker's channel closes, how long to wait for its exit status
TEMPLATE_FRAME_LIMIT = 64 * 1024  # the template's messages after start-up are tiny (Spawned, Exited)
SWEEP_INTERVAL = 0.2  # reused workers: the template kills stray children at most this often (it costs a /proc read)
START_TIMEOUT = 2.0  # a worker that does not say it started a call this long after getting it is replaced
RETIRE_GRACE = 2.0  # a worker that answered its one call must exit within this, or it is killed
IDLE_READ_LIMIT = 64 * 1024  # what a worker with no call may send before it is cut off (it should send nothing)
REFILL_QUIET = 0.002  # fresh workers: a replacement is forked once the pool has been quiet this long...
REFILL_MAX_DELAY = 0.02  # ...or this long after it was first due, whichever comes first
SPIN_AFTER_DISPATCH = 0.0003  # seconds of polling without sleep after a dispatch (quick calls' replies)
POLL_MAX_S = 1.0
MAX_ABANDONED = 64  # processes that would not die, remembered for the log


@dataclass
class Slot:
    """One worker process, from the template's report that it exists to its death or retirement."""

    id: int
    pid: int
    chan: socket.socket
    reader: framing.Reader
    out_fd: int
    err_fd: int
    job: Job | None = None
    started: bool = False  # the worker said it started the job's tool (before that, the job never ran)
    applying: bool = False  # its keeper said the call answered and its writes are being applied
    start_by: float = 0.0  # when it must have said so
    closed_at: float = 0.0  # when the channel closed and we await the exit status
    killed_at: float = 0.0  # when we sent SIGKILL
    seq: int = 0  # number of the request in flight: a reply must carry it
    outbuf: bytearray = field(default_factory=bytearray)  # request bytes the worker has not taken yet

    @property
    def killed(self) -> bool:
        return self.killed_at > 0

    @property
    def idle(self) -> bool:
        return self.job is None and not self.killed and not self.closed_at


class WorkerPool:
    """The template and the workers, driven by the supervisor's poll loop."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        size: int,
        on_done: Callable[[Job, Result], None],
        next_job: Callable[[], Job | None],
        requeue: Callable[[Job], None] | None = None,
        queued: Callable[[], int] = lambda: 0,
    ) -> None:
        self.config = config
        self.limits = config.limits
        # --profile hardened: the layers every result names, and whether workers say ``Applying``
        self.layers = list(config.confinement.names) if config.confinement is not None else []
        self.keeps_workspace = config.confinement is not None and config.confinement.keeper
        self.executor_id = config.name
        self.size = max(1, size)
        self.on_done = on_done
        self.next_job = next_job
        self.requeue = requeue
        self.queued = queued  # how many calls wait for a worker
        self.slots: dict[int, Slot] = {}  # live workers by id
        self.spawning: dict[int, float] = {}  # worker id -> when the template was asked for it
        self.retiring: dict[int, float] = {}  # pid -> when it answered its one call (it stops or exits by itself)
        self.ended: set[int] = set()  # retiring workers we have killed (their exit is on its way)
        self.abandoned: dict[int, str] = {}  # pid -> why: killed, but it did not die
        # A pidfd for every worker process from its Spawned to its Exited (``_signal``): a kill
        # through it can never reach another process that got the same pid after the worker's end.
        self.pidfds: dict[int, int] = {}
        self.have_pidfds = False  # the template sends them (pidfd_open: Linux 5.3)
        self.next_id = 0
        self.keeper = TemplateKeeper(config)  # the template process: start, replace, back off, stop
        self.poller: zmq.Poller | None = None
        self.fd_owner: dict[int, tuple[Slot, str]] = {}
        self.spin_until = 0.0
        self.refill_at = 0.0  # fresh workers: when the deferred replacement is forked (0: none due)
        self.refill_first = 0.0  # when it first became due
        self.sweep_due = False  # reused workers: the template should kill its stray children soon
        self.swept_at = 0.0
        self.stopping = False

    # ---------------------------------------------------------------- start-up and shutdown

    @property
    def specs(self) -> dict[str, ToolSpec]:
        return self.keeper.specs

    @property
    def cgroups(self) -> str:
        return self.keeper.cgroups

    def hold(self, forked: tuple[int, socket.socket]) -> None:
        """Take the template ``serve`` forked early (``TemplateKeeper.hold``)."""
        self.keeper.hold(forked)

    def start_template(self, watch: dict[int, Callable[[], str]] | None = None) -> None:
        """Start the first template and wait until it has loaded the tools (``TemplateKeeper.start``)."""
        self.keeper.start(watch)

    def stop_template(self) -> None:
        """Stop the template (``TemplateKeeper.stop``): at shutdown, or after a refused start."""
        self.keeper.stop()

    def attach(self, poller: zmq.Poller) -> None:
        """Register with the supervisor's poller and start the workers."""
        self.poller = self.keeper.poller = poller
        if self.keeper.channel is not None:
            poller.register(self.keeper.fd, zmq.POLLIN)
        self._refill()

    def stop(self) -> None:
        self.stopping = True
        for slot in list(self.slots.values()):
            self._signal(slot.pid)
            self._close_slot(slot)
        self.keeper.stop()
        self._close_pidfds()
        self._remove_groups()

    def _remove_groups(self) -> None:
        if self.cgroups:  # the template removes its workers' groups; this is the backstop
            from executor.workers.cgroups import CgroupSupport

            support = CgroupSupport.detect()
            if support is not None:
                support.remove_named(f"{self.executor_id}-", wait=SHUTDOWN_WAIT)

    def _replace_template(self, why: str) -> None:
        """The template is gone or stopped answering: answer what it owed, kill its whole tree, start
        a new one. Calls its workers had started are lost with them (answered ``crashed``); calls
        they had not started yet go back to the queue."""
        log.error("the template process %s; replacing it", why)
        self.keeper.discard()
        for slot in list(self.slots.values()):
            self._kill(slot, "its template is gone")  # first: a killed worker runs no more code
        for slot in list(self.slots.values()):
            if slot.job is not None and not self._unstarted(slot) and slot.job is not None:
                job = slot.job
                slot.job = None
                result = job.outcome or Result.failure(
                    job.call_id, "crashed",
                    f"the executor's template process {why}; the worker running this call was killed with it")
                self._answer(job, result, slot, restarted=True)
            self._close_slot(slot)
        self.spawning.clear()
        self.retiring.clear()
        self.ended.clear()
        self._close_pidfds()  # the old template's workers are dead or abandoned: never signalled again
        kill_children(wait=REPLACE_WAIT)  # the old template's orphans came to us (what SIGKILL cannot stop is left)
        self._remove_groups()
        # The new template is waited for by the loop (``_on_template``), which goes on answering
        # pings, status and the broker meanwhile; calls wait in the queue, within their bounds.
        self.keeper.replace(why)

    # ---------------------------------------------------------------- the loop's view

    def busy(self) -> int:
        return sum(1 for s in self.slots.values() if s.job is not None)

    def ready(self) -> int:
        return sum(1 for s in self.slots.values() if s.idle)

    def spinning(self, now: float) -> bool:
        return now < self.spin_until

    def timeout_s(self, now: float) -> float:
        """How long the loop may sleep before a deadline or a wait needs it."""
        wait = POLL_MAX_S
        for slot in self.slots.values():
            if slot.job is not None and not slot.killed:
                wait = min(wait, slot.job.deadline - now)
            if slot.killed:
                wait = min(wait, slot.killed_at + KILL_GRACE - now)
            if slot.closed_at:
                wait = min(wait, slot.closed_at + EXIT_STATUS_WAIT - now)
        for asked in self.spawning.values():
            wait = min(wait, asked + TEMPLATE_ANSWER_TIMEOUT - now)
        for pid, answered in self.retiring.items():
            wait = min(wait, answered + (RETIRE_GRACE if pid in self.ended else REFILL_MAX_DELAY) - now)
        if self.refill_at:
            wait = min(wait, self.refill_at - now)
        if self.sweep_due:
            wait = min(wait, self.swept_at + SWEEP_INTERVAL - now)
        return min(wait, self.keeper.due(now))

    def handle(self, events: dict[Any, int]) -> None:
        """Serve the pool's descriptors among the poller's events: workers first, so that a reply is
        read before the template's report that its worker exited."""
        for fd, mask in list(events.items()):
            owner = self.fd_owner.get(fd) if isinstance(fd, int) else None
            if owner is None:
                continue
            slot, what = owner
            if what != "chan":
                self._on_output(slot, fd, what)
            else:
                if mask & zmq.POLLOUT:
                    self._flush(slot)
                if mask & ~zmq.POLLOUT and slot.id in self.slots:
                    self._on_worker(slot)
        if self.keeper.channel is not None and self.keeper.fd in events:
            self._on_template()

    def cancel(self, job: Job, outcome: Result) -> bool:
        """Stop a running job; its answer is ``outcome``. False if no worker runs it."""
        slot = next((s for s in self.slots.values() if s.job is job), None)
        if slot is None:
            return False
        job.outcome = outcome
        self._kill(slot, "cancelled")
        return True

    def dispatch(self) -> None:
        """Hand queued calls to ready workers, at most ``size`` running at once."""
        while self.busy() < self.size:
            slot = next((s for s in self.slots.values() if s.idle), None)
            if slot is None:
                break
            job = self.next_job()
            if job is None:
                break
            job.started = time.monotonic()
            job.deadline = job.started + job.limits.timeout_s
            slot.job = job
            slot.started, slot.start_by, slot.applying = False, job.started + START_TIMEOUT, False
            slot.seq += 1
            slot.reader.limit = reply_cap(job.limits)
            self.spin_until = time.monotonic() + SPIN_AFTER_DISPATCH
            request = CallRequest(seq=slot.seq, tool=job.call.tool, args=job.call.args, kwargs=job.call.kwargs,
                                  limits=job.limits.model_dump() if job.limits is not self.limits else None)
            slot.outbuf += framing.pack(request.to_wire())
            self._flush(slot)
        self._refill(urgent=False)

    def _refill(self, urgent: bool = True) -> None:
        """Ask the template for workers: keep ``size`` ready (fresh workers), or ``size`` in all
        (reused workers).

        Fresh workers are replaced once the pool is quiet (``REFILL_QUIET``, at most
        ``REFILL_MAX_DELAY`` late), not the moment a call takes one: forking the replacement and
        setting up its control group take the CPU the running call and its answer need (on 2 cores
        that doubled a no-op call's latency). A call that waits for a worker while none is ready
        makes the refill ``urgent``."""
        channel = self.keeper.channel if self.keeper.serving else None
        if channel is None or self.stopping:
            return
        if self.config.reuse:
            want = self.size - len([s for s in self.slots.values() if not s.killed and not s.closed_at])
        else:
            want = self.size - self.ready()
        missing = want - len(self.spawning)
        if missing > 0 and not urgent and not self.config.reuse and not (self.queued() and not self.ready()):
            now = time.monotonic()
            if not self.refill_at:
                self.refill_first = now
            self.refill_at = min(self.refill_first + REFILL_MAX_DELAY, now + REFILL_QUIET)
            return
        self.refill_at = 0.0
        self._end_retired(time.monotonic(), every=missing > 0)
        # A worker made while a call waits with none ready is needed at once: a rehearsal would only
        # delay it. One made ahead (at start, or once the pool is quiet) takes its faults before its call.
        rehearse = not self.config.reuse and not (self.queued() and not self.ready())
        for _ in range(missing):
            self.next_id += 1
            self.spawning[self.next_id] = time.monotonic()
            try:
                framing.send(channel, Spawn(worker=self.next_id, rehearse=rehearse).to_wire())
            except OSError:
                break  # the template is gone; its channel's EOF replaces it

    def check_deadlines(self, now: float) -> None:
        if self.refill_at and now >= self.refill_at:
            self._refill()
        self.keeper.tick(now, self.stopping)
        channel = self.keeper.channel if self.keeper.serving else None
        if self.sweep_due and now >= self.swept_at + SWEEP_INTERVAL and channel is not None:
            self.sweep_due, self.swept_at = False, now
            with contextlib.suppress(OSError):
                framing.send(channel, Sweep().to_wire())
        for slot in list(self.slots.values()):
            job = slot.job
            if job is not None and not slot.killed and not slot.started and now >= slot.start_by:
                # Stopped before it could read the call (a tool may SIGSTOP the workers forked ahead).
                self._kill(slot, f"it did not start call {job.call_id} within {START_TIMEOUT:g} s")
            elif job is not None and not slot.killed and now >= job.deadline:
                job.outcome = Result.failure(
                    job.call_id, "timeout",
                    f"the tool ran past its {job.asked_s:g} s time limit and was killed"
                    + (f" ({job.asked_s - job.limits.timeout_s:.2g} s of it spent waiting in the queue)"
                       if job.asked_s - job.limits.timeout_s >= 0.01 else ""))
                self._kill(slot, f"call {job.call_id} timed out")
            elif slot.killed and now >= slot.killed_at + KILL_GRACE:
                # SIGKILL has not taken effect (uninterruptible sleep): answer now, do not wait.
                self._abandon(slot, f"it did not die within {KILL_GRACE:g} s of SIGKILL")
            elif slot.closed_at and now >= slot.closed_at + EXIT_STATUS_WAIT:
                # The channel is gone but the process is not (a tool closed inherited fds): it can
                # never answer again, so kill it and let the template report its death.
                if job is not None and job.outcome is None:
                    job.outcome = Result.failure(
                        job.call_id, "crashed",
                        "the tool closed the worker's channel to the executor; the worker was killed")
                self._kill(slot, "its channel closed but it did not exit")
        self._end_retired(now)
        for pid, answered in list(self.retiring.items()):
            if now >= answered + RETIRE_GRACE:
                del self.retiring[pid]
                if pid not in self.ended:
                    log.warning("worker pid %d answered its call but did not exit; killing it", pid)
                self.ended.discard(pid)
                self._signal(pid)
        if self.keeper.serving and any(now >= t + TEMPLATE_ANSWER_TIMEOUT for t in self.spawning.values()):
            self._replace_template(f"did not answer a spawn request within {TEMPLATE_ANSWER_TIMEOUT:g} s "
                                   "(stopped or wedged)")

    # ---------------------------------------------------------------- workers

    def _on_template(self) -> None:
        assert self.keeper.channel is not None
        if self.keeper.starting:
            if self.keeper.step():
                self._refill()
            return
        try:
            raw, fds = framing.recv_with_fds(self.keeper.channel, limit=TEMPLATE_FRAME_LIMIT)
            msg = template_message(raw)
        except (EOFError, ConnectionResetError):  # (a reset: it died with data we had not read)
            self._replace_template("died")
            return
        except (OSError, framing.FrameError, ValueError) as e:  # timeout; ChannelError is a ValueError
            self._replace_template(f"sent something that is not one of its messages ({e}): did a tool write on "
                                   "its channel?")
            return
        if isinstance(msg, Spawned) and len(fds) >= 3 and (host := self._host_pid(msg.pid, fds[3:4])) <= 0:
            log.warning("worker %d (pid %d in the template's namespace) was gone before it could be used",
                        msg.worker, msg.pid)
            self.spawning.pop(msg.worker, None)
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._refill(urgent=bool(self.queued()))
            return
        elif isinstance(msg, Spawned) and len(fds) >= 3:
            self.keeper.made_worker = True
            wid = msg.worker
            self.spawning.pop(wid, None)
            if len(fds) >= 4:
                self.have_pidfds = True
                self._forget_pidfd(host)  # (a stale one: never, as its Exited closes it first)
                self.pidfds[host] = fds[3]
            chan = socket.socket(fileno=fds[0])
            slot = Slot(id=wid, pid=host, chan=chan, reader=framing.Reader(chan, IDLE_READ_LIMIT),
                        out_fd=fds[1], err_fd=fds[2])
            os.set_blocking(slot.out_fd, False)
            os.set_blocking(slot.err_fd, False)
            self.slots[wid] = slot
            for fd, what in ((chan.fileno(), "chan"), (slot.out_fd, "stdout"), (slot.err_fd, "stderr")):
                self.fd_owner[fd] = (slot, what)
                if self.poller is not None:
                    self.poller.register(fd, zmq.POLLIN)
            log.debug("worker %d ready (pid %d)", slot.id, slot.pid)
            self.dispatch()
        elif isinstance(msg, Exited):
            pid = self.keeper.host_pids.forget(msg.pid) if self.keeper.host_pids is not None else msg.pid
            if pid <= 0:
                return  # a worker that was gone before we knew it (logged then)
            self._forget_pidfd(pid)  # it is dead and reaped: its pid may be another process's now
            self.ended.discard(pid)
            if self.retiring.pop(pid, None) is not None:
                return  # a fresh worker that answered its one call and exited, as it should
            if pid in self.abandoned:
                log.warning("abandoned worker pid %d finally exited (%s)", pid, self.abandoned.pop(pid))
                return
            dead = next((s for s in self.slots.values() if s.pid == pid), None)
            if dead is not None and dead.job is not None:
                self._on_worker(dead)  # a reply it sent before it exited is still in the channel: read it first
                if dead.id not in self.slots:
                    self.retiring.pop(pid, None)
                    return
            if dead is not None:
                self._worker_gone(dead, msg.signal, msg.code, oom=msg.oom, cpu_s=msg.cpu_s, peak_rss_kb=msg.peak_rss_kb)
        for fd in fds[4:] if isinstance(msg, Spawned) else fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _host_pid(self, pid: int, pidfd: list[int]) -> int:
        """A worker's host pid from the pid the template gave (its own, in its namespace) and, where
        the template sent one, the worker's pidfd (its ``fdinfo`` names the process in our
        namespace); 0 if the worker is gone already."""
        if pidfd:
            host = pidns.pid_of_pidfd(pidfd[0])
            if host is not None:
                if host > 0 and self.keeper.host_pids is not None:
                    self.keeper.host_pids.remember(pid, host)
                return host
        return self.keeper.host_pids.of(pid) if self.keeper.host_pids is not None else pid

    def _signal(self, pid: int) -> None:
        """SIGKILL worker process ``pid``: through its pidfd, or, where the template sends none, by
        pid. Once the worker's exit has closed its pidfd the number is never signalled again:
        another process may hold it by then."""
        fd = self.pidfds.get(pid)
        if fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        elif not self.have_pidfds:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _forget_pidfd(self, pid: int) -> None:
        fd = self.pidfds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _close_pidfds(self) -> None:
        for pid in list(self.pidfds):
            self._forget_pidfd(pid)

    def _flush(self, slot: Slot) -> None:
        """Send what the worker has not taken yet, never blocking: a worker still busy (a tool that
        faked its reply) must not stall the supervisor. What is left waits for POLLOUT."""
        try:
            while slot.outbuf:
                sent = slot.chan.send(slot.outbuf, socket.MSG_DONTWAIT)
                del slot.outbuf[:sent]
        except BlockingIOError:
            pass
        except OSError:
            slot.outbuf.clear()  # the worker died; its channel's EOF will finish the job
        flags = zmq.POLLIN | (zmq.POLLOUT if slot.outbuf else 0)
        if self.poller is not None:
            with contextlib.suppress(KeyError, zmq.ZMQError, ValueError):
                self.poller.modify(slot.chan.fileno(), flags)

    def _on_output(self, slot: Slot, fd: int, what: str, running: bool = True) -> bool:
        """Read one chunk of a worker's stdout/stderr; return whether anything was read. Over the
        cap, the call's outcome becomes ``output_limit``; the worker is killed only while it is still
        ``running`` the call (once it has replied, there is nothing left to stop)."""
        job = slot.job
        cap = (job.limits if job else self.limits).max_output_kb * 1024
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._unregister(fd)
            return False
        if job is None:
            return True  # output of a process the previous call left behind: dropped
        buf = job.stdout if what == "stdout" else job.stderr
        room = cap - len(buf)
        buf += data[: max(0, room)]
        if len(data) > room and job.outcome is None:
            job.outcome = Result.failure(job.call_id, "output_limit",
                                         f"the tool wrote more than {cap // 1024} KB to {what}"
                                         + ("; it was stopped" if running else ""))
            if running:
                self._kill(slot, f"{what} over {cap // 1024} KB")
        return True

    def _drain_output(self, slot: Slot) -> None:
        """Read what the worker wrote before its reply (or death) so it lands in this call's result."""
        for fd, what in ((slot.out_fd, "stdout"), (slot.err_fd, "stderr")):
            for _ in range(4096):  # bounded: a leftover writer cannot keep us here
                if fd not in self.fd_owner or slot.job is None or slot.job.outcome is not None:
                    break
                if not self._on_output(slot, fd, what, running=False):
                    break

    def _on_worker(self, slot: Slot) -> None:
        try:
            replies, closed = slot.reader.feed()
        except framing.FrameError as e:
            replies, closed = [], True
            self._malformed(slot, e, "output_limit" if "limit" in str(e) else "crashed")
        for raw in replies:
            job = slot.job
            try:
                ack = Started.from_wire(raw)
                if ack is not None:
                    if job is None or ack.seq != slot.seq or slot.started:
                        raise ChannelError("a start that does not match the request in flight")
                    slot.started = True
                    continue
                applying = Applying.from_wire(raw) if self.keeps_workspace else None
                if applying is not None:
                    if job is None or applying.seq != slot.seq or not slot.started or slot.applying:
                        raise ChannelError("an apply notice that does not match the request in flight")
                    slot.applying = True  # once: the deadline moves at most APPLY_GRACE later
                    if not slot.killed:
                        job.deadline = max(job.deadline, time.monotonic() + APPLY_GRACE)
                    continue
                reply = Reply.from_wire(raw)
                if job is None or reply.seq != slot.seq:
                    # A reply to no request, or to another one: tool code wrote on the channel (a
                    # forged reply, then the real one). Never let it answer some other call.
                    raise ChannelError("a reply that does not match the request in flight")
                memory = reply.error is not None and reply.error.get("kind") == "memory"
                result = self._result_from_reply(job, reply)
            except (TypeError, ValueError) as e:  # ChannelError and pydantic's ValidationError are ValueErrors
                self._malformed(slot, e)  # the call is answered when the worker's death is reported
                break
            self._drain_output(slot)
            slot.job = None
            if job.outcome is not None:
                # Decided here before the reply was read (output over the cap found while draining,
                # or a deadline or cancel that raced the reply): that decision is the answer.
                result = job.outcome.model_copy(update={
                    k: getattr(result, k) for k in ("stats", "limits", "executor", "stdout", "stderr")})
            restarted = slot.killed or memory
            self._answer(job, result, slot, restarted=restarted)
            if restarted or not self.config.reuse:
                self._retire(slot)  # it exits by itself (after a reply the worker is done or must go)
                break
        if closed and slot.id in self.slots:
            self._unregister(slot.chan.fileno())
            if not slot.closed_at:
                slot.closed_at = time.monotonic()
        self.dispatch()
        if self.config.reuse:
            self.sweep_due = True  # processes a call started with CLONE_PARENT went to the template

    def _malformed(self, slot: Slot, problem: Exception, kind: str = "crashed") -> None:
        """The worker's channel carried something our worker code never sends: tool code wrote on
        it. Nothing more it says can be trusted; replace it."""
        log.error("worker %d sent a malformed message (%s); replacing it", slot.id, problem)
        if slot.job is not None and slot.job.outcome is None:
            if kind == "output_limit":
                slot.job.outcome = Result.failure(slot.job.call_id, "output_limit",
                                                  f"the worker's reply was too large ({problem}); it was killed")
            else:
                slot.job.outcome = Result.failure(
                    slot.job.call_id, "crashed",
                    "the worker sent the executor a malformed message (did the tool write to a descriptor it "
                    "inherited?); it was killed")
        self._kill(slot, "malformed message")

    def _result_from_reply(self, job: Job, reply: Reply) -> Result:
        """Build the result from a worker's reply (its fields' types already checked by
        ``Reply.from_wire``). The error and signals are validated as protocol values, since tool code
        shares the worker's process; what the supervisor knows itself is not. This runs on every
        call, so it avoids validating twice."""
        error = None if reply.ok else ErrorInfo.model_validate(reply.error)
        stats = Stats(wall_s=reply.wall_s, cpu_s=reply.cpu_s, peak_rss_kb=reply.peak_rss_kb)
        return Result.model_construct(
            id=job.call_id,
            ok=reply.ok,
            value=reply.value,
            value_is_repr=reply.value_is_repr,
            error=error,
            stdout="",
            stderr="",
            signals=[Signal.model_validate(s) for s in reply.signals],
            worker=None,
            stats=stats,
            limits=job.limits,
            executor=self.executor_id,
        )

    def _answer(self, job: Job, result: Result, slot: Slot, *, restarted: bool) -> None:
        """Complete a result with what the pool knows (worker, output, limits) and hand it on."""
        result.worker = WorkerInfo.model_construct(id=slot.id, pid=slot.pid, incarnation=slot.id,
                                                   restarted=restarted, layers=self.layers)
        result.stdout = job.stdout.decode(errors="replace") if job.stdout else ""
        result.stderr = job.stderr.decode(errors="replace") if job.stderr else ""
        result.limits = job.limits
        result.executor = self.executor_id
        self.on_done(job, result)

    def _kill(self, slot: Slot, why: str) -> None:
        if not slot.killed:
            log.info("killing worker %d (pid %d): %s", slot.id, slot.pid, why)
            slot.killed_at = time.monotonic()
            self._signal(slot.pid)

    def _end_retired(self, now: float, every: bool = False) -> None:
        """Kill the fresh workers that answered and stopped themselves (``worker_loop``): all of them
        (``every``) when new ones are made (once the executor is quiet, or at once if a call waits for
        one), else those that answered ``REFILL_MAX_DELAY`` ago. Their teardown then costs no answer
        its time. Their exits are reported as usual."""
        for pid, answered in self.retiring.items():
            if pid not in self.ended and (every or now >= answered + REFILL_MAX_DELAY):
                self.ended.add(pid)
                self._signal(pid)

    def _retire(self, slot: Slot) -> None:
        """Forget a worker that is done (answered its one call, or was killed): its exit is expected
        within ``RETIRE_GRACE``, else it is killed."""
        self.retiring[slot.pid] = time.monotonic()
        self._close_slot(slot)
        self._refill(urgent=False)

    def _abandon(self, slot: Slot, why: str) -> None:
        """Answer the call of a worker that will not die and forget the worker; its exit, if it ever
        comes, is only logged. Its slot is refilled at once."""
        log.error("worker %d (pid %d) %s; its call is answered and the process abandoned", slot.id, slot.pid, why)
        self._unstarted(slot)
        job = slot.job
        if job is not None:
            slot.job = None
            self._drain_output(slot)
            result = job.outcome or Result.failure(job.call_id, "crashed", f"the worker {why}")
            result.stats = Stats(wall_s=time.monotonic() - job.started)
            self._answer(job, result, slot, restarted=True)
        self.abandoned[slot.pid] = why
        self._trim_abandoned()
        self._close_slot(slot)
        self.dispatch()

    def _trim_abandoned(self) -> None:
        while len(self.abandoned) > MAX_ABANDONED:
            pid = next(iter(self.abandoned))
            self.abandoned.pop(pid)
            self._forget_pidfd(pid)

    def _unstarted(self, slot: Slot) -> bool:
        """Whether the job of a dead (or abandoned) worker never started: read what is left on the
        channel first (a start or a reply sent before the end), then, if it never started and nothing
        but the pool's own start-timeout decided its fate, put it back in the queue for another worker."""
        if slot.job is not None and slot.chan.fileno() in self.fd_owner:
            self._on_worker(slot)
        job = slot.job
        if job is None or slot.started or self.requeue is None:
            return False
        if job.outcome is not None and job.outcome.error is not None and job.outcome.error.kind == "cancelled":
            return False
        slot.job = None
        log.info("call %s never started in worker %d; queued again", job.call_id, slot.id)
        self.requeue(job)
        return True

    def _worker_gone(self, slot: Slot, sig: int, code: int | None, oom: bool = False,
                     cpu_s: float = 0.0, peak_rss_kb: int = 0) -> None:
        """The worker process is dead: finish its call, free its slot, make a new one."""
        if self._unstarted(slot):
            self._close_slot(slot)
            self.dispatch()
            return
        job = slot.job
        if job is not None:
            slot.job = None
            self._drain_output(slot)
            wall = time.monotonic() - job.started
            result = job.outcome or _death_result(job, sig, code, oom, cpu_s)
            assert result.error is not None
            if result.error.kind == "crashed":
                result.error.signal = sig or None
            result.stats = Stats(wall_s=wall, cpu_s=cpu_s, peak_rss_kb=peak_rss_kb)
            self._answer(job, result, slot, restarted=True)
        self._close_slot(slot)
        self.dispatch()

    def _close_slot(self, slot: Slot) -> None:
        for fd in (slot.chan.fileno(), slot.out_fd, slot.err_fd):
            self._unregister(fd)
        slot.chan.close()
        for fd in (slot.out_fd, slot.err_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        slot.out_fd = slot.err_fd = -1
        slot.outbuf.clear()
        self.slots.pop(slot.id, None)

    def _unregister(self, fd: int) -> None:
        if fd >= 0 and self.fd_owner.pop(fd, None) is not None and self.poller is not None:
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self.poller.unregister(fd)


def _death_result(job: Job, sig: int, code: int | None, oom: bool = False, cpu_s: float = 0.0) -> Result:
    cid = job.call_id
    if sig == signal.SIGKILL and cpu_s >= job.limits.effective_cpu_s():
        # SIGXCPU was not delivered (a hardened worker is PID 1 of its namespace, which the kernel
        # spares it; or the tool ignored it): RLIMIT_CPU's hard limit killed it. A CPU timeout all the same.
        sig = signal.SIGXCPU
    if oom:
        return Result.failure(cid, "memory", f"the tool (with the processes it started) went over its "
                              f"{job.limits.memory_mb} MB memory limit and was killed")
    if sig == signal.SIGXCPU:
        return Result.failure(cid, "timeout", f"the tool used more than {job.limits.effective_cpu_s()} s of "
                              "CPU time and was killed")
    if sig == signal.SIGKILL:
        return Result.failure(cid, "crashed", "the worker was killed (SIGKILL) while running the tool")
    if sig:
        name = signal.Signals(sig).name if sig in signal.Signals.__members__.values() else str(sig)
        return Result.failure(cid, "crashed", f"the worker died from signal {name} while running the tool")
    if code is not None:
        return Result.failure(cid, "crashed", f"the worker process exited with code {code} while running the tool")
    return Result.failure(cid, "crashed", "the worker process disappeared while running the tool")
