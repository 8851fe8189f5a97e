"""``Broker``: the loop that composes the broker's parts. It reads both sockets (``sockets``), hands
clients' calls to the at-most-once memory (``answers``) and the queue (``routing``), executors'
announcements to the table of members (``members``), and on each sweep decides claims, drops
executors silent for ``PEER_EXPIRY`` and expires what waited too long. An executor that leaves,
falls silent or comes back as a new incarnation loses its calls in flight (``Router.lost``). The
broker's incarnation names the pool, not the process (it is derived from the frontend endpoint), and
for ``RECOVERY_WINDOW`` after start it sends no call elsewhere and answers no ping or hello, so that
clients resend what they had in flight and executors announce what they hold first (docs/pool.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import time
import uuid
from typing import Any, Literal

import zmq

from executor.broker.answers import Answers
from executor.broker.journal import Journal
from executor.broker.members import Members
from executor.broker.records import Job, Member
from executor.broker.routing import Router
from executor.broker.sockets import BrokerError, Sockets
from executor.calls import MAX_QUEUE_BYTES, RESULT_CACHE_BYTES, fingerprint
from executor.metrics import MetricsServer
from protocol import (
    Bye,
    Call,
    Cancel,
    Heartbeat,
    Hello,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Report,
    Result,
    Status,
    Welcome,
)
from protocol.messages import BROKER_CAPACITY, MAX_TIMEOUT_S
from protocol.timing import APPLY_GRACE, HEARTBEAT_INTERVAL, PEER_EXPIRY, RECOVERY_WINDOW
from protocol.wire import LogBudget

log = logging.getLogger("ciayn-broker")

HELLO_WAIT = 10.0  # a `hello` before any executor joined waits this long for one
MAX_HELLOS = 4096  # clients waiting for that answer, at most (one entry per client)


class Hellos:
    """Clients whose ``hello`` came before the pool could answer it (no executor yet, or recovering):
    each is welcomed once it can be, or after ``HELLO_WAIT`` with what there is then."""

    def __init__(self, limit: int = MAX_HELLOS) -> None:
        self.limit = limit
        self.waiting: dict[bytes, float] = {}  # route -> when it is welcomed anyway

    def add(self, route: bytes, now: float) -> None:
        if len(self.waiting) < self.limit and route not in self.waiting:
            self.waiting[route] = now + HELLO_WAIT

    def due(self, now: float, *, everyone: bool) -> list[bytes]:
        """Take out the clients to welcome now: ``everyone``, or those that waited ``HELLO_WAIT``."""
        due = [route for route, deadline in self.waiting.items() if everyone or now >= deadline]
        for route in due:
            del self.waiting[route]
        return due


class Broker:
    """One endpoint in front of a pool of executors; ``serve`` runs it until a signal."""

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
        self.broker_id = "broker-" + uuid.uuid4().hex[:8]
        digest = hashlib.sha256(frontend.encode()).digest()
        self.incarnation = int.from_bytes(digest[:6], "big")  # the pool's, stable across restarts
        self.started = time.monotonic()
        self.recovery_s = recovery_s
        self.metrics_address = metrics
        self.state_dir = state_dir
        self.apply_grace = apply_grace
        self.max_timeout = max_timeout  # a ceiling on every call's timeout in the pool (--max-timeout)
        self.sockets = Sockets(frontend, backend, curve_secret=curve_secret, curve_clients=curve_clients,
                               curve_executors=curve_executors, insecure=insecure)
        self.members = Members(self.sockets, max_capacity=max_executor_capacity)
        self.answers = Answers(self.sockets, self.broker_id, cache_bytes=cache_bytes)
        self.router = Router(self.members, self.answers, self.sockets, max_queue=max_queue,
                             max_queue_per_client=max_queue_per_client, max_queue_bytes=max_queue_bytes,
                             recovery_s=recovery_s, apply_grace=apply_grace, max_timeout=max_timeout)
        self.hellos = Hellos()
        self.stopping = False
        self.next_heartbeat = 0.0
        self.next_sweep = 0.0
        self.metrics: MetricsServer | None = None
        # What peers send is logged at a bounded rate: a flood of bad messages cannot fill the disk.
        self.client_complaints = LogBudget(log, "protocol errors from clients")
        self.executor_complaints = LogBudget(log, "protocol errors from executors")

    # ---------------------------------------------------------------- the loop

    def _start(self) -> None:
        """Bind both sockets, start the metrics endpoint, open the journal; ``BrokerError`` if one fails."""
        try:
            self.sockets.open()
            if self.metrics_address:
                self.metrics = MetricsServer(self.metrics_address)
            if self.state_dir:
                journal = self.router.journal = Journal(self.state_dir)
                log.info("journal %s: %d calls sent by earlier runs", journal.path, len(journal.previous))
        except OSError as e:
            self.close()
            raise BrokerError(f"cannot use the state directory {self.state_dir}: {e}") from None
        except (BrokerError, ValueError) as e:
            self.close()
            raise BrokerError(str(e)) from None

    def close(self) -> None:
        self.sockets.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.router.journal is not None:
            self.router.journal.close()

    def serve(self) -> int:
        self._start()
        frontend, backend = self.sockets.frontend.socket, self.sockets.backend.socket
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        poller = zmq.Poller()
        for source in (frontend, backend, wake_r):
            poller.register(source, zmq.POLLIN)
        log.info("broker %s: %s (recovering for %.1f s)", self.broker_id, self.sockets.describe(), self.recovery_s)
        try:
            while not self.stopping:
                events = dict(poller.poll(self._poll_ms()))
                if wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                if backend in events:
                    self._on_backend()
                if frontend in events:
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
        now = time.monotonic()
        wait = min(self.next_heartbeat - now, self.next_sweep - now, self.sockets.tick(now))
        return max(0, int(wait * 1000) + 1)

    def _tick(self, now: float) -> None:
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL
            self.members.beat(Heartbeat(executor=self.broker_id))
        for budget in (self.client_complaints, self.executor_complaints, self.members.refusals):
            budget.flush(now)
        if now < self.next_sweep:
            return
        self.next_sweep = now + min(HEARTBEAT_INTERVAL, 0.25)
        if self.router.recovering and now - self.started >= self.recovery_s:
            self.router.end_recovery()
        self._decide_claims(now)  # first: a silent member whose id a newcomer claims hands its calls over
        for member in list(self.members.by_route.values()):
            if now - member.last_heard > PEER_EXPIRY:
                self._drop(member, "unavailable", f"fell silent for {now - member.last_heard:.1f} s")
        self.router.expire_queued(now)
        self.router.expire_running(now)
        self._answer_hellos(now)
        self.router.locations.expire(now)
        if self.metrics is not None and self.metrics.due(now):
            self.metrics.publish(self.report(now), now)

    # ---------------------------------------------------------------- clients

    def _on_frontend(self) -> None:
        for route, msg in self.sockets.frontend.receive():
            if isinstance(msg, ProtocolError):
                self.client_complaints.warning("protocol error from client %s: %s", route.hex()[:8], msg)
                self.sockets.to_client(route, msg.reply())
            elif isinstance(msg, Call):
                self._on_call(route, msg)
            elif isinstance(msg, Ping):
                if not self.router.recovering:  # silent on purpose while recovering: see docs/pool.md
                    self.sockets.to_client(route, Pong(nonce=msg.nonce, executor=self.broker_id,
                                                       incarnation=self.incarnation, busy=self.members.busy(),
                                                       queued=len(self.router.waiting)))
            elif isinstance(msg, Hello):
                self.hellos.add(route, time.monotonic())
                self._answer_hellos(time.monotonic())  # at once if the pool can answer
            elif isinstance(msg, Cancel):
                job = self.answers.jobs.get(msg.id)
                if job is not None and route in job.waiters:  # only a client waiting for a call may cancel it
                    self.router.cancel(job)
            elif isinstance(msg, Status):
                self.sockets.to_client(route, self.report(time.monotonic()))
            else:
                self.sockets.to_client(route, Result.failure("", "protocol", f"a broker's frontend does not "
                                                             f"accept {msg.KIND} messages"))
        self.router.dispatch()

    def welcome(self) -> Welcome:
        return self.members.welcome(self.broker_id, self.incarnation, apply_grace=self.apply_grace,
                                    max_timeout=self.max_timeout)

    def _answer_hellos(self, now: float) -> None:
        for route in self.hellos.due(now, everyone=bool(self.members.by_route) and not self.router.recovering):
            self.sockets.to_client(route, self.welcome())

    def _on_call(self, route: bytes, call: Call) -> None:
        cid = call.id
        if not cid:
            self.sockets.to_client(route, Result.failure("", "protocol", "a call must carry an id"))
            return
        nbytes, digest = fingerprint(call)  # a resend of the id must match digest (tool, arguments, timeout)
        seen = self.answers.seen(route, call, digest)
        if seen is not None:
            if seen.frames is not None:
                self.sockets.to_client(route, seen.frames)
            elif seen.refusal is not None:
                self.answers.refuse(route, seen.refusal)
            return
        if (refusal := self.router.accept(route, call, nbytes, digest)) is not None:
            self.answers.refuse(route, refusal)

    # ---------------------------------------------------------------- executors

    def _on_backend(self) -> None:
        for route, msg in self.sockets.backend.receive():
            now = time.monotonic()
            member = self.members.get(route)
            if member is not None:
                member.last_heard = now
            if isinstance(msg, ProtocolError):
                self.executor_complaints.warning("protocol error from executor %s: %s",
                                                 repr(member.id) if member else route.hex()[:8], msg)
            elif isinstance(msg, Result):
                self._on_result(route, member, msg)
            elif isinstance(msg, Ready):
                self._on_ready(route, msg)
            elif isinstance(msg, Heartbeat):
                if member is not None:
                    if msg.applying:
                        self.router.grant_apply(member, msg.applying, now)
                elif self.members.claim_of(route) is None:  # we restarted, or dropped it: it must announce itself
                    self.sockets.to_executor(route, Bye(reason="unknown executor; announce again"))
            elif isinstance(msg, Bye):
                if member is not None:
                    self._drop(member, "crashed", f"left ({msg.reason or 'no reason given'})")
                else:
                    self.members.withdraw(route)
            else:
                self.executor_complaints.warning("executor %s sent a %s message; ignored",
                                                 repr(member.id) if member else "?", msg.KIND)
        self.router.dispatch()

    def _on_ready(self, route: bytes, ready: Ready) -> None:
        now = time.monotonic()
        self.members.announced(route)
        previous = self.members.by_id(ready.executor)
        if conflict := self.members.conflict(ready, previous):
            self.members.refuse(route, ready.executor, conflict)
        elif (previous is not None and previous.route != route
              and not self.members.may_take_over(route, previous, now)):
            self.members.claim(route, ready, previous, now)
        else:
            self._join(route, ready, previous, now)

    def _join(self, route: bytes, ready: Ready, previous: Member | None, now: float) -> None:
        """``ready`` from ``route`` becomes a member; ``previous``, the member with its id, if any, is
        replaced: its calls move to the newcomer (the same incarnation: the same process on a new
        connection; each is sent again, so that an answer lost with the old connection comes from the
        executor's cache) or are answered (another incarnation: it restarted)."""
        member = self.members.new(route, ready, now)
        moved: list[Job] = []
        if previous is not None:
            member.probed_at = previous.probed_at  # (answering a probe does not invite the next one sooner)
            if previous.ready.incarnation == ready.incarnation:
                self.members.remove(previous)
                member.take_over(previous)
                if previous.route != route:
                    moved = list(member.running.values())
            else:
                self._drop(previous, "crashed", f"restarted (incarnation {ready.incarnation})")
        old = self.members.get(route)
        if old is not None and old.id != ready.executor:
            self._drop(old, "crashed", "was replaced on its connection by another executor")
        self.members.add(member)
        self.router.joined(member, moved, now)
        self._answer_hellos(now)

    def _decide_claims(self, now: float) -> None:
        """Let in each newcomer whose claim on a silent member's id is due (``Members.claims_due``)."""
        for claim in self.members.claims_due(now):
            cid = claim.ready.executor
            previous = self.members.by_id(cid)
            if previous is not None and previous.route != claim.holder:
                self._on_ready(claim.route, claim.ready)  # another took the id meanwhile: judged afresh
            elif conflict := self.members.conflict(claim.ready, previous):
                self.members.refuse(claim.route, cid, conflict)
            else:
                log.info("executor %r on its old connection stayed silent for %.1f s; the new connection "
                         "takes its id", cid, now - claim.at)
                self._join(claim.route, claim.ready, previous, now)
                self.router.dispatch()

    def _on_result(self, route: bytes, member: Member | None, result: Result) -> None:
        if member is None:
            # From a connection that has not announced itself: an executor of our previous run (we
            # restarted), or anyone who can reach the backend. Not believed: anyone could answer any id
            # so. A real executor announces itself again when told, with the calls it holds in its
            # ``held``, and a client's resend of such an id goes to it and is answered from its cache.
            # (A newcomer waiting for an id is not told: it has announced; once in, it is sent its
            # calls again, and answers them from its cache.)
            if self.members.claim_of(route) is None:
                self.sockets.to_executor(route, Bye(reason="unknown executor; announce again"))
            return
        self.router.answered(member, result)

    def _drop(self, member: Member, kind: Literal["crashed", "unavailable"], why: str) -> None:
        """An executor is gone: its calls are re-run elsewhere or answered (``Router.lost``)."""
        self.members.remove(member)
        log.warning("executor %s %s; %d calls in flight", member.id, why, len(member.running))
        self.router.lost(member, kind, why)
        self.members.forget_orphan_specs()
        self.router.dispatch()

    # ---------------------------------------------------------------- status

    def report(self, now: float) -> Report:
        executors = self.members.statuses(now, self.max_timeout)
        return Report(role="broker", id=self.broker_id, incarnation=self.incarnation,
                      uptime_s=round(now - self.started, 3), capacity=sum(e.capacity for e in executors),
                      busy=sum(e.busy for e in executors), queued=len(self.router.waiting),
                      served=self.answers.stats.served, worker_restarts=sum(e.worker_restarts for e in executors),
                      max_timeout_s=self.max_timeout, executors=executors, tools=self.answers.stats.tool_stats())
