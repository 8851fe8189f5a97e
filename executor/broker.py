"""The broker: one endpoint in front of a pool of executors, for many controllers.

Controllers connect to the *frontend* ROUTER with the same ``ExecutorClient`` they use for one
executor, and the broker answers like one: ``hello`` with the pool's tools, ``ping`` with the pool's
load, ``status`` with every executor's. Executors (``ciayn-executor serve --connect``) connect a
DEALER to the *backend* ROUTER, announce themselves with ``ready`` (tools, limits, capacity, the call
ids they hold), and exchange heartbeats with the broker (``protocol.timing``).

Routing: a call goes to an executor that has its tool and a free worker, least loaded first; the
broker never sends an executor more calls than it has workers (nor than ``--max-executor-capacity``,
whatever it announces), so calls wait here, in one queue per client, served round-robin (a client
flooding calls cannot starve another). Two executors that advertise the same tool name with
different specs cannot both serve it: the second is refused, and keeps announcing itself (with
backoff) until the first is gone.

Executors are peers that may lie (anyone who can reach an ipc backend can join), so nothing one of
them announces decides what happens to another's calls or how long a client waits:

- A member is bound to its connection. When another connection announces the id of a member heard
  from lately, the member is asked to announce itself again (a ``bye``), and the newcomer takes the
  id only if the member neither does so nor speaks for ``CLAIM_WINDOW`` (its connection is gone: an
  executor that reconnected), or at once if the member's connection is gone for certain or both
  authenticated with the same CurveZMQ key (the same executor). Otherwise the newcomer is refused.
- The broker enforces each call's own deadline: an executor that has not answered a call by its
  timeout plus ``RESULT_GRACE`` has it answered ``timeout`` here (and is sent a ``cancel``); a call
  the executor says it is applying (a heartbeat's ``applying``) gets, once, the executor's apply grace,
  but never more than the broker's own ``--apply-grace``, which also bounds the welcome's.

Failures: an executor that says ``bye``, falls silent for ``PEER_EXPIRY`` or comes back as a new
incarnation loses its calls in flight; each is answered (``crashed`` when the executor went away,
``unavailable`` when it fell silent, saying the call may have run), except calls of ``idempotent``
tools, which run once more on another executor.

At most once, across a broker restart: the broker's incarnation names the pool, not the process
(it is derived from the frontend endpoint), so clients resend their calls in flight under the same
ids rather than give up on them; executors re-announce with the ids they hold, a resent id goes back
to the executor that has it (which answers from its cache or joins the running call), and for
``RECOVERY_WINDOW`` after start the broker sends no call elsewhere, so that every executor of the
previous run has announced what it holds first. During that window it also leaves clients' pings
and hellos unanswered: a client that had calls in flight through the previous run takes the silence
for a lost connection (Lazy Pirate), reconnects, and resends them as soon as the broker answers, so
the window must outlast the client's silence threshold (a test checks the constants agree).

Duplicates: the broker keeps the executor's at-most-once memory (``executor.calls.AtMostOnce``): the
ids it accepted, apart from a result cache bounded in bytes and fair per client (a client flooding
calls pushes out its own oldest answers, not another's). A resent id joins the call in flight, is
answered from that cache, or, once its answer is gone, is told it ran and is not run again: the
broker never sends an id it has seen to a second executor.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import zmq

from executor.calls import MAX_QUEUE_BYTES, RESULT_CACHE_BYTES, AtMostOnce, fingerprint, join
from executor.clientside.base import EndpointError
from executor.clientside.router import RouterEndpoint
from executor.fairqueue import FairQueue
from executor.journal import Journal
from executor.metrics import CallStats, MetricsServer
from executor.workers.limits import requested_timeout
from protocol import (
    Bye,
    Call,
    Cancel,
    ExecutorStatus,
    Heartbeat,
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
from protocol.errors import CiaynError
from protocol.fingerprint import canonical
from protocol.messages import BROKER_CAPACITY, MAX_TIMEOUT_S
from protocol.spec import MAX_TOOLS
from protocol.timing import (
    APPLY_GRACE,
    CLAIM_WINDOW,
    HEARTBEAT_INTERVAL,
    PEER_EXPIRY,
    RECOVERY_WINDOW,
    RESULT_GRACE,
)
from protocol.wire import LogBudget

log = logging.getLogger("ciayn-broker")

HELLO_WAIT = 10.0  # a `hello` before any executor joined waits this long for one
MAX_HELLOS = 4096  # clients waiting for that answer, at most (one entry per client)
LOCATION_TTL = 120.0  # how long an announced held id routes a resent call to its executor
MAX_LOCATIONS = 262_144
CLIENT_SHARE = 4  # one client may fill at most 1/CLIENT_SHARE of the queue's bytes


class BrokerError(CiaynError):
    """The broker cannot start (endpoint in use, bad keys)."""


@dataclass
class Job:
    """A call the broker accepted and has not answered yet."""

    call: Call
    frames: list[bytes]  # the call, encoded once, forwarded to whichever executor runs it
    key: int  # what a resend of its id must match (tool, arguments, timeout)
    client: bytes  # the route it came from: its fair-queue key
    waiters: list[bytes]
    spec: ToolSpec | None  # None while the broker is recovering and no executor announced the tool
    timeout: float
    queued_at: float
    member: Member | None = None
    sent_at: float = 0.0
    run_timeout: float = 0.0  # the timeout the executor it was sent to applies to it
    deadline: float = 0.0  # when the broker stops waiting for that executor's answer
    granted: float = 0.0  # apply grace given (once), when the executor said it is applying the call
    tried: list[str] = field(default_factory=list)  # executors it was sent to
    nbytes: int = 0  # encoded size of its tool, arguments and timeout: what the queue's bound counts


@dataclass
class Member:
    """An executor connected to the backend: its identity is its connection (``route``)."""

    route: bytes
    ready: Ready
    last_heard: float
    capacity: int  # calls sent to it at once, at most: its announced capacity, clamped by the broker
    probed_at: float = float("-inf")  # when another connection's claim on its id last asked it to announce itself
    running: dict[str, Job] = field(default_factory=dict)
    stats: CallStats = field(default_factory=CallStats)
    tool_names: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.tool_names = frozenset(t.name for t in self.ready.tools)

    @property
    def id(self) -> str:
        return self.ready.executor

    @property
    def free(self) -> int:
        return self.capacity - len(self.running)


@dataclass
class Claim:
    """Another connection announced the id of a live member: the newcomer waits (not a member) until
    the member shows it is alive (then the newcomer is refused) or stays silent (then it goes)."""

    route: bytes  # the newcomer's connection
    ready: Ready
    at: float
    holder: bytes  # the member's connection


class Broker:
    def __init__(
        self,
        frontend: str,
        backend: str,
        *,
        curve_secret: str | None = None,
        curve_clients: str | None = None,
        curve_executors: str | None = None,
        max_queue: int = 65536,
        max_queue_per_client: int = 16384,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
        recovery_s: float = RECOVERY_WINDOW,
        metrics: str | None = None,
        insecure: bool = False,
        state_dir: str | None = None,
        cache_bytes: int = RESULT_CACHE_BYTES,
        apply_grace: float = APPLY_GRACE,
        max_executor_capacity: int = BROKER_CAPACITY,
        max_timeout: float = MAX_TIMEOUT_S,
    ) -> None:
        self.frontend_endpoint = frontend
        self.backend_endpoint = backend
        self.curve_secret = curve_secret
        self.curve_clients = curve_clients
        self.curve_executors = curve_executors
        self.max_queue = max_queue
        self.max_queue_per_client = max_queue_per_client
        self.max_queue_bytes = max_queue_bytes
        self.recovery_s = recovery_s
        self.metrics_address = metrics
        self.insecure = insecure
        self.state_dir = state_dir
        self.apply_grace = apply_grace  # the most a call's answer may come after its deadline for its writes
        self.max_executor_capacity = max_executor_capacity
        self.max_timeout = max_timeout  # a ceiling on every call's timeout in the pool (--max-timeout)
        self.journal: Journal | None = None
        self.broker_id = "broker-" + uuid.uuid4().hex[:8]
        digest = hashlib.sha256(frontend.encode()).digest()
        self.incarnation = int.from_bytes(digest[:6], "big")  # the pool's, stable across restarts
        self.started = time.monotonic()
        self.recovering = recovery_s > 0
        self.members: dict[bytes, Member] = {}
        self.claims: dict[str, Claim] = {}  # executor id -> a newcomer waiting to take it (one per id)
        self.specs: dict[str, ToolSpec] = {}  # the one spec of each tool name in the pool
        self.jobs: dict[str, Job] = {}
        self.waiting: FairQueue[Job] = FairQueue()
        self.calls = AtMostOnce(cache_bytes=cache_bytes)  # the ids accepted, and recent answers
        self.locations: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self.held_by: dict[str, collections.OrderedDict[str, None]] = {}  # executor -> its ids in locations
        self.hellos: list[tuple[bytes, float]] = []  # waiting for the first executor
        self.stats = CallStats()
        self.stopping = False
        self.next_heartbeat = 0.0
        self.next_sweep = 0.0
        self.metrics: MetricsServer | None = None
        # What peers send is logged at a bounded rate: a flood of bad messages cannot fill the disk.
        self.client_complaints = LogBudget(log, "protocol errors from clients")
        self.executor_complaints = LogBudget(log, "protocol errors from executors")
        self.refusals = LogBudget(log, "refused executors")

    # ---------------------------------------------------------------- sockets

    def _open(self) -> None:
        """Two bound ROUTERs with the executor's endpoint rules (private ipc, CurveZMQ on tcp unless
        --insecure, no answer dropped by a high-water mark). Each in its own context: a context has one
        ZAP authenticator with one policy, and the frontend admits controllers' keys while the backend
        admits executors' keys."""
        self.contexts: list[zmq.Context[Any]] = []
        self.frontend: RouterEndpoint | None = None
        self.backend: RouterEndpoint | None = None
        for which, endpoint, allowed in (("frontend", self.frontend_endpoint, self.curve_clients),
                                         ("backend", self.backend_endpoint, self.curve_executors)):
            if allowed and not self.curve_secret:
                raise BrokerError(f"a {which} key directory needs --curve-secret (the broker's own key)")
            if which == "backend" and self.curve_secret and not allowed and not self.insecure:
                raise BrokerError("with --curve-secret the backend needs --curve-executors DIR: otherwise any key "
                                  "could join as an executor, read every call and answer it (or pass --insecure)")
            ctx: zmq.Context[Any] = zmq.Context()
            self.contexts.append(ctx)
            try:
                side = RouterEndpoint(ctx, endpoint, curve_secret=self.curve_secret, curve_clients=allowed,
                                      insecure=self.insecure, handover=which == "frontend")
            except EndpointError as e:
                raise BrokerError(f"{which}: {e}") from None
            if which == "frontend":
                self.frontend = side
            else:
                self.backend = side

    def close(self) -> None:
        for side in (getattr(self, "frontend", None), getattr(self, "backend", None)):
            if side is not None:
                side.close()
        for ctx in getattr(self, "contexts", []):
            ctx.term()
        if self.metrics is not None:
            self.metrics.close()
        if self.journal is not None:
            self.journal.close()

    # ---------------------------------------------------------------- the loop

    def serve(self) -> int:
        try:
            self._open()
            if self.metrics_address:
                self.metrics = MetricsServer(self.metrics_address)
            if self.state_dir:
                self.journal = Journal(self.state_dir)
                log.info("journal %s: %d calls sent by earlier runs", self.journal.path, len(self.journal.previous))
        except OSError as e:
            self.close()
            raise BrokerError(f"cannot use the state directory {self.state_dir}: {e}") from None
        except (BrokerError, ValueError) as e:
            self.close()
            raise BrokerError(str(e)) from None
        assert self.frontend is not None and self.backend is not None
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        poller = zmq.Poller()
        poller.register(self.frontend.socket, zmq.POLLIN)
        poller.register(self.backend.socket, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        log.info("broker %s: clients on %s, executors on %s (recovering for %.1f s)", self.broker_id,
                 self.frontend.describe(), self.backend.describe(), self.recovery_s)
        try:
            while not self.stopping:
                events = dict(poller.poll(self._poll_ms()))
                if wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                if self.backend.socket in events:
                    self._on_backend()
                if self.frontend.socket in events:
                    self._on_frontend()
                self._tick(time.monotonic())
        finally:
            log.info("broker stopping")  # executors notice the silence and reconnect to its next run
            self.close()
            os.close(wake_r)
            os.close(wake_w)
        return 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    def _poll_ms(self) -> int:
        assert self.frontend is not None and self.backend is not None
        now = time.monotonic()
        wait = min(self.next_heartbeat - now, self.next_sweep - now, self.frontend.tick(now), self.backend.tick(now))
        return max(0, int(wait * 1000) + 1)

    def _tick(self, now: float) -> None:
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL
            beat = encode(Heartbeat(executor=self.broker_id))
            for route in list(self.members):
                self._send_frames_backend(route, beat)
        self.client_complaints.flush(now)
        self.executor_complaints.flush(now)
        self.refusals.flush(now)
        if now < self.next_sweep:
            return
        self.next_sweep = now + min(HEARTBEAT_INTERVAL, 0.25)
        if self.recovering and now - self.started >= self.recovery_s:
            self._end_recovery()
        self._decide_claims(now)  # first: a silent member whose id a newcomer claims hands its calls over
        for member in list(self.members.values()):
            if now - member.last_heard > PEER_EXPIRY:
                self._drop(member, "unavailable", f"fell silent for {now - member.last_heard:.1f} s")
        self._expire_queued(now)
        self._expire_running(now)
        self._answer_hellos(now)
        while self.locations and next(iter(self.locations.values()))[1] < now:
            self._unlocate(next(iter(self.locations)))
        if self.metrics is not None and self.metrics.due(now):
            self.metrics.publish(self.report(now), now)

    def _end_recovery(self) -> None:
        self.recovering = False
        log.info("recovery window over: %d executors, %d tools", len(self.members), len(self.specs))
        self._adopt_specs(final=True)
        for job in list(self.waiting):
            if self._earlier_run(job) is not None:
                self.waiting.remove(job)
                self._place_earlier(job)
        self._dispatch()

    def _adopt_specs(self, final: bool) -> None:
        """Queued calls whose tool no executor had announced (while recovering, or while the pool was
        empty) are checked once it is known; when ``final``, an unknown tool is ``unknown_tool``."""
        for job in [j for j in self.waiting if j.spec is None]:
            self._resolve_spec(job, final)

    # ---------------------------------------------------------------- clients

    def _on_frontend(self) -> None:
        assert self.frontend is not None
        for route, msg in self.frontend.receive():
            if isinstance(msg, ProtocolError):
                self.client_complaints.warning("protocol error from client %s: %s", route.hex()[:8], msg)
                self._send_frontend(route, msg.reply())
                continue
            if isinstance(msg, Call):
                self._on_call(route, msg)
            elif isinstance(msg, Ping):
                if self.recovering:
                    continue  # silent on purpose: see the module docstring
                busy = sum(len(m.running) for m in self.members.values())
                self._send_frontend(route, Pong(nonce=msg.nonce, executor=self.broker_id,
                                                incarnation=self.incarnation, busy=busy, queued=len(self.waiting)))
            elif isinstance(msg, Hello):
                if self.members and not self.recovering:
                    self._send_frontend(route, self.welcome())
                elif len(self.hellos) < MAX_HELLOS and all(r != route for r, _ in self.hellos):
                    self.hellos.append((route, time.monotonic() + HELLO_WAIT))
            elif isinstance(msg, Cancel):
                self._on_cancel(route, msg.id)
            elif isinstance(msg, Status):
                self._send_frontend(route, self.report(time.monotonic()))
            else:
                self._send_frontend(route, Result.failure("", "protocol", f"a broker's frontend does not accept "
                                                          f"{msg.KIND} messages"))
        self._dispatch()

    def welcome(self) -> Welcome:
        """The pool as one executor: every tool, the longest default timeout, all the workers, the
        apply grace of its executors, at most the broker's own (which it enforces, section 12), and
        the longest any call runs (the broker's ceiling, or less if every executor's is less)."""
        members = list(self.members.values())
        limits = max((m.ready.limits for m in members), key=lambda lim: lim.timeout_s, default=Limits())
        if limits.timeout_s > self.max_timeout:
            limits = limits.model_copy(update={"timeout_s": self.max_timeout})
        profiles = {m.ready.profile for m in members}
        return Welcome(executor=self.broker_id, incarnation=self.incarnation,
                       tools=[self.specs[n] for n in sorted(self.specs)], limits=limits,
                       workers=sum(m.capacity for m in members),
                       profile=profiles.pop() if len(profiles) == 1 else "mixed" if profiles else "default",
                       apply_grace_s=min(self.apply_grace, max((m.ready.apply_grace_s for m in members), default=0.0)),
                       max_timeout_s=min(self.max_timeout, max((m.ready.max_timeout_s for m in members),
                                                               default=self.max_timeout)))

    def _answer_hellos(self, now: float) -> None:
        if not self.hellos:
            return
        ready = bool(self.members) and not self.recovering
        waiting = []
        for route, deadline in self.hellos:
            if ready or now >= deadline:
                self._send_frontend(route, self.welcome())
            else:
                waiting.append((route, deadline))
        self.hellos = waiting

    def _on_call(self, route: bytes, call: Call) -> None:
        cid = call.id
        if not cid:
            self._send_frontend(route, Result.failure("", "protocol", "a call must carry an id"))
            return
        nbytes, key = fingerprint(call)  # a resend of the id must match key (tool, arguments, timeout)
        job = self.jobs.get(cid)
        seen = join(cid, job.waiters, job.key, route, key) if job is not None else self.calls.answer(cid, key)
        if seen is not None:
            if seen.frames is not None:
                self._send_frames_frontend(route, seen.frames)
            elif seen.refusal is not None:
                self._answer_now(route, seen.refusal)
            return
        now = time.monotonic()
        spec = self.specs.get(call.tool)  # arguments are bound by the executor (it answers bad_arguments)
        if spec is None and self.members and not self.recovering:
            names = ", ".join(sorted(self.specs))
            self._answer_now(route, Result.failure(cid, "unknown_tool",
                                                   f"no tool named {call.tool!r} in the pool; available: {names}"))
            return
        full = self._queue_full(route, nbytes)
        if full:
            self._answer_now(route, Result.failure(cid, "unavailable", f"the broker's queue is full ({full}); the "
                                                   "call did not run"))
            return
        job = Job(call=call, frames=_encode(call), client=route, waiters=[route], spec=spec,
                  timeout=self._timeout(call, spec), queued_at=now, key=key, nbytes=nbytes)
        self.jobs[cid] = job
        self.calls.record(cid, key, now)
        held_by = self._unlocate(cid)
        member = self._member_by_id(held_by[0]) if held_by else None
        if member is not None:
            self._send_job(job, member)  # it holds this id: it answers from its cache or joins the call
            return
        if not self.recovering and self._place_earlier(job):
            return
        self.waiting.push(job)

    def _queue_full(self, client: bytes, nbytes: int) -> str:
        """Why a call of ``nbytes`` from ``client`` does not fit in the queue ("" if it does): bounded in
        calls and in encoded bytes, in all and per client (so that one client's flood leaves room for
        the others' calls)."""
        q, mib = self.waiting, 1024**2
        if len(q) >= self.max_queue:
            return f"{len(q)} calls waiting"
        if q.of(client) >= self.max_queue_per_client:
            return f"this client has {q.of(client)} calls waiting, its most"
        if q.bytes + nbytes > self.max_queue_bytes:
            return (f"{q.bytes / mib:.1f} MiB waiting, {nbytes / mib:.1f} MiB more would pass its "
                    f"{self.max_queue_bytes // mib} MiB")
        share = self.max_queue_bytes // CLIENT_SHARE
        if q.bytes_of(client) and q.bytes_of(client) + nbytes > share:  # one call always fits
            return (f"this client has {q.bytes_of(client) / mib:.1f} MiB waiting, {nbytes / mib:.1f} MiB more "
                    f"would pass its share, {share / mib:g} MiB")
        return ""

    def _earlier_run(self, job: Job) -> Member | Result | None:
        """For a call an earlier run of the broker sent to an executor (the journal says so): that
        executor, if it is back (it knows the id); else, unless the tool is idempotent, the answer that
        it may have run. None: a call like any other."""
        cid = job.call.id or ""
        executor = self.journal.previous.get(cid) if self.journal is not None else None
        if executor is None:
            return None
        member = self._member_by_id(executor)
        if member is not None:
            return member
        if job.spec is not None and job.spec.idempotent:
            return None
        return Result.failure(cid, "unavailable", f"before the broker restarted it sent this call to executor "
                              f"{executor}, which has not come back: the call may have run, so it was not run again")

    def _place_earlier(self, job: Job) -> bool:
        """Act on ``_earlier_run``; True if the call was sent or answered."""
        outcome = self._earlier_run(job)
        if isinstance(outcome, Member):
            self._send_job(job, outcome)
        elif isinstance(outcome, Result):
            self._finish(job, outcome)
        return outcome is not None

    def _timeout(self, call: Call, spec: ToolSpec | None) -> float:
        """How long a call may wait in the queue: the timeout it asks for, at most the ceiling."""
        return min(requested_timeout(self.welcome_timeout(), spec, call), self._ceiling(call))

    def welcome_timeout(self) -> float:
        return max((m.ready.limits.timeout_s for m in self.members.values()), default=Limits().timeout_s)

    def _resolve_spec(self, job: Job, final: bool) -> None:
        spec = self.specs.get(job.call.tool)
        if spec is None:
            if final and self.members:
                names = ", ".join(sorted(self.specs))
                self.waiting.remove(job)
                self._finish(job, Result.failure(job.call.id or "", "unknown_tool",
                                                 f"no tool named {job.call.tool!r} in the pool; available: {names}"),
                             ran=False)
            return
        job.spec = spec
        job.timeout = self._timeout(job.call, spec)

    def _on_cancel(self, route: bytes, cid: str) -> None:
        job = self.jobs.get(cid)
        if job is None or route not in job.waiters:
            return  # only a client waiting for a call may cancel it
        if job.member is None:
            self.waiting.remove(job)
            self._finish(job, Result.failure(cid, "cancelled", "the call was cancelled before it ran"))
        else:
            self._send_backend(job.member.route, Cancel(id=cid))

    # ---------------------------------------------------------------- routing

    def _dispatch(self) -> None:
        """Free workers take waiting calls, clients in turn (``executor.fairqueue``)."""
        while self.waiting and any(m.free > 0 for m in self.members.values()):
            taken = self.waiting.take(self._pick)
            if taken is None:
                return
            self._send_job(*taken)

    def _pick(self, job: Job) -> Member | None:
        """The least loaded executor with the tool, a free worker, and that did not try this call."""
        if job.spec is None or self.recovering:
            return None
        best: Member | None = None
        for m in self.members.values():
            if m.free <= 0 or m.id in job.tried or job.spec.name not in m.tool_names:
                continue
            if best is None or len(m.running) * best.capacity < len(best.running) * m.capacity:
                best = m
        return best

    def _send_job(self, job: Job, member: Member) -> None:
        job.member = member
        job.sent_at = time.monotonic()
        job.run_timeout = self._timeout_on(job, member)
        job.deadline, job.granted = job.sent_at + job.run_timeout + RESULT_GRACE, 0.0
        if member.id not in job.tried:
            job.tried.append(member.id)
        member.running[job.call.id or ""] = job
        if self.journal is not None:
            self.journal.record(job.call.id or "", member.id)
        self._send_frames_backend(member.route, self._frames_for(job, member))

    def _expire_queued(self, now: float) -> None:
        """A call that waited in the queue for its whole timeout is answered: it did not run."""
        for job in self.waiting.expire(now):
            why = (f"no executor with the tool {job.call.tool!r} had a free worker"
                   if self.members else "no executor is connected to the broker")
            self._finish(job, Result.failure(job.call.id or "", "unavailable",
                                             f"{why} for {job.timeout:g} s; the call did not run"), ran=False)

    def _expire_running(self, now: float) -> None:
        """A call its executor has not answered by its deadline is answered here, whatever the
        executor announced: ``timeout``, and the executor is asked to cancel it."""
        for member in list(self.members.values()):
            for cid, job in list(member.running.items()):
                if now < job.deadline:
                    continue
                del member.running[cid]
                self._send_backend(member.route, Cancel(id=cid))
                applied = (f" and the {job.granted:g} s it was given to apply the call's workspace writes"
                           if job.granted else "")
                log.warning("call %s %s: executor %r did not answer in time; answered timeout", cid,
                            job.call.tool[:64], member.id)
                self._finish(job, Result.failure(
                    cid, "timeout", f"executor {member.id!r} did not answer within the call's timeout "
                    f"({job.run_timeout:g} s) plus {RESULT_GRACE:g} s{applied}; the broker stopped waiting and "
                    "asked it to cancel the call, which may have run (partly or wholly)"))

    def _grant_apply(self, member: Member, ids: list[str], now: float) -> None:
        """The executor says these calls answered in time and their workspace writes are being
        applied: wait for each, once, its apply grace, at most the broker's own ``apply_grace``."""
        grace = min(member.ready.apply_grace_s, self.apply_grace)
        if grace <= 0:
            return
        for cid in ids:
            job = member.running.get(cid)
            if job is not None and not job.granted:
                job.granted = grace
                job.deadline = max(job.deadline, now + grace + RESULT_GRACE)

    def _timeout_on(self, job: Job, member: Member) -> float:
        """The timeout ``member`` applies to ``job``: the call's, else the tool's, else its default
        (``executor.workers.limits.requested_timeout``), at most its own ceiling and the broker's, whatever
        it announced (``_frames_for`` tells it the broker's)."""
        asked = requested_timeout(member.ready.limits.timeout_s, job.spec, job.call)
        return min(asked, member.ready.max_timeout_s, self._ceiling(job.call))

    def _ceiling(self, call: Call) -> float:
        """The broker's --max-timeout, or the call's own ``max_timeout`` if that is less."""
        return min(self.max_timeout, call.max_timeout or MAX_TIMEOUT_S)

    def _frames_for(self, job: Job, member: Member) -> list[bytes]:
        """The call as ``member`` is sent it: as the client sent it, unless the timeout it would run
        under on its own is over the broker's ceiling; then with that ceiling as its ``max_timeout``,
        which is not part of what makes the call that call (section 8): a resend of its id still
        matches, also one sent on by a broker restarted with another ceiling."""
        own = min(requested_timeout(member.ready.limits.timeout_s, job.spec, job.call), member.ready.max_timeout_s)
        if own <= self._ceiling(job.call):
            return job.frames
        return _encode(job.call.model_copy(update={"max_timeout": self._ceiling(job.call)}))

    # ---------------------------------------------------------------- executors

    def _on_backend(self) -> None:
        assert self.backend is not None
        for route, msg in self.backend.receive():
            now = time.monotonic()
            member = self.members.get(route)
            if member is not None:
                member.last_heard = now
            if isinstance(msg, ProtocolError):
                self.executor_complaints.warning("protocol error from executor %s: %s",
                                                 repr(member.id) if member else route.hex()[:8], msg)
                continue
            if isinstance(msg, Result):
                self._on_result(route, member, msg)
            elif isinstance(msg, Ready):
                self._on_ready(route, msg)
            elif isinstance(msg, Heartbeat):
                if member is not None:
                    if msg.applying:
                        self._grant_apply(member, msg.applying, now)
                elif self._claim_of(route) is None:  # we restarted, or dropped it: it must announce itself
                    self._send_backend(route, Bye(reason="unknown executor; announce again"))
            elif isinstance(msg, Bye):
                if member is not None:
                    self._drop(member, "crashed", f"left ({msg.reason or 'no reason given'})")
                elif (claim := self._claim_of(route)) is not None:
                    del self.claims[claim.ready.executor]
            else:
                self.executor_complaints.warning("executor %s sent a %s message; ignored",
                                                 repr(member.id) if member else "?", msg.KIND)
        self._dispatch()

    def _on_ready(self, route: bytes, ready: Ready) -> None:
        now = time.monotonic()
        claim = self._claim_of(route)
        if claim is not None:  # a newcomer announcing again starts over
            del self.claims[claim.ready.executor]
        for claim in [c for c in self.claims.values() if c.holder == route]:
            self._alive(claim)  # the member whose id is claimed announced itself again
        previous = self._member_by_id(ready.executor)
        conflict = self._conflict(ready, previous)
        if conflict:
            self._refuse(route, ready.executor, conflict)
            return
        if previous is not None and previous.route != route and not self._may_take_over(route, previous, now):
            self._claim(route, ready, previous, now)
            return
        self._join(route, ready, previous, now)

    def _join(self, route: bytes, ready: Ready, previous: Member | None, now: float) -> None:
        """``ready`` from ``route`` becomes a member; ``previous``, the member with its id, if any, is
        replaced: its calls move to the newcomer (the same incarnation: the same process on a new
        connection; each is sent again, so that an answer lost with the old connection comes from the
        executor's cache) or are answered (another incarnation: it restarted)."""
        member = Member(route=route, ready=ready, last_heard=now,
                        capacity=min(ready.capacity, self.max_executor_capacity))
        moved: list[Job] = []
        if previous is not None:
            member.probed_at = previous.probed_at  # (answering a probe does not invite the next one sooner)
            del self.members[previous.route]
            if previous.ready.incarnation == ready.incarnation:
                member.running, member.stats = previous.running, previous.stats  # same process, new socket
                for job in member.running.values():
                    job.member = member
                if previous.route != route:
                    moved = list(member.running.values())
            else:
                self.members[previous.route] = previous  # so that _drop finds it
                self._drop(previous, "crashed", f"restarted (incarnation {ready.incarnation})")
        old = self.members.pop(route, None)
        if old is not None and old.id != ready.executor:
            self._drop_silently_replaced(old)
        self.members[route] = member
        for job in moved:  # it holds them (in ``held``): it joins the running call or answers from its cache
            self._send_frames_backend(route, self._frames_for(job, member))
        for name, spec in ((t.name, t) for t in ready.tools):
            self.specs.setdefault(name, spec)
        for cid in ready.held:
            self._locate(cid, ready.executor, now + LOCATION_TTL)
        self._resend_held(member)
        self._adopt_specs(final=not self.recovering)
        clamped = f" (announced {ready.capacity}, clamped)" if member.capacity < ready.capacity else ""
        log.info("executor %r joined: %d tools, capacity %d%s, holding %d calls", ready.executor, len(ready.tools),
                 member.capacity, clamped, len(ready.held))
        if ready.limits.timeout_s > self.max_timeout:
            log.info("executor %r: its default timeout of %g s is cut to the broker's --max-timeout, %g s",
                     ready.executor, ready.limits.timeout_s, self.max_timeout)
        self._answer_hellos(now)

    def _may_take_over(self, route: bytes, holder: Member, now: float) -> bool:
        """Whether the connection ``route`` may take ``holder``'s id at once: both authenticated with
        the same CurveZMQ key (the same executor, restarted or reconnected), or the holder has been
        silent for ``CLAIM_WINDOW``, or its connection is gone for certain. Otherwise the holder is
        asked to announce itself again (the ``bye`` doubles as the probe of its connection)."""
        assert self.backend is not None
        key = self.backend.key_of(route)
        if key and key == self.backend.key_of(holder.route):
            return True
        if now - holder.last_heard > CLAIM_WINDOW:
            return True
        if now - holder.probed_at < CLAIM_WINDOW:
            return False  # asked lately: a flood of claims makes it announce itself at most once a window
        holder.probed_at = now
        probe = _encode(Bye(reason="another connection announced this executor's id; announce yourself again"))
        return not self.backend.probe(holder.route, probe)

    def _claim(self, route: bytes, ready: Ready, holder: Member, now: float) -> None:
        if ready.executor in self.claims:
            self._refuse(route, ready.executor, f"another connection is already waiting to take the executor id "
                         f"{ready.executor!r}, which a live executor holds")
            return
        self.claims[ready.executor] = Claim(route=route, ready=ready, at=now, holder=holder.route)
        log.info("executor id %r announced on another connection while the one holding it is alive; the newcomer "
                 "takes it if that one stays silent for %.1f s", ready.executor, CLAIM_WINDOW)

    def _claim_of(self, route: bytes) -> Claim | None:
        return next((c for c in self.claims.values() if c.route == route), None)

    def _decide_claims(self, now: float) -> None:
        """Each newcomer waiting for a live member's id: refused once that member shows it is alive
        (it announced itself again, or spoke at least half a heartbeat after the claim: anything
        sooner may have been sent before its connection closed); let in once it has not, for
        ``CLAIM_WINDOW`` after the claim or ``PEER_EXPIRY`` in all (when it would be dropped anyway),
        or once it is gone."""
        for cid, claim in list(self.claims.items()):
            if self.claims.get(cid) is not claim:
                continue  # decided meanwhile
            holder = self.members.get(claim.holder)
            if holder is not None and holder.id == cid and holder.last_heard >= claim.at + HEARTBEAT_INTERVAL / 2:
                self._alive(claim)
            elif (holder is None or holder.id != cid or now - claim.at >= CLAIM_WINDOW
                  or now - holder.last_heard > PEER_EXPIRY):
                del self.claims[cid]
                previous = self._member_by_id(cid)
                if previous is not None and previous.route != claim.holder:
                    self._on_ready(claim.route, claim.ready)  # another took the id meanwhile: judged afresh
                elif conflict := self._conflict(claim.ready, previous):
                    self._refuse(claim.route, cid, conflict)
                else:
                    log.info("executor %r on its old connection stayed silent for %.1f s; the new connection "
                             "takes its id", cid, now - claim.at)
                    self._join(claim.route, claim.ready, previous, now)
                    self._dispatch()

    def _alive(self, claim: Claim) -> None:
        """The member whose id ``claim`` wants showed it is alive: the newcomer is refused."""
        cid = claim.ready.executor
        del self.claims[cid]
        self._refuse(claim.route, cid, f"the executor id {cid!r} belongs to a live executor on another connection; "
                     "a connection may take it over only once that one is silent")

    def _refuse(self, route: bytes, executor: str, why: str) -> None:
        """The executor may not join now; it announces itself again later (with backoff) by itself."""
        self.refusals.warning("refused executor %r: %s", executor, why)
        self._send_backend(route, Bye(reason=why, refused=True))

    def _drop_silently_replaced(self, old: Member) -> None:
        self.members[old.route] = old
        self._drop(old, "crashed", "was replaced on its connection by another executor")

    def _resend_held(self, member: Member) -> None:
        """Queued calls (resent by clients while we recovered) that this executor holds go to it."""
        for job in [j for j in self.waiting if self.locations.get(j.call.id or "", ("",))[0] == member.id]:
            self.waiting.remove(job)
            self._unlocate(job.call.id or "")
            self._send_job(job, member)

    def _locate(self, cid: str, executor: str, expiry: float) -> None:
        """Remember that ``executor`` holds call ``cid``. When the table is full, the oldest entry of
        the executor holding the most goes: one executor announcing floods of ids evicts its own
        entries, never where another executor's calls are (a resend would then run elsewhere too)."""
        self._unlocate(cid)
        self.locations[cid] = (executor, expiry)
        self.held_by.setdefault(executor, collections.OrderedDict())[cid] = None
        while len(self.locations) > MAX_LOCATIONS:
            most = max(self.held_by.values(), key=len)
            self._unlocate(next(iter(most)))

    def _unlocate(self, cid: str) -> tuple[str, float] | None:
        where = self.locations.pop(cid, None)
        if where is not None:
            ids = self.held_by[where[0]]
            del ids[cid]
            if not ids:
                del self.held_by[where[0]]
        return where

    def _conflict(self, ready: Ready, previous: Member | None) -> str:
        """Why ``ready`` may not join (a tool another executor serves differently), or "". Each name
        is looked up once, not searched for in every executor's list: an announcement of tens of
        thousands of tools costs linear time, not quadratic (a stall of the whole broker)."""
        served: dict[str, tuple[Member, ToolSpec]] = {}  # name -> the first other executor serving it
        for m in self.members.values():
            if m is not previous:
                for t in m.ready.tools:
                    served.setdefault(t.name, (m, t))
        for spec in ready.tools:
            owner, theirs = served.get(spec.name, (None, None))
            if owner is not None and theirs is not None and not _same_tool(theirs, spec):
                return (f"its tool {spec.name!r} differs from the one executor {owner.id!r} serves (signature, "
                        "documentation or flags); one pool serves one version of each tool, so it may join once "
                        f"no executor serves another {spec.name!r}")
        total = len(served.keys() | {spec.name for spec in ready.tools})
        if total > MAX_TOOLS:
            return f"with its tools the pool would serve {total}, over the {MAX_TOOLS} one welcome may list"
        return ""

    def _member_by_id(self, executor: str) -> Member | None:
        return next((m for m in self.members.values() if m.id == executor), None)

    def _on_result(self, route: bytes, member: Member | None, result: Result) -> None:
        cid = result.id
        frames = _encode(result)
        job = self.jobs.get(cid)
        if member is None:
            # From a connection that has not announced itself: an executor of our previous run (we
            # restarted), or anyone who can reach the backend. Not believed: anyone could answer any id
            # so. A real executor announces itself again when told, with the calls it holds in its
            # ``held``, and a client's resend of such an id goes to it and is answered from its cache.
            # (A newcomer waiting for an id is not told: it has announced; once in, it is sent its
            # calls again, and answers them from its cache.)
            if self._claim_of(route) is None:
                self._send_backend(route, Bye(reason="unknown executor; announce again"))
            return
        if job is None or job.member is not member:
            log.debug("executor %s answered call %s, which it was not running; ignored", member.id, cid)
            return
        del member.running[cid]
        wall = result.stats.wall_s if result.stats else time.monotonic() - job.sent_at
        member.stats.observe(job.call.tool, result, wall)
        self._finish(job, result, frames)

    def _drop(self, member: Member, kind: Literal["crashed", "unavailable"], why: str) -> None:
        """An executor is gone: re-run its idempotent calls elsewhere (once), answer the others."""
        self.members.pop(member.route, None)
        log.warning("executor %s %s; %d calls in flight", member.id, why, len(member.running))
        for cid, job in member.running.items():
            job.member = None
            if job.spec is not None and job.spec.idempotent and len(job.tried) < 2:
                self.waiting.push(job, first=True)
                log.info("call %s %s: idempotent, re-run on another executor", cid, job.call.tool)
                continue
            self._finish(job, Result.failure(cid, kind,
                                             f"executor {member.id} {why} while running the call; the call "
                                             "may have run"))
        member.running = {}
        self._forget_orphan_specs()
        self._dispatch()

    def _forget_orphan_specs(self) -> None:
        """A tool no executor serves any more may come back in another version."""
        served = {name for m in self.members.values() for name in m.tool_names}
        for name in [n for n in self.specs if n not in served]:
            del self.specs[name]

    # ---------------------------------------------------------------- answers

    def _finish(self, job: Job, result: Result, frames: list[bytes] | None = None, *, ran: bool = True) -> None:
        """Answer everyone waiting for ``job``. Unless it surely did not run (``ran=False``: refused, or
        it waited in the queue for its whole timeout; its id may then be sent again, SPEC section 8),
        the answer is kept for a resend of its id."""
        cid = job.call.id or ""
        self.jobs.pop(cid, None)
        if frames is None:
            frames = _encode(result)
        if job.spec is not None:
            self.stats.observe(job.call.tool, result, time.monotonic() - job.queued_at)
        else:
            self.stats.served += 1
        if ran:
            self.calls.remember(cid, frames, job.client)
        else:
            self.calls.unrecord(cid)
        for route in job.waiters:
            self._send_frames_frontend(route, frames)

    def _answer_now(self, route: bytes, result: Result) -> None:
        """A refusal (unknown tool, bad arguments, a full queue): not remembered, so that a corrected
        call may reuse its id (SPEC section 8)."""
        result.executor = self.broker_id
        self._send_frames_frontend(route, _encode(result))

    def _send_frontend(self, route: bytes, msg: Any) -> None:
        self._send_frames_frontend(route, _encode(msg))

    def _send_frames_frontend(self, route: bytes, frames: list[bytes]) -> None:
        assert self.frontend is not None
        self.frontend.send(route, frames)  # held for a slow client; a client gone finds it in the cache

    def _send_backend(self, route: bytes, msg: Any) -> None:
        self._send_frames_backend(route, _encode(msg))

    def _send_frames_backend(self, route: bytes, frames: list[bytes]) -> None:
        """To an executor; one that vanished is dropped when its heartbeats stop."""
        assert self.backend is not None
        self.backend.send(route, frames)

    # ---------------------------------------------------------------- status

    def report(self, now: float) -> Report:
        executors = []
        for m in self.members.values():
            executors.append(ExecutorStatus(
                executor=m.id, incarnation=m.ready.incarnation, tools=sorted(m.tool_names),
                capacity=m.capacity, busy=len(m.running), served=m.stats.served,
                worker_restarts=m.stats.worker_restarts, idle_s=round(now - m.last_heard, 3),
                max_timeout_s=min(m.ready.max_timeout_s, self.max_timeout)))
        return Report(role="broker", id=self.broker_id, incarnation=self.incarnation,
                      uptime_s=round(now - self.started, 3), capacity=sum(e.capacity for e in executors),
                      busy=sum(e.busy for e in executors), queued=len(self.waiting), served=self.stats.served,
                      worker_restarts=sum(e.worker_restarts for e in executors), max_timeout_s=self.max_timeout,
                      executors=executors,
                      tools=self.stats.tool_stats())


def _same_tool(a: ToolSpec, b: ToolSpec) -> bool:
    """Whether two announcements are one tool: their specs' canonical encodings are the same bytes
    (``protocol.fingerprint.canonical``). Not ``==``: a spec holding a NaN (a default, or a timeout
    the executor ignores) never equals itself, and every other executor serving that very module
    would be refused."""
    return bool(a == b) or _spec_bytes(a) == _spec_bytes(b)


def _spec_bytes(spec: ToolSpec) -> bytes:
    packed: bytes = msgpack.packb(canonical(spec.model_dump(mode="python")), use_bin_type=True)
    return packed


def _encode(msg: Any) -> list[bytes]:
    try:
        return encode(msg)
    except ProtocolError as e:
        return encode(Result.failure(getattr(msg, "id", "") or "", "output_limit", str(e)))

