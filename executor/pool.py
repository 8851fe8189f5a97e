"""The worker pool: the template process and the N worker slots it keeps filled.

The pool hands a call to an idle worker, reads the worker's stdout, stderr and reply, enforces the
call's wall-clock deadline and output caps by killing the worker, and turns every way a worker can
die into a result of a known kind. It never runs tool code (the template and workers, in
``executor.worker``, do) and knows nothing of clients: finished calls go to ``on_done``, and it asks
``next_job`` for more work whenever a worker is free.
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

from executor import framing
from executor.calls import Job
from executor.worker import template_main
from protocol import ErrorInfo, Limits, Result, Signal, Stats, ToolSpec, WorkerInfo

log = logging.getLogger("ciayn-executor")

TEMPLATE_START_TIMEOUT = 60.0  # importing tool modules may be slow
EXIT_STATUS_WAIT = 2.0  # after a worker's channel closes, how long to wait for its exit status
SPIN_AFTER_DISPATCH = 0.0003  # seconds of polling without sleep after a dispatch (quick calls' replies)
POLL_MAX_S = 1.0


class StartupError(Exception):
    """The executor cannot start (tool modules fail to import, endpoint in use, ...)."""


@dataclass
class Slot:
    id: int
    incarnation: int = 0
    pid: int = 0
    chan: socket.socket | None = None
    reader: framing.Reader | None = None
    out_fd: int = -1
    err_fd: int = -1
    job: Job | None = None
    spawning: bool = False
    closed_at: float = 0.0  # when the channel closed and we await the exit status
    killed: bool = False
    seq: int = 0  # number of the request in flight: a reply must carry it
    outbuf: bytearray = field(default_factory=bytearray)  # request bytes the worker has not taken yet

    @property
    def idle(self) -> bool:
        return self.chan is not None and self.job is None and not self.killed and not self.closed_at


class WorkerPool:
    """The template and the worker slots, driven by the supervisor's poll loop."""

    def __init__(
        self,
        targets: list[str],
        *,
        limits: Limits,
        workers: int,
        executor_id: str,
        use_cgroups: bool,
        on_done: Callable[[Job, Result], None],
        next_job: Callable[[], Job | None],
    ) -> None:
        self.targets = targets
        self.limits = limits
        self.executor_id = executor_id
        self.use_cgroups = use_cgroups
        self.on_done = on_done
        self.next_job = next_job
        self.slots = [Slot(id=i) for i in range(max(1, workers))]
        self.specs: dict[str, ToolSpec] = {}
        self.cgroups = ""
        self.template_pid = 0
        self.template: socket.socket | None = None
        self.poller: zmq.Poller | None = None
        self.fd_owner: dict[int, tuple[Slot, str]] = {}
        self.spin_until = 0.0
        self.failed = False  # the template died: no new workers can be made
        self.stopping = False

    # ---------------------------------------------------------------- start-up and shutdown

    def start_template(self) -> None:
        """Fork the template before any ZeroMQ context exists, and learn the tool specs from it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            template_main(theirs, self.targets, self.limits, self.executor_id, self.use_cgroups)
        theirs.close()
        self.template_pid, self.template = pid, ours
        ours.settimeout(TEMPLATE_START_TIMEOUT)
        try:
            first = framing.recv(ours)
        except (EOFError, OSError) as e:
            raise StartupError(f"the tool template process died while importing the tools ({e})") from None
        ours.settimeout(None)
        if first.get("op") == "error":
            raise StartupError(first["message"])
        self.specs = {s["name"]: ToolSpec.model_validate(s) for s in first["specs"]}
        self.cgroups = first.get("cgroups") or ""

    def attach(self, poller: zmq.Poller) -> None:
        """Register with the supervisor's poller and start the workers."""
        self.poller = poller
        if self.template is not None:
            poller.register(self.template.fileno(), zmq.POLLIN)
        for slot in self.slots:
            self._spawn(slot)

    def stop(self) -> None:
        self.stopping = True
        for slot in self.slots:
            if slot.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGKILL)
            self._close_slot(slot)
        self.stop_template()
        if self.cgroups:  # the template removes its workers' groups; this is the backstop
            from executor.cgroups import CgroupSupport

            support = CgroupSupport.detect()
            if support is not None:
                support.remove_named(f"{self.executor_id}-")

    def stop_template(self) -> None:
        if self.template is not None:
            self.template.close()  # the template kills what is left and exits on EOF
            self.template = None
        if self.template_pid:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                pid, _ = os.waitpid(self.template_pid, os.WNOHANG)
                if pid:
                    break
                time.sleep(0.01)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.template_pid, signal.SIGKILL)
                os.waitpid(self.template_pid, 0)
            self.template_pid = 0

    # ---------------------------------------------------------------- the loop's view

    def busy(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    def spinning(self, now: float) -> bool:
        return now < self.spin_until

    def timeout_s(self, now: float) -> float:
        """How long the loop may sleep before a deadline or an exit-status wait needs it."""
        wait = POLL_MAX_S
        for slot in self.slots:
            if slot.job is not None and not slot.killed:
                wait = min(wait, slot.job.deadline - now)
            if slot.closed_at:
                wait = min(wait, slot.closed_at + EXIT_STATUS_WAIT - now)
        return wait

    def handle(self, events: dict[Any, int]) -> None:
        """Serve the pool's descriptors among the poller's events."""
        if self.template is not None and self.template.fileno() in events:
            self._on_template()
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
                if mask & ~zmq.POLLOUT:
                    self._on_worker(slot)

    def cancel(self, job: Job, outcome: Result) -> bool:
        """Stop a running job; its answer is ``outcome``. False if no worker runs it."""
        slot = next((s for s in self.slots if s.job is job), None)
        if slot is None:
            return False
        job.outcome = outcome
        self._kill(slot, "cancelled")
        return True

    def dispatch(self) -> None:
        """Hand queued calls to idle workers."""
        while True:
            slot = next((s for s in self.slots if s.idle), None)
            if slot is None:
                return
            job = self.next_job()
            if job is None:
                return
            job.started = time.monotonic()
            job.deadline = job.started + job.limits.timeout_s
            slot.job = job
            slot.seq += 1
            self.spin_until = time.monotonic() + SPIN_AFTER_DISPATCH
            request = {
                "seq": slot.seq,
                "tool": job.call.tool,
                "args": job.call.args,
                "kwargs": job.call.kwargs,
                "limits": job.limits.model_dump() if job.limits is not self.limits else None,
            }
            slot.outbuf += framing.pack(request)
            self._flush(slot)

    def check_deadlines(self, now: float) -> None:
        for slot in self.slots:
            job = slot.job
            if job is not None and not slot.killed and now >= job.deadline:
                job.outcome = Result.failure(
                    job.call_id, "timeout",
                    f"the tool ran past its {job.limits.timeout_s:g} s time limit and was killed")
                self._kill(slot, f"call {job.call_id} timed out")
            if slot.closed_at and now >= slot.closed_at + EXIT_STATUS_WAIT:
                if slot.pid and not slot.killed:
                    # The channel is gone but the process is not (a tool closed inherited fds): it can
                    # never answer again, so kill it and let the template report its death.
                    if job is not None and job.outcome is None:
                        job.outcome = Result.failure(
                            job.call_id, "crashed",
                            "the tool closed the worker's channel to the executor; the worker was killed")
                    self._kill(slot, "its channel closed but it did not exit")
                    slot.closed_at = now
                else:
                    self._worker_gone(slot, 0, None)

    # ---------------------------------------------------------------- workers

    def _spawn(self, slot: Slot) -> None:
        if self.template is None or slot.spawning or self.stopping:
            return
        slot.spawning = True
        framing.send(self.template, {"op": "spawn", "slot": slot.id})

    def _on_template(self) -> None:
        assert self.template is not None
        try:
            msg, fds = framing.recv_with_fds(self.template)
        except (EOFError, OSError):
            log.error("the template process died; no new workers can be made")
            if self.poller is not None:
                self.poller.unregister(self.template.fileno())
            self.template.close()
            self.template = None
            self.failed = True
            return
        if msg["op"] == "spawned":
            slot = self.slots[msg["slot"]]
            chan = socket.socket(fileno=fds[0])
            slot.chan, slot.reader = chan, framing.Reader(chan)
            slot.out_fd, slot.err_fd = fds[1], fds[2]
            os.set_blocking(slot.out_fd, False)
            os.set_blocking(slot.err_fd, False)
            slot.pid, slot.spawning, slot.killed, slot.closed_at = msg["pid"], False, False, 0.0
            slot.incarnation += 1
            for fd, what in ((chan.fileno(), "chan"), (slot.out_fd, "stdout"), (slot.err_fd, "stderr")):
                self.fd_owner[fd] = (slot, what)
                if self.poller is not None:
                    self.poller.register(fd, zmq.POLLIN)
            log.debug("worker %d/%d ready (pid %d)", slot.id, slot.incarnation, slot.pid)
            self.dispatch()
        elif msg["op"] == "exited":
            slot = next((s for s in self.slots if s.pid == msg["pid"]), None)
            if slot is not None:
                self._worker_gone(slot, msg.get("signal") or 0, msg.get("code"), oom=bool(msg.get("oom")))

    def _flush(self, slot: Slot) -> None:
        """Send what the worker has not taken yet, never blocking: a worker still busy (a tool that
        faked its reply) must not stall the supervisor. What is left waits for POLLOUT."""
        if slot.chan is None:
            return
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
            with contextlib.suppress(KeyError, zmq.ZMQError):
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
        assert slot.reader is not None
        try:
            replies, closed = slot.reader.feed()
        except framing.FrameError as e:
            replies, closed = [], True
            self._malformed(slot, e)
        for reply in replies:
            job = slot.job
            if job is None or not isinstance(reply, dict) or reply.get("seq") != slot.seq:
                # A reply to no request, or to another one: tool code wrote on the channel (a
                # forged reply, then the real one). Never let it answer some other call.
                self._malformed(slot, ValueError("a reply that does not match the request in flight"))
                break
            self._drain_output(slot)
            try:
                if not reply["ok"] and reply["error"]["kind"] == "memory":
                    slot.killed = True  # the worker exits after this reply; give it no more calls
                result = self._result_from_reply(job, slot, reply, restarted=slot.killed)
            except (TypeError, KeyError, ValueError) as e:  # ValidationError is a ValueError
                self._malformed(slot, e)  # the call is answered when the worker's death is reported
                break
            slot.job = None
            if job.outcome is not None:
                # Decided here before the reply was read (output over the cap found while draining,
                # or a deadline or cancel that raced the reply): that decision is the answer.
                result = job.outcome.model_copy(update={
                    k: getattr(result, k) for k in ("worker", "stats", "limits", "executor", "stdout", "stderr")})
            self.on_done(job, result)
        if closed:
            self._unregister(slot.chan.fileno() if slot.chan else -1)
            if not slot.closed_at:
                slot.closed_at = time.monotonic()
        self.dispatch()

    def _malformed(self, slot: Slot, problem: Exception) -> None:
        """The worker's channel carried something our worker code never sends: tool code wrote on
        it. Nothing more it says can be trusted; replace it."""
        log.error("worker %d sent a malformed message (%s); replacing it", slot.id, problem)
        if slot.job is not None and slot.job.outcome is None:
            slot.job.outcome = Result.failure(
                slot.job.call_id, "crashed",
                "the worker sent the executor a malformed message (did the tool write to a descriptor it "
                "inherited?); it was killed")
        self._kill(slot, "malformed message")

    def _result_from_reply(self, job: Job, slot: Slot, reply: dict[str, Any], restarted: bool) -> Result:
        """Build the result from a worker's reply. What the worker says (ok, value, error, signals,
        stats) is validated, since tool code shares its process; what the supervisor knows itself is
        not. This runs on every call, so it avoids validating twice."""
        ok = reply["ok"]
        if type(ok) is not bool:
            raise TypeError("the reply's ok is not a bool")
        error = None if ok else ErrorInfo.model_validate(reply["error"])
        signals = reply.get("signals") or ()
        stats = Stats(wall_s=reply.get("wall_s", 0.0), cpu_s=reply.get("cpu_s", 0.0),
                      peak_rss_kb=reply.get("peak_rss_kb", 0))
        return Result.model_construct(
            id=job.call_id,
            ok=ok,
            value=reply.get("value"),
            value_is_repr=reply.get("value_is_repr") is True,
            error=error,
            stdout=job.stdout.decode(errors="replace") if job.stdout else "",
            stderr=job.stderr.decode(errors="replace") if job.stderr else "",
            signals=[Signal.model_validate(s) for s in signals],
            worker=WorkerInfo.model_construct(id=slot.id, pid=slot.pid, incarnation=slot.incarnation,
                                              restarted=restarted),
            stats=stats,
            limits=job.limits,
            executor=self.executor_id,
        )

    def _kill(self, slot: Slot, why: str) -> None:
        if slot.pid and not slot.killed:
            log.info("killing worker %d (pid %d): %s", slot.id, slot.pid, why)
            slot.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.pid, signal.SIGKILL)

    def _worker_gone(self, slot: Slot, sig: int, code: int | None, oom: bool = False) -> None:
        """The worker process is dead: finish its call, free its slot, make a new one."""
        job = slot.job
        if job is not None:
            self._drain_output(slot)
            wall = time.monotonic() - job.started
            result = job.outcome or _death_result(job, sig, code, oom)
            assert result.error is not None
            if result.error.kind == "crashed":
                result.error.signal = sig or None
            result.worker = WorkerInfo(id=slot.id, pid=slot.pid, incarnation=slot.incarnation, restarted=True)
            result.stats = Stats(wall_s=wall)
            result.limits = job.limits
            result.executor = self.executor_id
            result.stdout = job.stdout.decode(errors="replace")
            result.stderr = job.stderr.decode(errors="replace")
            slot.job = None
            self.on_done(job, result)
        self._close_slot(slot)
        self._spawn(slot)

    def _close_slot(self, slot: Slot) -> None:
        for fd in (slot.chan.fileno() if slot.chan else -1, slot.out_fd, slot.err_fd):
            self._unregister(fd)
        if slot.chan is not None:
            slot.chan.close()
        for fd in (slot.out_fd, slot.err_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        slot.chan, slot.reader, slot.out_fd, slot.err_fd = None, None, -1, -1
        slot.pid, slot.closed_at, slot.killed = 0, 0.0, False
        slot.outbuf.clear()

    def _unregister(self, fd: int) -> None:
        if fd >= 0 and self.fd_owner.pop(fd, None) is not None and self.poller is not None:
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self.poller.unregister(fd)


def _death_result(job: Job, sig: int, code: int | None, oom: bool = False) -> Result:
    cid = job.call_id
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
