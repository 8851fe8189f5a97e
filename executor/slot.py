"""One worker process as the pool sees it: its phase and the wait that ends it, its descriptors,
its pid (signalled through a pidfd), and the result its call gets from its reply or its death.

``WorkerPool`` (``executor.pool``) drives the transitions; this module holds the states, every wait
in one table, and what a worker's descriptors do (bounded reads of stdout and stderr, sends that
never block). It runs on the supervisor's side of the fork and never runs tool code.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import signal
import socket
from dataclasses import dataclass, field

import zmq

from executor.calls import Job
from executor.keeper import KILL_GRACE
from executor.workers import framing, pidns
from executor.workers.channel import Reply
from protocol import ErrorInfo, Result, Signal, Stats


class Phase(enum.Enum):
    """Where a worker process is, from the template's report that it exists to its exit (``reaped``:
    it leaves the pool). One transition per method of ``WorkerPool``, named in each phase's line."""

    READY = "ready"  # forked (and rehearsed), waiting for a call (``_spawned``)
    STARTING = "starting"  # sent a call; it has not said it started the tool (``dispatch``)
    RUNNING = "running"  # running its call's tool (``_started``); with ``applying``, applying its writes
    CLOSED = "closed"  # its channel closed while it owed no answer: its exit status is awaited (``_closed``)
    KILLED = "killed"  # sent SIGKILL: its exit is awaited (``_kill``); past KILL_GRACE, abandoned (``_abandon``)
    ANSWERED = "answered"  # a fresh worker that answered its one call and stops by itself (``_retire``)
    ENDED = "ended"  # an answered worker we killed, its teardown costing no answer its time (``_end``)


# Every wait of a worker, in one place: how long it may stay in a phase before the loop acts
# (``WorkerPool.EXPIRED``). STARTING and RUNNING also end at the call's deadline.
TEMPLATE_ANSWER_TIMEOUT = 3.0  # a spawn request unanswered this long: the template is stopped or wedged
START_TIMEOUT = 2.0  # STARTING: a worker that does not say it started a call this long after getting it is replaced
EXIT_STATUS_WAIT = 2.0  # CLOSED: how long to wait for its exit status once its channel closed
# KILLED: KILL_GRACE (executor.keeper), after SIGKILL, before its call is answered and it is abandoned
REFILL_MAX_DELAY = 0.02  # ANSWERED: killed this long after its answer (or when new workers are made)
RETIRE_GRACE = 2.0  # ENDED: a killed answered worker whose exit is not reported by then is forgotten
WAIT = {Phase.STARTING: START_TIMEOUT, Phase.CLOSED: EXIT_STATUS_WAIT, Phase.KILLED: KILL_GRACE,
        Phase.ANSWERED: REFILL_MAX_DELAY, Phase.ENDED: RETIRE_GRACE}
REFILL_QUIET = 0.002  # fresh workers: a replacement is forked once the pool has been quiet this long...
# ...or REFILL_MAX_DELAY after it was first due, whichever comes first...
HURRY = 0.05  # ...but at once, not rehearsed, for this long after a call had to wait for a fork (back to back)
SWEEP_INTERVAL = 0.2  # reused workers: the template kills stray children at most this often (it costs a /proc read)
SPIN_AFTER_DISPATCH = 0.0003  # seconds of polling without sleep after a dispatch (quick calls' replies)
TEND_WHILE_SPINNING = 0.001  # while it spins, the supervisor tends its timers at most this often
POLL_MAX_S = 1.0

TEMPLATE_FRAME_LIMIT = 64 * 1024  # the template's messages after start-up are tiny (Spawned, Exited)
IDLE_READ_LIMIT = 64 * 1024  # what a worker with no call may send before it is cut off (it should send nothing)
MAX_ABANDONED = 64  # processes that would not die, remembered for the log

LIVE = (Phase.READY, Phase.STARTING, Phase.RUNNING)  # a worker that can still answer a call
GONE = (Phase.ANSWERED, Phase.ENDED)  # its descriptors closed: only its exit is awaited


@dataclass
class Worker:
    """One worker process of the pool, and the call it runs."""

    id: int
    pid: int
    chan: socket.socket
    reader: framing.Reader
    out_fd: int
    err_fd: int
    phase: Phase = Phase.READY
    since: float = 0.0  # when it entered its phase
    due: float = math.inf  # when the loop must act on it (its phase's wait; a call's deadline)
    job: Job | None = None
    started: bool = False  # it said it started the job's tool (before that, the job never ran)
    applying: bool = False  # its keeper said the call answered and its writes are being applied
    seq: int = 0  # number of the request in flight: a reply must carry it
    outbuf: bytearray = field(default_factory=bytearray)  # request bytes the worker has not taken yet

    def enter(self, phase: Phase, now: float) -> None:
        self.phase, self.since = phase, now
        self.due = now + WAIT.get(phase, math.inf)
        if self.job is not None and phase in (Phase.STARTING, Phase.RUNNING, Phase.CLOSED):
            self.due = min(self.due, self.job.deadline)

    def read_output(self, fds: Descriptors, fd: int, what: str, running: bool) -> tuple[bool, bool]:
        """Read one chunk of its stdout or stderr (``what``) into its call's: (anything read, the
        call's output went over its cap now). Over the cap, the call's outcome becomes
        ``output_limit``; the pool kills the worker if it is still ``running`` the call."""
        job = self.job
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False, False
        except OSError:
            data = b""
        if not data:
            fds.drop(fd)
            return False, False
        if job is None:
            return True, False  # output of a process the previous call left behind: dropped
        cap = job.limits.max_output_kb * 1024
        buf = job.stdout if what == "stdout" else job.stderr
        room = cap - len(buf)
        buf += data[: max(0, room)]
        if len(data) <= room or job.outcome is not None:
            return True, False
        job.outcome = Result.failure(job.call_id, "output_limit", f"the tool wrote more than {cap // 1024} KB to "
                                     f"{what}" + ("; it was stopped" if running else ""))
        return True, True

    def drain(self, fds: Descriptors) -> None:
        """Read what it wrote before its reply (or death) so it lands in this call's result."""
        for fd, what in ((self.out_fd, "stdout"), (self.err_fd, "stderr")):
            for _ in range(4096):  # bounded: a leftover writer cannot keep us here
                if fd not in fds.owner or self.job is None or self.job.outcome is not None:
                    break
                if not self.read_output(fds, fd, what, running=False)[0]:
                    break

    def flush(self, fds: Descriptors) -> None:
        """Send what it has not taken yet, never blocking: a worker still busy (a tool that faked
        its reply) must not stall the supervisor. What is left waits for POLLOUT."""
        try:
            while self.outbuf:
                sent = self.chan.send(self.outbuf, socket.MSG_DONTWAIT)
                del self.outbuf[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self.outbuf.clear()  # the worker died; its channel's EOF will finish the job
        fds.want_write(self.chan.fileno(), bool(self.outbuf))


class Descriptors:
    """The workers' descriptors in the supervisor's poller, and whose each one is."""

    def __init__(self) -> None:
        self.poller: zmq.Poller | None = None
        self.owner: dict[int, tuple[Worker, str]] = {}

    def add(self, worker: Worker) -> None:
        os.set_blocking(worker.out_fd, False)
        os.set_blocking(worker.err_fd, False)
        for fd, what in ((worker.chan.fileno(), "chan"), (worker.out_fd, "stdout"), (worker.err_fd, "stderr")):
            self.owner[fd] = (worker, what)
            if self.poller is not None:
                self.poller.register(fd, zmq.POLLIN)

    def want_write(self, fd: int, write: bool) -> None:
        if self.poller is not None:
            with contextlib.suppress(KeyError, zmq.ZMQError, ValueError):
                self.poller.modify(fd, zmq.POLLIN | (zmq.POLLOUT if write else 0))

    def drop(self, fd: int) -> None:
        if fd >= 0 and self.owner.pop(fd, None) is not None and self.poller is not None:
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self.poller.unregister(fd)

    def close(self, worker: Worker) -> None:
        """Close the worker's descriptors (it stays in the pool until its exit is reported)."""
        for fd in (worker.chan.fileno(), worker.out_fd, worker.err_fd):
            self.drop(fd)
        worker.chan.close()
        for fd in (worker.out_fd, worker.err_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        worker.out_fd = worker.err_fd = -1
        worker.outbuf.clear()


class Pids:
    """Worker processes by host pid: a pidfd for each from its Spawned to its Exited, so that a
    kill can never reach another process that got the same pid after the worker's end; and the
    processes that would not die (``abandoned``), remembered for the log."""

    def __init__(self) -> None:
        self.pidfds: dict[int, int] = {}
        self.have_pidfds = False  # the template sends them (pidfd_open: Linux 5.3)
        self.abandoned: dict[int, str] = {}  # pid -> why: killed, but it did not die

    def host(self, pid: int, pidfd: list[int], host_pids: pidns.HostPids | None) -> int:
        """A worker's host pid from the pid the template gave (its own, in its namespace) and, where
        the template sent one, the worker's pidfd (its ``fdinfo`` names the process in our
        namespace); 0 if the worker is gone already. Its pidfd is kept from here on."""
        host = pidns.pid_of_pidfd(pidfd[0]) if pidfd else None
        if host is not None and host > 0 and host_pids is not None:
            host_pids.remember(pid, host)
        if host is None:
            host = host_pids.of(pid) if host_pids is not None else pid
        if host > 0 and pidfd:
            self.have_pidfds = True
            self.forget(host)  # (a stale one: never, as its Exited closes it first)
            self.pidfds[host] = pidfd[0]
        return host

    def signal(self, pid: int) -> None:
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

    def forget(self, pid: int) -> None:
        fd = self.pidfds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def forget_all(self) -> None:
        for pid in list(self.pidfds):
            self.forget(pid)

    def abandon(self, pid: int, why: str) -> None:
        self.abandoned[pid] = why
        while len(self.abandoned) > MAX_ABANDONED:
            oldest = next(iter(self.abandoned))
            self.abandoned.pop(oldest)
            self.forget(oldest)


def result_from_reply(job: Job, reply: Reply, executor: str) -> Result:
    """The result of a worker's reply (its fields' types already checked by ``Reply.from_wire``).
    The error and signals are validated as protocol values, since tool code shares the worker's
    process; what the supervisor knows itself is not. This runs on every call, so it avoids
    validating twice."""
    error = None if reply.ok else ErrorInfo.model_validate(reply.error)
    stats = Stats(wall_s=reply.wall_s, cpu_s=reply.cpu_s, peak_rss_kb=reply.peak_rss_kb)
    return Result.model_construct(
        id=job.call_id, ok=reply.ok, value=reply.value, value_is_repr=reply.value_is_repr, error=error,
        stdout="", stderr="", signals=[Signal.model_validate(s) for s in reply.signals], worker=None, stats=stats,
        limits=job.limits, executor=executor)


def death_result(job: Job, sig: int, code: int | None, oom: bool = False, cpu_s: float = 0.0) -> Result:
    """The failure a call gets from how its worker died (``Exited``)."""
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
