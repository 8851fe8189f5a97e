"""Who is connected to the broker's backend: one ``Member`` per connection, the ``Claim``s other
connections make on their ids, and the one spec of each tool the pool serves. Executors are peers
that may lie, so a member is bound to its connection: another connection announcing a live member's
id waits as a claim and takes the id only once that member stays silent for ``CLAIM_WINDOW`` or its
connection is gone (at once if both authenticated with the same CurveZMQ key); otherwise it is
refused. One pool serves one version of each tool: an executor announcing a tool another serves
differently is refused until that one is gone. What becomes of a member's calls when it joins or
leaves is the broker's (``executor.broker.broker``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack

from executor.broker.records import Member
from executor.broker.sockets import Sockets, frames_of
from protocol import Bye, ExecutorStatus, Heartbeat, Limits, Ready, ToolSpec, Welcome
from protocol.fingerprint import canonical
from protocol.spec import MAX_TOOLS
from protocol.timing import CLAIM_WINDOW, HEARTBEAT_INTERVAL, PEER_EXPIRY
from protocol.wire import LogBudget

log = logging.getLogger("ciayn-broker")


@dataclass
class Claim:
    """Another connection announced the id of a live member: the newcomer waits (not a member) until
    the member shows it is alive (then the newcomer is refused) or stays silent (then it goes)."""

    route: bytes  # the newcomer's connection
    ready: Ready
    at: float
    holder: bytes  # the member's connection


class Members:
    """Members by connection (``by_route``), claims by executor id, and the pool's tool specs."""

    def __init__(self, sockets: Sockets, *, max_capacity: int) -> None:
        self.sockets = sockets
        self.max_capacity = max_capacity
        self.by_route: dict[bytes, Member] = {}
        self.claims: dict[str, Claim] = {}  # executor id -> a newcomer waiting to take it (one per id)
        self.specs: dict[str, ToolSpec] = {}  # the one spec of each tool name in the pool
        self.refusals = LogBudget(log, "refused executors")  # what peers send is logged at a bounded rate

    # ---------------------------------------------------------------- the table

    def get(self, route: bytes) -> Member | None:
        return self.by_route.get(route)

    def by_id(self, executor: str) -> Member | None:
        return next((m for m in self.by_route.values() if m.id == executor), None)

    def busy(self) -> int:
        return sum(len(m.running) for m in self.by_route.values())

    def beat(self, heartbeat: Heartbeat) -> None:
        """Tell every member the broker is still here."""
        frames = frames_of(heartbeat)
        for route in list(self.by_route):
            self.sockets.to_executor(route, frames)

    def new(self, route: bytes, ready: Ready, now: float) -> Member:
        """A member for ``ready``, not yet added: its capacity clamped to ``--max-executor-capacity``."""
        return Member(route=route, ready=ready, last_heard=now, capacity=min(ready.capacity, self.max_capacity))

    def add(self, member: Member) -> None:
        self.by_route[member.route] = member
        for spec in member.ready.tools:
            self.specs.setdefault(spec.name, spec)
        clamped = f" (announced {member.ready.capacity}, clamped)" if member.capacity < member.ready.capacity else ""
        log.info("executor %r joined: %d tools, capacity %d%s, holding %d calls", member.id, len(member.ready.tools),
                 member.capacity, clamped, len(member.ready.held))

    def remove(self, member: Member) -> None:
        self.by_route.pop(member.route, None)

    def forget_orphan_specs(self) -> None:
        """A tool no executor serves any more may come back in another version."""
        served = {name for m in self.by_route.values() for name in m.tool_names}
        for name in [n for n in self.specs if n not in served]:
            del self.specs[name]

    def conflict(self, ready: Ready, previous: Member | None) -> str:
        """Why ``ready`` may not join (a tool another executor serves differently), or "". Each name
        is looked up once, not searched for in every executor's list: an announcement of tens of
        thousands of tools costs linear time, not quadratic (a stall of the whole broker)."""
        served: dict[str, tuple[Member, ToolSpec]] = {}  # name -> the first other executor serving it
        for m in self.by_route.values():
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

    def refuse(self, route: bytes, executor: str, why: str) -> None:
        """The executor may not join now; it announces itself again later (with backoff) by itself."""
        self.refusals.warning("refused executor %r: %s", executor, why)
        self.sockets.to_executor(route, Bye(reason=why, refused=True))

    # ---------------------------------------------------------------- claims on ids

    def may_take_over(self, route: bytes, holder: Member, now: float) -> bool:
        """Whether the connection ``route`` may take ``holder``'s id at once: both authenticated with
        the same CurveZMQ key (the same executor, restarted or reconnected), or the holder has been
        silent for ``CLAIM_WINDOW``, or its connection is gone for certain. Otherwise the holder is
        asked to announce itself again (the ``bye`` doubles as the probe of its connection)."""
        key = self.sockets.key_of(route)
        if key and key == self.sockets.key_of(holder.route):
            return True
        if now - holder.last_heard > CLAIM_WINDOW:
            return True
        if now - holder.probed_at < CLAIM_WINDOW:
            return False  # asked lately: a flood of claims makes it announce itself at most once a window
        holder.probed_at = now
        return not self.sockets.probe(holder.route, Bye(
            reason="another connection announced this executor's id; announce yourself again"))

    def claim(self, route: bytes, ready: Ready, holder: Member, now: float) -> None:
        if ready.executor in self.claims:
            self.refuse(route, ready.executor, f"another connection is already waiting to take the executor id "
                        f"{ready.executor!r}, which a live executor holds")
            return
        self.claims[ready.executor] = Claim(route=route, ready=ready, at=now, holder=holder.route)
        log.info("executor id %r announced on another connection while the one holding it is alive; the newcomer "
                 "takes it if that one stays silent for %.1f s", ready.executor, CLAIM_WINDOW)

    def claim_of(self, route: bytes) -> Claim | None:
        return next((c for c in self.claims.values() if c.route == route), None)

    def announced(self, route: bytes) -> None:
        """``route`` announced itself: its own claim, if any, starts over, and a claim on the id of the
        member there is refused (that member is alive)."""
        claim = self.claim_of(route)
        if claim is not None:
            del self.claims[claim.ready.executor]
        for claim in [c for c in self.claims.values() if c.holder == route]:
            self.alive(claim)

    def withdraw(self, route: bytes) -> None:
        """A newcomer waiting for an id said ``bye``."""
        claim = self.claim_of(route)
        if claim is not None:
            del self.claims[claim.ready.executor]

    def claims_due(self, now: float) -> Iterator[Claim]:
        """Each newcomer waiting for a live member's id: refused once that member shows it is alive
        (it announced itself again, or spoke at least half a heartbeat after the claim: anything
        sooner may have been sent before its connection closed); yielded, to be let in, once it has
        not, for ``CLAIM_WINDOW`` after the claim or ``PEER_EXPIRY`` in all (when it would be dropped
        anyway), or once it is gone. Lazily: what the caller does with one is seen by the next."""
        for cid, claim in list(self.claims.items()):
            if self.claims.get(cid) is not claim:
                continue  # decided meanwhile
            holder = self.by_route.get(claim.holder)
            if holder is not None and holder.id == cid and holder.last_heard >= claim.at + HEARTBEAT_INTERVAL / 2:
                self.alive(claim)
            elif (holder is None or holder.id != cid or now - claim.at >= CLAIM_WINDOW
                  or now - holder.last_heard > PEER_EXPIRY):
                del self.claims[cid]
                yield claim

    def alive(self, claim: Claim) -> None:
        """The member whose id ``claim`` wants showed it is alive: the newcomer is refused."""
        cid = claim.ready.executor
        del self.claims[cid]
        self.refuse(claim.route, cid, f"the executor id {cid!r} belongs to a live executor on another connection; "
                    "a connection may take it over only once that one is silent")

    # ---------------------------------------------------------------- the pool as one executor

    def welcome(self, broker_id: str, incarnation: int, *, apply_grace: float, max_timeout: float) -> Welcome:
        """The pool as one executor: every tool, the longest default timeout, all the workers, the
        apply grace of its executors, at most the broker's own (which it enforces, section 12), and
        the longest any call runs (the broker's ceiling, or less if every executor's is less)."""
        members = list(self.by_route.values())
        limits = max((m.ready.limits for m in members), key=lambda lim: lim.timeout_s, default=Limits())
        if limits.timeout_s > max_timeout:
            limits = limits.model_copy(update={"timeout_s": max_timeout})
        profiles = {m.ready.profile for m in members}
        return Welcome(executor=broker_id, incarnation=incarnation,
                       tools=[self.specs[n] for n in sorted(self.specs)], limits=limits,
                       workers=sum(m.capacity for m in members),
                       profile=profiles.pop() if len(profiles) == 1 else "mixed" if profiles else "default",
                       apply_grace_s=min(apply_grace, max((m.ready.apply_grace_s for m in members), default=0.0)),
                       max_timeout_s=min(max_timeout, max((m.ready.max_timeout_s for m in members),
                                                          default=max_timeout)))

    def default_timeout(self) -> float:
        """The pool's default timeout: the longest of its executors' (the welcome's)."""
        return max((m.ready.limits.timeout_s for m in self.by_route.values()), default=Limits().timeout_s)

    def statuses(self, now: float, max_timeout: float) -> list[ExecutorStatus]:
        return [ExecutorStatus(executor=m.id, incarnation=m.ready.incarnation, tools=sorted(m.tool_names),
                               capacity=m.capacity, busy=len(m.running), served=m.stats.served,
                               worker_restarts=m.stats.worker_restarts, idle_s=round(now - m.last_heard, 3),
                               max_timeout_s=min(m.ready.max_timeout_s, max_timeout))
                for m in self.by_route.values()]


def _same_tool(a: ToolSpec, b: ToolSpec) -> bool:
    """Whether two announcements are one tool: their specs' canonical encodings are the same bytes
    (``protocol.fingerprint.canonical``). Not ``==``: a spec holding a NaN (a default, or a timeout
    the executor ignores) never equals itself, and every other executor serving that very module
    would be refused."""
    return bool(a == b) or _spec_bytes(a) == _spec_bytes(b)


def _spec_bytes(spec: ToolSpec) -> bytes:
    packed: bytes = msgpack.packb(canonical(spec.model_dump(mode="python")), use_bin_type=True)
    return packed
