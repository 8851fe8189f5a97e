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

It never runs tool code (the template and the workers do: ``executor.workers.template`` and
``executor.workers.worker``) and knows nothing of clients: finished calls go to ``on_done``, and it
asks ``next_job`` for work whenever it can run some.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

import zmq

from executor.calls import Job
from executor.keeper import KILL_GRACE, REPLACE_WAIT, TemplateKeeper
from executor.slot import (
    GONE,
    HURRY,
    IDLE_READ_LIMIT,
    LIVE,
    POLL_MAX_S,
    REFILL_MAX_DELAY,
    REFILL_QUIET,
    SPIN_AFTER_DISPATCH,
    START_TIMEOUT,
    SWEEP_INTERVAL,
    TEMPLATE_ANSWER_TIMEOUT,
    TEMPLATE_FRAME_LIMIT,
    Descriptors,
    Phase,
    Pids,
    Worker,
    death_result,
    result_from_reply,
)
from executor.workers import framing
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
from protocol import Result, Stats, ToolSpec, WorkerInfo
from protocol.timing import APPLY_GRACE  # hardened --workspace-rw: what a call that answered in time gets to apply

log = logging.getLogger("ciayn-executor")


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
        self.executor_id = config.name
        # --profile hardened: the layers every result names, and whether workers say ``Applying``
        self.layers = list(config.confinement.names) if config.confinement is not None else []
        self.keeps_workspace = config.confinement is not None and config.confinement.keeper
        self.size = max(1, size)
        self.on_done = on_done
        self.next_job = next_job
        self.requeue = requeue
        self.queued = queued  # how many calls wait for a worker
        self.workers: dict[int, Worker] = {}  # by id, from the template's Spawned to the worker's Exited
        self.asked: dict[int, float] = {}  # worker id -> when the template was asked for it (it owes a Spawned)
        self.pids = Pids()  # their pidfds, and the processes that would not die
        self.next_id = 0
        self.keeper = TemplateKeeper(config)  # the template process: start, replace, back off, stop
        self.fds = Descriptors()  # theirs in the supervisor's poller
        self.spin_until = 0.0
        self.refill_at = 0.0  # fresh workers: when the deferred replacement is forked (0: none due)
        self.refill_first = 0.0  # when it first became due
        self.hurried_at = -HURRY  # fresh workers: when a call last had to wait for a fork
        self.sweep_due = False  # reused workers: the template should kill its stray children soon
        self.swept_at = 0.0
        self.stopping = False
        self.EXPIRED: dict[Phase, Callable[[Worker, float], None]] = {
            Phase.STARTING: self._start_expired, Phase.RUNNING: self._run_expired, Phase.CLOSED: self._close_expired,
            Phase.KILLED: lambda w, now: self._abandon(w, f"it did not die within {KILL_GRACE:g} s of SIGKILL"),
            Phase.ANSWERED: lambda w, now: self._end(w, now), Phase.ENDED: self._end_expired}

    # ---------------------------------------------------------------- start-up and shutdown

    @property
    def specs(self) -> dict[str, ToolSpec]:
        return self.keeper.specs

    @property
    def checked(self) -> frozenset[str]:
        """Tools whose workers check their arguments against the annotations themselves."""
        return self.keeper.checked

    @property
    def cgroups(self) -> str:
        return self.keeper.cgroups

    def hold(self, forked: tuple[int, socket.socket]) -> None:
        """Take the template ``serve`` started (``TemplateKeeper.hold``)."""
        self.keeper.hold(forked)

    def start_template(self, watch: dict[int, Callable[[], str]] | None = None) -> None:
        """Start the first template and wait until it has loaded the tools (``TemplateKeeper.start``)."""
        self.keeper.start(watch)

    def stop_template(self) -> None:
        """Stop the template (``TemplateKeeper.stop``): at shutdown, or after a refused start."""
        self.keeper.stop()

    def attach(self, poller: zmq.Poller) -> None:
        """Register with the supervisor's poller and start the workers."""
        self.fds.poller = self.keeper.poller = poller
        if self.keeper.channel is not None:
            poller.register(self.keeper.fd, zmq.POLLIN)
        self._refill()

    def stop(self) -> None:
        self.stopping = True
        for worker in list(self.workers.values()):
            self.pids.signal(worker.pid)
            self.fds.close(worker)
        self.workers.clear()
        self.keeper.stop()
        self.pids.forget_all()
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
        for worker in list(self.workers.values()):
            self._kill(worker, "its template is gone")  # first: a killed worker runs no more code
        for worker in list(self.workers.values()):
            if worker.job is not None and not self._unstarted(worker) and worker.job is not None:
                job, worker.job = worker.job, None
                result = job.outcome or Result.failure(
                    job.call_id, "crashed",
                    f"the executor's template process {why}; the worker running this call was killed with it")
                self._answer(job, result, worker, restarted=True)
            self.fds.close(worker)
        self.workers.clear()
        self.asked.clear()
        self.pids.forget_all()  # the old template's workers are dead or abandoned: never signalled again
        kill_children(wait=REPLACE_WAIT)  # the old template's orphans came to us (what SIGKILL cannot stop is left)
        self._remove_groups()
        # The new template is waited for by the loop (``_on_template``), which goes on answering
        # pings, status and the broker meanwhile; calls wait in the queue, within their bounds.
        self.keeper.replace(why)

    # ---------------------------------------------------------------- the loop's view

    def busy(self) -> int:
        return sum(1 for w in self.workers.values() if w.job is not None)

    def ready(self) -> int:
        return sum(1 for w in self.workers.values() if w.phase is Phase.READY)

    def applying(self) -> list[str]:
        """Calls whose keeper said they answered and their workspace writes are being applied."""
        return [w.job.call_id for w in self.workers.values() if w.applying and w.job is not None]

    def spinning(self, now: float) -> bool:
        return now < self.spin_until

    def timeout_s(self, now: float) -> float:
        """How long the loop may sleep before a deadline or a wait needs it."""
        wait = min((w.due for w in self.workers.values()), default=POLL_MAX_S + now) - now
        if self.asked:
            wait = min(wait, min(self.asked.values()) + TEMPLATE_ANSWER_TIMEOUT - now)
        if self.refill_at:
            wait = min(wait, self.refill_at - now)
        if self.sweep_due:
            wait = min(wait, self.swept_at + SWEEP_INTERVAL - now)
        return min(wait, POLL_MAX_S, self.keeper.due(now))

    def handle(self, events: dict[Any, int]) -> None:
        """Serve the pool's descriptors among the poller's events: workers first, so that a reply is
        read before the template's report that its worker exited."""
        for fd, mask in list(events.items()):
            owner = self.fds.owner.get(fd) if isinstance(fd, int) else None
            if owner is None:
                continue
            worker, what = owner
            if what != "chan":
                if worker.read_output(self.fds, fd, what, running=True)[1] and worker.job is not None:
                    self._kill(worker, f"{what} over {worker.job.limits.max_output_kb} KB")
            else:
                if mask & zmq.POLLOUT:
                    worker.flush(self.fds)
                if mask & ~zmq.POLLOUT and worker.id in self.workers:
                    self._on_worker(worker)
        if self.keeper.channel is not None and self.keeper.fd in events:
            self._on_template()

    def cancel(self, job: Job, outcome: Result) -> bool:
        """Stop a running job; its answer is ``outcome``. False if no worker runs it."""
        worker = next((w for w in self.workers.values() if w.job is job), None)
        if worker is None:
            return False
        job.outcome = outcome
        self._kill(worker, "cancelled")
        return True

    def dispatch(self) -> None:
        """Hand queued calls to ready workers (READY -> STARTING), at most ``size`` running at once."""
        while self.busy() < self.size:
            worker = next((w for w in self.workers.values() if w.phase is Phase.READY), None)
            if worker is None:
                break
            job = self.next_job()
            if job is None:
                break
            now = time.monotonic()
            job.started = now
            job.deadline = now + job.limits.timeout_s
            worker.job, worker.started, worker.applying = job, False, False
            worker.enter(Phase.STARTING, now)
            worker.seq += 1
            worker.reader.limit = reply_cap(job.limits.max_result_kb)
            if self.config.reuse:  # a fresh worker's reply comes later than a spin is worth (its faults)
                self.spin_until = now + SPIN_AFTER_DISPATCH
            request = CallRequest(seq=worker.seq, tool=job.call.tool, args=job.call.args, kwargs=job.call.kwargs,
                                  cpu_s=cpu if (cpu := job.limits.effective_cpu_s()) != self.limits.cpu_s else None)
            worker.outbuf += framing.pack(request.to_wire())
            worker.flush(self.fds)
        self._refill(urgent=False)

    def _refill(self, urgent: bool = True) -> None:
        """Ask the template for workers: keep ``size`` ready (fresh workers), or ``size`` in all
        (reused workers).

        Fresh workers are replaced once the pool is quiet (``REFILL_QUIET``, at most
        ``REFILL_MAX_DELAY`` late), not the moment a call takes one: forking the replacement and
        setting up its control group take the CPU the running call and its answer need (on 2 cores
        that doubled a no-op call's latency). A call that waits for a worker while none is ready
        makes the refill ``urgent``, and for ``HURRY`` after it no refill waits: the worker a call
        takes is replaced at once, since calls are coming back to back and the next would wait for
        its fork."""
        channel = self.keeper.channel if self.keeper.serving else None
        if channel is None or self.stopping:
            return
        if self.config.reuse:
            want = self.size - sum(1 for w in self.workers.values() if w.phase in LIVE)
        else:
            want = self.size - self.ready()
        missing = want - len(self.asked)
        now = time.monotonic()
        if self.queued() and not self.ready():  # a call waits for a worker while none is ready
            self.hurried_at = now
        hurry = now < self.hurried_at + HURRY  # (so while a call waits, too)
        if missing > 0 and not urgent and not self.config.reuse and not hurry:
            if not self.refill_at:
                self.refill_first = now
            self.refill_at = min(self.refill_first + REFILL_MAX_DELAY, now + REFILL_QUIET)
            return
        self.refill_at = 0.0
        if missing > 0:  # the answered workers' teardown goes before the new ones' forks
            for worker in [w for w in self.workers.values() if w.phase is Phase.ANSWERED]:
                self._end(worker, now)
        # A worker made while calls wait or come back to back is needed at once: a rehearsal would only
        # delay it. One made ahead (at start, or once the pool is quiet) takes its faults before its call.
        rehearse = not self.config.reuse and not hurry
        for _ in range(missing):
            self.next_id += 1
            self.asked[self.next_id] = now
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
        for worker in [w for w in self.workers.values() if now >= w.due]:
            if self.workers.get(worker.id) is worker and now >= worker.due:  # (an earlier one may have moved it)
                self.EXPIRED[worker.phase](worker, now)
        if self.keeper.serving and any(now >= t + TEMPLATE_ANSWER_TIMEOUT for t in self.asked.values()):
            self._replace_template(f"did not answer a spawn request within {TEMPLATE_ANSWER_TIMEOUT:g} s "
                                   "(stopped or wedged)")

    # ---------------------------------------------------------------- a phase's wait ran out

    def _start_expired(self, worker: Worker, now: float) -> None:
        """STARTING: stopped before it could read the call (a tool may SIGSTOP the workers forked
        ahead), or the call's deadline came first."""
        if now >= worker.since + START_TIMEOUT:
            assert worker.job is not None
            self._kill(worker, f"it did not start call {worker.job.call_id} within {START_TIMEOUT:g} s")
        else:
            self._run_expired(worker, now)

    def _run_expired(self, worker: Worker, now: float) -> None:
        """RUNNING (or STARTING, or CLOSED) past the call's deadline: answered ``timeout``."""
        job = worker.job
        assert job is not None
        job.outcome = Result.failure(
            job.call_id, "timeout",
            f"the tool ran past its {job.asked_s:g} s time limit and was killed"
            + (f" ({job.asked_s - job.limits.timeout_s:.2g} s of it spent waiting in the queue)"
               if job.asked_s - job.limits.timeout_s >= 0.01 else ""))
        self._kill(worker, f"call {job.call_id} timed out")

    def _close_expired(self, worker: Worker, now: float) -> None:
        """CLOSED: the channel is gone but the process is not (a tool closed inherited fds): it can
        never answer again, so kill it and let the template report its death."""
        job = worker.job
        if job is not None and now >= job.deadline:
            self._run_expired(worker, now)
            return
        if job is not None and job.outcome is None:
            job.outcome = Result.failure(job.call_id, "crashed",
                                         "the tool closed the worker's channel to the executor; the worker was killed")
        self._kill(worker, "its channel closed but it did not exit")

    def _end_expired(self, worker: Worker, now: float) -> None:
        """ENDED: killed after its answer, and its exit still not reported: forget it."""
        log.warning("worker pid %d answered its call but did not exit; killing it", worker.pid)
        self.pids.signal(worker.pid)
        self.workers.pop(worker.id, None)

    # ---------------------------------------------------------------- the template's reports

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
        if isinstance(msg, Spawned) and len(fds) >= 3:
            self._spawned(msg, fds)
            fds = fds[4:]
        elif isinstance(msg, Exited):
            self._exited(msg)
        _close(fds)

    def _spawned(self, msg: Spawned, fds: list[int]) -> None:
        """-> READY: the template forked the worker it was asked for, and sent its descriptors
        (channel, stdout, stderr and, where it can, a pidfd). One it was not asked for (tool code in
        the template can write on its channel) is dropped."""
        if self.asked.pop(msg.worker, None) is None:
            log.warning("the template reported worker %d, which it was not asked for; ignored", msg.worker)
            _close(fds[:4])
            return
        host = self.pids.host(msg.pid, fds[3:4], self.keeper.host_pids)
        if host <= 0:
            log.warning("worker %d (pid %d in the template's namespace) was gone before it could be used",
                        msg.worker, msg.pid)
            _close(fds[:4])
            self._refill(urgent=bool(self.queued()))
            return
        try:  # tool code in the template can write on its channel: the descriptors are checked
            chan = _worker_channel(fds)
        except OSError as e:
            self.pids.forget(host)  # (closes its pidfd, fds[3], if it came with one)
            _close(fds[:3])
            self._replace_template(f"sent a worker's descriptors that are not its channel and pipes ({e})")
            return
        self.keeper.made_worker = True
        worker = Worker(id=msg.worker, pid=host, chan=chan, reader=framing.Reader(chan, IDLE_READ_LIMIT),
                        out_fd=fds[1], err_fd=fds[2], since=time.monotonic())
        self.workers[worker.id] = worker
        self.fds.add(worker)
        log.debug("worker %d ready (pid %d)", worker.id, worker.pid)
        self.dispatch()

    def _exited(self, msg: Exited) -> None:
        """-> reaped: the template reaped a worker. An answered one leaves quietly; one that owed an
        answer has it made from how it died (after reading what it sent before it died)."""
        pid = self.keeper.host_pids.forget(msg.pid) if self.keeper.host_pids is not None else msg.pid
        if pid <= 0:
            return  # a worker that was gone before we knew it (logged then)
        self.pids.forget(pid)  # it is dead and reaped: its pid may be another process's now
        if pid in self.pids.abandoned:
            log.warning("abandoned worker pid %d finally exited (%s)", pid, self.pids.abandoned.pop(pid))
            return
        dead = next((w for w in self.workers.values() if w.pid == pid), None)
        if dead is None:
            return
        if dead.job is not None and dead.phase not in GONE:
            self._on_worker(dead)  # a reply it sent before it exited is still in the channel: read it first
        if dead.phase in GONE:
            self.workers.pop(dead.id, None)  # it answered its call and exited, as it should
            return
        self._worker_gone(dead, msg.signal, msg.code, oom=msg.oom, cpu_s=msg.cpu_s, peak_rss_kb=msg.peak_rss_kb)

    # ---------------------------------------------------------------- a worker's descriptors

    def _on_worker(self, worker: Worker) -> None:
        """Read the worker's channel: a start (-> RUNNING), an apply notice, a reply (-> READY when
        reused, else -> ANSWERED), or its end (-> CLOSED)."""
        try:
            replies, closed = worker.reader.feed()
        except framing.FrameError as e:
            replies, closed = [], True
            self._malformed(worker, e, "output_limit" if "limit" in str(e) else "crashed")
        notices = 0
        for raw in replies:
            try:
                if self._notice(worker, raw):
                    notices += 1
                    continue
                job = worker.job
                reply = Reply.from_wire(raw)
                if job is None or reply.seq != worker.seq:
                    # A reply to no request, or to another one: tool code wrote on the channel (a
                    # forged reply, then the real one). Never let it answer some other call.
                    raise ChannelError("a reply that does not match the request in flight")
                memory = reply.error is not None and reply.error.get("kind") == "memory"
                result = result_from_reply(job, reply, self.executor_id)
            except (TypeError, ValueError) as e:  # ChannelError and pydantic's ValidationError are ValueErrors
                self._malformed(worker, e)  # the call is answered when the worker's death is reported
                break
            worker.drain(self.fds)
            worker.job = None
            if job.outcome is not None:
                # Decided here before the reply was read (output over the cap found while draining,
                # or a deadline or cancel that raced the reply): that decision is the answer.
                result = job.outcome.model_copy(update={
                    k: getattr(result, k) for k in ("stats", "limits", "executor", "stdout", "stderr")})
            restarted = worker.phase is Phase.KILLED or memory
            self._answer(job, result, worker, restarted=restarted)
            if restarted or not self.config.reuse:
                self._retire(worker)  # it exits by itself (after a reply the worker is done or must go)
                break
            worker.enter(Phase.READY, time.monotonic())
        if closed and worker.id in self.workers and worker.phase not in GONE:
            self.fds.drop(worker.chan.fileno())
            if worker.phase in LIVE:
                self._closed(worker)
        if notices == len(replies) and not closed:
            return  # only a start or an apply notice: no worker was freed, no call ended
        self.dispatch()
        if self.config.reuse:
            self.sweep_due = True  # processes a call started with CLONE_PARENT went to the template

    def _notice(self, worker: Worker, raw: Any) -> bool:
        """A ``Started`` (STARTING -> RUNNING) or, from a keeper, an ``Applying`` (its deadline moves
        at most ``APPLY_GRACE`` later, once); False for anything else. Raises ``ChannelError`` for
        one that does not match the request in flight."""
        ack = Started.from_wire(raw)
        if ack is not None:
            if worker.job is None or ack.seq != worker.seq or worker.started:
                raise ChannelError("a start that does not match the request in flight")
            worker.started = True
            if worker.phase is Phase.STARTING:
                worker.enter(Phase.RUNNING, time.monotonic())
            return True
        applying = Applying.from_wire(raw) if self.keeps_workspace else None
        if applying is None:
            return False
        job = worker.job
        if job is None or applying.seq != worker.seq or not worker.started or worker.applying:
            raise ChannelError("an apply notice that does not match the request in flight")
        worker.applying = True
        if worker.phase is Phase.RUNNING:
            job.deadline = max(job.deadline, time.monotonic() + APPLY_GRACE)
            worker.due = job.deadline
        return True

    def _malformed(self, worker: Worker, problem: Exception, kind: str = "crashed") -> None:
        """The worker's channel carried something our worker code never sends: tool code wrote on
        it. Nothing more it says can be trusted; replace it."""
        log.error("worker %d sent a malformed message (%s); replacing it", worker.id, problem)
        if worker.job is not None and worker.job.outcome is None:
            if kind == "output_limit":
                worker.job.outcome = Result.failure(worker.job.call_id, "output_limit",
                                                    f"the worker's reply was too large ({problem}); it was killed")
            else:
                worker.job.outcome = Result.failure(
                    worker.job.call_id, "crashed",
                    "the worker sent the executor a malformed message (did the tool write to a descriptor it "
                    "inherited?); it was killed")
        self._kill(worker, "malformed message")

    def _answer(self, job: Job, result: Result, worker: Worker, *, restarted: bool) -> None:
        """Complete a result with what the pool knows (worker, output, limits) and hand it on."""
        result.worker = WorkerInfo.model_construct(id=worker.id, pid=worker.pid, incarnation=worker.id,
                                                   restarted=restarted, layers=self.layers)
        result.stdout = job.stdout.decode(errors="replace") if job.stdout else ""
        result.stderr = job.stderr.decode(errors="replace") if job.stderr else ""
        result.limits = job.limits
        result.executor = self.executor_id
        self.on_done(job, result)

    # ---------------------------------------------------------------- transitions

    def _closed(self, worker: Worker) -> None:
        """-> CLOSED: its channel ended while it could still owe an answer; its exit is awaited."""
        worker.enter(Phase.CLOSED, time.monotonic())
        if worker.job is not None and not worker.started:
            worker.due = min(worker.due, worker.since + START_TIMEOUT)

    def _kill(self, worker: Worker, why: str) -> None:
        """-> KILLED (an answered worker -> ENDED): SIGKILL, its exit then awaited."""
        if worker.phase in (Phase.KILLED, Phase.ENDED):
            return
        if worker.phase is Phase.ANSWERED:
            self._end(worker, time.monotonic())
            return
        log.info("killing worker %d (pid %d): %s", worker.id, worker.pid, why)
        worker.enter(Phase.KILLED, time.monotonic())
        self.pids.signal(worker.pid)

    def _retire(self, worker: Worker) -> None:
        """-> ANSWERED (a killed one -> ENDED): done with its one call, or killed; its descriptors
        are closed and its exit expected, else it is killed (``_end``)."""
        now = time.monotonic()
        worker.enter(Phase.ENDED if worker.phase is Phase.KILLED else Phase.ANSWERED, now)
        self.fds.close(worker)
        self._refill(urgent=False)

    def _end(self, worker: Worker, now: float) -> None:
        """ANSWERED -> ENDED: kill a fresh worker that answered and stopped itself (``worker_loop``),
        ``REFILL_MAX_DELAY`` after its answer or when new workers are made, so that its teardown
        costs no answer its time. Its exit is reported as usual."""
        worker.enter(Phase.ENDED, now)
        self.pids.signal(worker.pid)

    def _abandon(self, worker: Worker, why: str) -> None:
        """KILLED -> gone: answer the call of a worker that will not die and forget the worker; its
        exit, if it ever comes, is only logged. Its slot is refilled at once."""
        log.error("worker %d (pid %d) %s; its call is answered and the process abandoned", worker.id, worker.pid,
                  why)
        self._unstarted(worker)
        job = worker.job
        if job is not None:
            worker.job = None
            worker.drain(self.fds)
            result = job.outcome or Result.failure(job.call_id, "crashed", f"the worker {why}")
            result.stats = Stats(wall_s=time.monotonic() - job.started)
            self._answer(job, result, worker, restarted=True)
        self.pids.abandon(worker.pid, why)
        self.fds.close(worker)
        self.workers.pop(worker.id, None)
        self.dispatch()

    def _unstarted(self, worker: Worker) -> bool:
        """Whether the job of a dead (or abandoned) worker never started: read what is left on the
        channel first (a start or a reply sent before the end), then, if it never started and nothing
        but the pool's own start-timeout decided its fate, put it back in the queue for another worker."""
        if worker.job is not None and worker.chan.fileno() in self.fds.owner:
            self._on_worker(worker)
        job = worker.job
        if job is None or worker.started or self.requeue is None:
            return False
        if job.outcome is not None and job.outcome.error is not None and job.outcome.error.kind == "cancelled":
            return False
        worker.job = None
        log.info("call %s never started in worker %d; queued again", job.call_id, worker.id)
        self.requeue(job)
        return True

    def _worker_gone(self, worker: Worker, sig: int, code: int | None, oom: bool = False,
                     cpu_s: float = 0.0, peak_rss_kb: int = 0) -> None:
        """-> reaped, owing an answer: finish its call from how it died, make a new worker."""
        if not self._unstarted(worker) and (job := worker.job) is not None:
            worker.job = None
            worker.drain(self.fds)
            result = job.outcome or death_result(job, sig, code, oom, cpu_s)
            assert result.error is not None
            if result.error.kind == "crashed":
                result.error.signal = sig or None
            result.stats = Stats(wall_s=time.monotonic() - job.started, cpu_s=cpu_s, peak_rss_kb=peak_rss_kb)
            self._answer(job, result, worker, restarted=True)
        self.fds.close(worker)
        self.workers.pop(worker.id, None)
        self.dispatch()


def _worker_channel(fds: list[int]) -> socket.socket:
    """The worker's channel from the descriptors of its ``Spawned`` (channel, stdout, stderr): the
    first a Unix stream socket, the others pipes; ``OSError`` otherwise."""
    for fd in fds[1:3]:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"descriptor {fd} is not a pipe")
    chan = socket.socket(fileno=fds[0])
    if chan.family != socket.AF_UNIX or chan.type != socket.SOCK_STREAM:
        chan.detach()
        raise OSError("the channel is not a Unix stream socket")
    return chan


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
