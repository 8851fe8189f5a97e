"""The supervisor: owns the ROUTER socket, never runs tool code.

It answers ``hello`` and ``ping`` at any time, queues calls for N workers, enforces each call's
wall-clock deadline by killing the worker, caps output, turns every way a worker can die into a
result of a known kind, replaces dead workers from the template, and answers a repeated call id from
its cache instead of running it again. One event loop, one thread; timing constants are below.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from executor import framing
from executor.limits import effective_limits
from executor.worker import template_main
from protocol import (
    MAX_FRAME_BYTES,
    BindError,
    Call,
    Cancel,
    ErrorInfo,
    Hello,
    Limits,
    Ping,
    Pong,
    ProtocolError,
    Result,
    Signal,
    Stats,
    ToolSpec,
    Welcome,
    WorkerInfo,
    decode,
    encode,
)

log = logging.getLogger("ciayn-executor")

TEMPLATE_START_TIMEOUT = 60.0  # importing tool modules may be slow
EXIT_STATUS_WAIT = 2.0  # after a worker's channel closes, how long to wait for its exit status
RESULT_CACHE_SIZE = 4096  # recent results kept to answer resent call ids...
RESULT_CACHE_BYTES = 128 * 1024 * 1024  # ...and at most this many encoded bytes of them (a result may be MBs)
POLL_MAX_MS = 1000
SPIN_AFTER_DISPATCH = 0.0003  # seconds of polling without sleep after a dispatch (quick calls' replies)
SHUTDOWN_LINGER_MS = 500


class StartupError(Exception):
    """The executor cannot start (tool modules fail to import, endpoint in use, ...)."""


@dataclass
class Job:
    call: Call
    call_id: str
    waiters: list[bytes]
    limits: Limits
    started: float = 0.0
    deadline: float = 0.0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    outcome: Result | None = None  # decided by the supervisor (timeout, cancel, output cap)


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


class Supervisor:
    def __init__(
        self,
        tools: list[str],
        endpoint: str,
        *,
        limits: Limits,
        workers: int = 1,
        max_queue: int = 256,
        workspace: str | None = None,
        parent_pid: int | None = None,
        profile: str = "default",
        use_cgroups: bool = True,
        curve_secret: str | None = None,
        curve_clients: str | None = None,
    ) -> None:
        self.targets = tools
        self.endpoint = endpoint
        self.limits = limits
        self.n_workers = max(1, workers)
        self.max_queue = max_queue
        self.workspace = workspace
        self.parent_pid = parent_pid
        self.profile = profile
        self.use_cgroups = use_cgroups
        self.spin_until = 0.0
        self.curve_secret = curve_secret
        self.curve_clients = curve_clients
        self.auth: Any = None
        self.cgroups = ""
        self.executor_id = uuid.uuid4().hex[:12]
        self.incarnation = time.time_ns() // 1000 % (1 << 53)  # distinct across restarts
        self.specs: dict[str, ToolSpec] = {}
        self.slots = [Slot(id=i) for i in range(self.n_workers)]
        self.queue: collections.deque[Job] = collections.deque()
        self.jobs: dict[str, Job] = {}
        self.cache: collections.OrderedDict[str, list[bytes]] = collections.OrderedDict()  # id -> encoded result
        self.cache_bytes = 0
        self.fd_owner: dict[int, tuple[Slot, str]] = {}
        self.stopping = False
        self.exit_code = 0  # 1 when it stops because it cannot go on (the template died)
        self.template_pid = 0
        self.template: socket.socket | None = None
        self.ipc_identity: tuple[int, int] | None = None  # (device, inode) of our ipc socket file

    # ---------------------------------------------------------------- start-up and shutdown

    def start_template(self) -> None:
        """Fork the template before any ZeroMQ context exists, and learn the tool specs from it."""
        if self.workspace:
            os.environ["CIAYN_WORKSPACE"] = os.path.abspath(self.workspace)
            os.chdir(self.workspace)
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

    def serve(self) -> int:
        parent_fd = self._watch_parent()  # first: a dead parent must not leave a socket file behind
        self._check_ipc_free()
        self.start_template()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.auth = None
        if self.curve_secret:
            from executor.curve import CurveError, secure_server

            try:
                self.auth = secure_server(ctx, sock, self.curve_secret, self.curve_clients)
            except CurveError as e:
                sock.close(0)
                ctx.term()
                self._stop_template()
                raise StartupError(str(e)) from None
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self._stop_template()
            raise StartupError(f"cannot bind {self.endpoint}: {e}") from None
        self.sock = sock
        path = self._ipc_path()
        self.ipc_identity = _file_identity(path) if path else None
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.template.fileno() if self.template else -1, zmq.POLLIN)
        self.poller.register(wake_r, zmq.POLLIN)
        if parent_fd is not None:
            self.poller.register(parent_fd, zmq.POLLIN)
        for slot in self.slots:
            self._spawn(slot)
        log.info(
            "serving %d tools on %s (workers: %d, profile: %s, timeout %.0fs, memory %d MB, cgroups: %s, curve: %s)",
            len(self.specs), self.endpoint, self.n_workers, self.profile, self.limits.timeout_s,
            self.limits.memory_mb, self.cgroups or "none (rlimits and subreaper only)",
            self._curve_description(),
        )
        if self.endpoint.startswith("tcp://") and not self.curve_secret and not _loopback(self.endpoint):
            log.warning("serving on %s without CurveZMQ: anyone who can reach this address can run these tools; "
                        "use --curve-secret (and --curve-clients) or bind to 127.0.0.1", self.endpoint)
        try:
            self._loop(wake_r, parent_fd)
        finally:
            self._shutdown(ctx)
        return self.exit_code

    def _curve_description(self) -> str:
        if not self.curve_secret:
            return "off"
        return f"clients in {self.curve_clients}" if self.curve_clients else "any client key"

    def _ipc_path(self) -> str | None:
        """The socket file of an ``ipc://`` endpoint (not of an abstract ``ipc://@name`` one)."""
        path = self.endpoint[len("ipc://") :] if self.endpoint.startswith("ipc://") else ""
        return path if path and not path.startswith("@") else None

    def _check_ipc_free(self) -> None:
        """ZeroMQ binds an ipc path by replacing whatever file is there, so a second executor would
        silently take a live one's endpoint (and the first, stopping, would then delete the second's
        socket file). Refuse if something accepts connections there; a stale file is replaced."""
        path = self._ipc_path()
        if path is None or not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            return  # nobody listening: a file left by an executor that died
        finally:
            probe.close()
        raise StartupError(f"cannot bind {self.endpoint}: another process is serving on it")

    def _watch_parent(self) -> int | None:
        if not self.parent_pid:
            return None
        try:
            return os.pidfd_open(self.parent_pid)
        except ProcessLookupError:
            raise StartupError(f"parent process {self.parent_pid} is not running") from None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    def _shutdown(self, ctx: zmq.Context[Any]) -> None:
        log.info("shutting down")
        for job in list(self.jobs.values()):
            self._finish(job, Result.failure(job.call_id, "cancelled", "the executor is shutting down"))
        for slot in self.slots:
            if slot.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGKILL)
            self._close_slot(slot)
        self._stop_template()
        if self.cgroups:  # the template removes its workers' groups; this is the backstop
            from executor.cgroups import CgroupSupport

            support = CgroupSupport.detect()
            if support is not None:
                support.remove_named(f"{self.executor_id}-")
        self.sock.close(linger=SHUTDOWN_LINGER_MS)
        if self.auth is not None:
            self.auth.stop()
        ctx.term()
        path = self._ipc_path()
        if path and self.ipc_identity is not None and _file_identity(path) == self.ipc_identity:
            with contextlib.suppress(OSError):
                os.unlink(path)  # only our own socket file, not one a later executor bound there

    def _stop_template(self) -> None:
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

    # ---------------------------------------------------------------- the loop

    def _loop(self, wake_r: int, parent_fd: int | None) -> None:
        template_fd = self.template.fileno() if self.template else -1
        while not self.stopping:
            # Right after handing a call to a worker, poll without sleeping for a moment: a quick
            # call's reply is then read without the cost of waking this process up again.
            spinning = time.monotonic() < self.spin_until
            events = dict(self.poller.poll(0 if spinning else self._poll_timeout_ms()))
            now = time.monotonic()
            if wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            if parent_fd is not None and parent_fd in events:
                log.info("parent process %d exited; stopping", self.parent_pid)
                return
            if template_fd in events:
                self._on_template()
            for fd, mask in list(events.items()):
                owner = self.fd_owner.get(fd) if isinstance(fd, int) else None
                if owner is not None:
                    slot, what = owner
                    if what != "chan":
                        self._on_output(slot, fd, what)
                    else:
                        if mask & zmq.POLLOUT:
                            self._flush(slot)
                        if mask & ~zmq.POLLOUT:
                            self._on_worker(slot)
            if self.sock in events:
                self._on_socket()
            self._check_deadlines(now)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        wait = POLL_MAX_MS / 1000
        for slot in self.slots:
            if slot.job is not None and not slot.killed:
                wait = min(wait, slot.job.deadline - now)
            if slot.closed_at:
                wait = min(wait, slot.closed_at + EXIT_STATUS_WAIT - now)
        return max(0, int(wait * 1000) + 1)

    # ---------------------------------------------------------------- client messages

    def _on_socket(self) -> None:
        for _ in range(1000):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[1:]
            try:
                msg = decode(body)
            except ProtocolError as e:
                log.warning("protocol error from client %s: %s", ident.hex()[:8], e)
                self._send(ident, e.result())
                continue
            if isinstance(msg, Call):
                self._on_call(ident, msg)
            elif isinstance(msg, Ping):
                busy = sum(1 for s in self.slots if s.job is not None)
                self._send(ident, Pong(nonce=msg.nonce, executor=self.executor_id, incarnation=self.incarnation,
                                       busy=busy, queued=len(self.queue)))
            elif isinstance(msg, Hello):
                self._send(ident, Welcome(executor=self.executor_id, incarnation=self.incarnation,
                                          tools=list(self.specs.values()), limits=self.limits,
                                          workers=self.n_workers, profile=self.profile))
            elif isinstance(msg, Cancel):
                self._on_cancel(msg.id)
            else:
                self._send(ident, Result.failure("", "protocol", f"an executor does not accept {msg.KIND} messages"))

    @staticmethod
    def _encode(msg: Any) -> list[bytes]:
        try:
            return encode(msg)
        except ProtocolError as e:  # e.g. an oversized result: say so instead
            return encode(Result.failure(getattr(msg, "id", "") or "", "output_limit", str(e)))

    def _send(self, ident: bytes, msg: Any) -> None:
        """Send a message, or frames already encoded (a cached result)."""
        frames = msg if isinstance(msg, list) else self._encode(msg)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([ident, *frames], zmq.NOBLOCK)

    def _on_call(self, ident: bytes, call: Call) -> None:
        if not call.id:
            self._send(ident, Result.failure("", "protocol", "a call must carry an id"))
            return
        cid = call.id
        cached = self.cache.get(cid)
        if cached is not None:
            log.info("call %s %s: duplicate id, answered from cache", cid, call.tool)
            self._send(ident, cached)
            return
        running = self.jobs.get(cid)
        if running is not None:
            if ident not in running.waiters:
                running.waiters.append(ident)
            log.info("call %s %s: duplicate id joined the running call", cid, call.tool)
            return
        spec = self.specs.get(call.tool)
        if spec is None:
            names = ", ".join(sorted(self.specs))
            self._reply_now(ident, Result.failure(cid, "unknown_tool",
                                                  f"no tool named {call.tool!r}; available: {names}"))
            return
        try:
            spec.bind(call.args, call.kwargs)
        except BindError as e:
            self._reply_now(ident, Result.failure(cid, "bad_arguments", f"{e}; signature: {spec.name}{spec.signature}"))
            return
        if len(self.queue) >= self.max_queue:
            full = f"the executor's queue is full ({self.max_queue} calls)"
            self._send(ident, Result.failure(cid, "unavailable", full))
            return
        job = Job(call=call, call_id=cid, waiters=[ident], limits=effective_limits(self.limits, spec, call))
        self.jobs[cid] = job
        self.queue.append(job)
        self._dispatch()

    def _reply_now(self, ident: bytes, result: Result) -> None:
        result.executor = self.executor_id
        self._send(ident, self._remember(result))

    def _on_cancel(self, cid: str) -> None:
        job = self.jobs.get(cid)
        if job is None:
            return
        outcome = Result.failure(cid, "cancelled", "the call was cancelled")
        if job in self.queue:
            self.queue.remove(job)
            self._finish(job, outcome)
            return
        slot = next((s for s in self.slots if s.job is job), None)
        if slot is not None:
            job.outcome = outcome
            self._kill(slot, "cancelled")

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
            self.poller.unregister(self.template.fileno())
            self.template.close()
            self.template = None
            self.stopping = True
            self.exit_code = 1
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
                self.poller.register(fd, zmq.POLLIN)
            log.debug("worker %d/%d ready (pid %d)", slot.id, slot.incarnation, slot.pid)
            self._dispatch()
        elif msg["op"] == "exited":
            slot = next((s for s in self.slots if s.pid == msg["pid"]), None)
            if slot is not None:
                self._worker_gone(slot, msg.get("signal") or 0, msg.get("code"), oom=bool(msg.get("oom")))

    def _dispatch(self) -> None:
        while self.queue:
            slot = next((s for s in self.slots if s.idle), None)
            if slot is None:
                return
            job = self.queue.popleft()
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
            self._finish(job, result)
        if closed:
            self._unregister(slot.chan.fileno() if slot.chan else -1)
            if not slot.closed_at:
                slot.closed_at = time.monotonic()
        self._dispatch()

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

    def _check_deadlines(self, now: float) -> None:
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

    def _worker_gone(self, slot: Slot, sig: int, code: int | None, oom: bool = False) -> None:
        """The worker process is dead: finish its call, free its slot, make a new one."""
        job = slot.job
        if job is not None:
            self._drain_output(slot)
            wall = time.monotonic() - job.started
            result = job.outcome or self._death_result(job, sig, code, oom)
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
            self._finish(job, result)
        self._close_slot(slot)
        self._spawn(slot)

    def _death_result(self, job: Job, sig: int, code: int | None, oom: bool = False) -> Result:
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
        if fd >= 0 and self.fd_owner.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self.poller.unregister(fd)

    # ---------------------------------------------------------------- answers

    def _finish(self, job: Job, result: Result) -> None:
        self.jobs.pop(job.call_id, None)
        frames = self._remember(result)
        status = "ok" if result.ok else f"{result.error.kind if result.error else '?'}"
        wall = f" {result.stats.wall_s * 1000:.1f}ms" if result.stats else ""
        log.info("call %s %s: %s%s", job.call_id, job.call.tool, status, wall)
        for ident in job.waiters:
            self._send(ident, frames)

    def _remember(self, result: Result) -> list[bytes]:
        """Encode a result once, keep it to answer a resent id, and return the frames to send. The
        cache is bounded in entries and in bytes, oldest out first."""
        frames = self._encode(result)
        replaced = self.cache.pop(result.id, None)
        if replaced is not None:
            self.cache_bytes -= sum(len(f) for f in replaced)
        self.cache[result.id] = frames
        self.cache_bytes += sum(len(f) for f in frames)
        while len(self.cache) > RESULT_CACHE_SIZE or self.cache_bytes > RESULT_CACHE_BYTES:
            _, dropped = self.cache.popitem(last=False)
            self.cache_bytes -= sum(len(f) for f in dropped)
        return frames


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
