"""Red team of two features: ``--max-timeout`` (a5b68ca: a ceiling on every call's timeout, on
``serve`` and ``broker``) and the canonical resend key (bb13877: a resend is the same call whatever
its key order and number widths; another call under its id is refused).

The attackers: a hostile client writing raw msgpack on a DEALER socket (every odd timeout, every
encoding of "the same" value, duplicate keys, extension types, the largest body there is, resends
racing the first send, cancels and resends), hostile tools (a decorator timeout of every odd value,
a daemon left behind, a CPU burner under a generous --cpu-s), and hostile executors behind a broker
(raw ``ciayn/1`` on its backend: announcing timeouts over the ceiling, invalid or tiny ceilings,
apply notices again and again or for another member's call). Everything else is a real executor or
broker process on a real socket.

The invariants: no call runs (wall clock) longer than the ceiling plus the documented grace, whoever
asked, and every call gets an answer of a known kind; a resend is recognised as the same call however
it was written, and a different call under the same id is refused. A test marked
``xfail(strict=True, reason="HOLE: ...")`` is a hole still open; every other test is an attack that held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import struct
import subprocess
import sys
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from controller import ExecutorClient
from protocol import (
    VERSION,
    Bye,
    Call,
    Cancel,
    Heartbeat,
    Hello,
    Limits,
    Param,
    Ping,
    Pong,
    Ready,
    Result,
    ToolSpec,
    Welcome,
    decode,
    encode,
)
from tests.support.hostile import HostileMember
from tests.support.pool import Pool
from tests.support.waiting import START_BOUND, wait_until

TESTS = Path(__file__).parent
TOOLS = str(TESTS / "tools" / "redteam_ceiling_resend.py")
RESEND_ECHO = str(TESTS / "tools" / "resend_echo.py")  # echo(*args, **kwargs): a fresh token per run
EXECUTOR = [sys.executable, "-m", "executor.cli"]

GRACE = 2.0  # DEADLINE_GRACE (client) = RESULT_GRACE (broker): the documented slack past a timeout
SLACK = 3.0  # what a bound may take on top on a loaded 2-core machine
BOUND = 15.0  # seconds for any one expected answer


# ---------------------------------------------------------------- raw msgpack, written by hand


def s(text: str, width: int = 0) -> bytes:
    """A msgpack str with the header ``width`` (0: the shortest; 8, 16 or 32)."""
    data = text.encode()
    n = len(data)
    if width == 0:
        return pk(text)
    return {8: b"\xd9" + struct.pack(">B", n), 16: b"\xda" + struct.pack(">H", n),
            32: b"\xdb" + struct.pack(">I", n)}[width] + data


def bn(data: bytes, width: int = 8) -> bytes:
    """A msgpack bin with the header ``width`` (8, 16 or 32)."""
    n = len(data)
    return {8: b"\xc4" + struct.pack(">B", n), 16: b"\xc5" + struct.pack(">H", n),
            32: b"\xc6" + struct.pack(">I", n)}[width] + data


def u(n: int, width: int) -> bytes:
    """An unsigned msgpack int of ``width`` bits (0: a positive fixint)."""
    return bytes([n]) if width == 0 else {8: b"\xcc", 16: b"\xcd", 32: b"\xce", 64: b"\xcf"}[width] + \
        n.to_bytes(width // 8, "big")


def i(n: int, width: int) -> bytes:
    """A signed msgpack int of ``width`` bits (0: a negative fixint)."""
    return struct.pack(">b", n) if width == 0 else {8: b"\xd0", 16: b"\xd1", 32: b"\xd2", 64: b"\xd3"}[width] + \
        n.to_bytes(width // 8, "big", signed=True)


def f64(x: float | None = None, bits: int | None = None) -> bytes:
    return b"\xcb" + (struct.pack(">d", x) if bits is None else bits.to_bytes(8, "big"))


def f32(x: float | None = None, bits: int | None = None) -> bytes:
    return b"\xca" + (struct.pack(">f", x) if bits is None else bits.to_bytes(4, "big"))


def pk(value: Any) -> bytes:
    """A plain value, packed the usual (shortest) way."""
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def arr(*items: bytes, wide: bool = False) -> bytes:
    n = len(items)
    head = b"\xdc" + struct.pack(">H", n) if wide or n >= 16 else bytes([0x90 | n])
    return head + b"".join(items)


def mp(*pairs: tuple[bytes, bytes], wide: bool = False) -> bytes:
    n = len(pairs)
    head = b"\xde" + struct.pack(">H", n) if wide or n >= 16 else bytes([0x80 | n])
    return head + b"".join(k + v for k, v in pairs)


def call_frames(cid: str, tool: str, args: bytes | None = None, kwargs: bytes | None = None,
                timeout: bytes | None = None, extra: tuple[tuple[bytes, bytes], ...] = (),
                first: tuple[tuple[bytes, bytes], ...] = ()) -> list[bytes]:
    """A ``call`` whose fields are already encoded (``id`` first, as senders should put it)."""
    fields = [*first, (s("id"), s(cid)), (s("tool"), s(tool))]
    if args is not None:
        fields.append((s("args"), args))
    if kwargs is not None:
        fields.append((s("kwargs"), kwargs))
    if timeout is not None:
        fields.append((s("timeout"), timeout))
    fields.extend(extra)
    return [VERSION, b"call", mp(*fields)]


class Wire:
    """A raw DEALER client: sends frames, collects results by id (answers to other ids wait)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, b"r" + uuid.uuid4().bytes)
        self.sock.connect(endpoint)
        self.results: dict[str, list[Result]] = {}
        self.other: list[Any] = []

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def _pump(self, timeout: float) -> bool:
        if not self.sock.poll(max(1, int(timeout * 1000))):
            return False
        msg = decode(self.sock.recv_multipart())
        if isinstance(msg, Result):
            self.results.setdefault(msg.id, []).append(msg)
        else:
            self.other.append(msg)
        return True

    def result(self, cid: str, within: float = BOUND, nth: int = 1) -> Result:
        """The ``nth`` answer to ``cid`` (failing the test if it does not come ``within``)."""
        deadline = time.monotonic() + within
        while len(self.results.get(cid, [])) < nth:
            left = deadline - time.monotonic()
            assert left > 0, f"no answer #{nth} to {cid} within {within:g} s (got {self.results.get(cid)})"
            self._pump(left)
        return self.results[cid][nth - 1]

    def drain(self, within: float) -> None:
        """Read whatever arrives for ``within`` seconds (to see that nothing more comes)."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            self._pump(left)

    def ping(self, within: float = BOUND) -> float:
        """Seconds until a pong comes back."""
        nonce = random.randrange(1, 2**63)
        started = time.monotonic()
        self.send(encode(Ping(nonce=nonce)))
        deadline = started + within
        while True:
            for msg in self.other:
                if isinstance(msg, Pong) and msg.nonce == nonce:
                    return time.monotonic() - started
            left = deadline - time.monotonic()
            assert left > 0, f"no pong within {within:g} s"
            self._pump(left)

    def welcome(self, within: float = BOUND) -> Welcome:
        self.send(encode(Hello(client="redteam")))
        deadline = time.monotonic() + within
        while True:
            for msg in self.other:
                if isinstance(msg, Welcome):
                    return msg
            left = deadline - time.monotonic()
            assert left > 0, f"no welcome within {within:g} s"
            self._pump(left)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(0)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.stop()


Serve = Callable[..., str]


@pytest.fixture
def serve(make_client: Callable[..., ExecutorClient], pool: Pool,
          ctx: zmq.Context[zmq.Socket[bytes]]) -> Serve:
    """``serve(target, tools, max_timeout, workers, *broker_args)``: the endpoint of a real executor
    started with ``--max-timeout`` (target "executor"), or of a real broker started with it in front
    of one real executor with no ceiling of its own and a 60 s default (target "broker"); answering
    pings (a broker's recovery window is over)."""

    def start(target: str, tools: list[str], max_timeout: float | None = None, workers: int = 1,
              *broker_args: str) -> str:
        if target == "executor":
            options: dict[str, Any] = {"workers": workers}
            if max_timeout is not None:
                options["max_timeout"] = max_timeout
            endpoint = make_client(tools=tools, **options).endpoint
        else:
            args = [*broker_args] + (["--max-timeout", str(max_timeout)] if max_timeout is not None else [])
            pool.start_broker(*args)
            pool.add_executor(tools, workers, "--timeout", "60")
            pool.wait_for_executors(1)
            endpoint = pool.frontend
        probe = Wire(ctx, endpoint)
        wait_until("pings answered", lambda: _answers_ping(probe))
        probe.sock.close(0)
        return endpoint

    return start


def _answers_ping(wire: Wire) -> bool:
    try:
        wire.ping(within=0.3)
        return True
    except AssertionError:
        return False


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _cid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex}"


TARGETS = ["executor", "broker"]


# ================================================================ 1. --max-timeout


# -- a client's own timeout, written as raw msgpack


INVALID_TIMEOUTS = {
    "inf": f64(float("inf")),
    "-inf": f64(float("-inf")),
    "nan": f64(float("nan")),
    "nan-payload": f64(bits=0x7FF0000000000001),
    "float32-inf": f32(float("inf")),
    "float32-nan": f32(bits=0x7FC00001),
    "negative": f64(-1.0),
    "zero": f64(0.0),
    "negative-zero": f64(-0.0),
    "int-zero": u(0, 0),
    "int-negative": i(-1, 0),
    "int64-min": i(-(2**63), 64),
    "uint64-max": u(2**64 - 1, 64),
    "just-over-a-day": f64(86400.000001),
    "1e308": f64(1e308),
    "true": b"\xc3",
    "false": b"\xc2",
    "str": s("5"),
    "bin": bn(b"5"),
    "array": arr(u(5, 0)),
    "map": mp((s("s"), u(5, 0))),
}


@pytest.mark.parametrize("target", TARGETS)
def test_a_raw_timeout_that_is_no_number_of_seconds_is_refused_bad_arguments_and_never_runs(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """inf, nan (any payload, float 32 too), negative, 0, -0.0, over a day, 1e308, 2^64-1, bools,
    str, bin, array, map: each is answered ``bad_arguments`` with the call's id and nothing runs;
    an extension type there is ``protocol``. Refusals are not remembered: the same id with a good
    timeout then runs, once."""
    wire = Wire(ctx, serve(target, [TOOLS], 1.0))
    log = tmp_path / "runs.log"
    cid = _cid("bad-timeout")
    for n, (name, timeout) in enumerate(INVALID_TIMEOUTS.items(), start=1):
        wire.send(call_frames(cid, "tally", arr(s(str(log))), timeout=timeout))
        reply = wire.result(cid, nth=n)
        assert reply.error is not None and reply.error.kind == "bad_arguments", (name, reply)
        assert "timeout" in reply.error.message, (name, reply.error.message)
    ext = _cid("ext-timeout")
    wire.send(call_frames(ext, "tally", arr(s(str(log))), timeout=b"\xd6\xff\x00\x00\x00\x01"))  # a timestamp
    reply = wire.result(ext)
    assert reply.error is not None and reply.error.kind == "protocol" and "ext" in reply.error.message, reply
    assert _lines(log) == [], "a call with an invalid timeout ran"
    wire.send(call_frames(cid, "tally", arr(s(str(log))), timeout=f64(0.5)))
    ran = wire.result(cid, nth=len(INVALID_TIMEOUTS) + 1)
    assert ran.ok, ran
    assert len(_lines(log)) == 1


@pytest.mark.parametrize("target", TARGETS)
def test_a_raw_timeout_over_the_ceiling_in_any_encoding_runs_under_the_ceiling(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], target: str) -> None:
    """A day as float 64, a day as uint 32, 10^4 as float 32: all cut to the 1.5 s ceiling, answered
    ``timeout`` by the executor itself (not a broker giving up on it) within the ceiling plus the
    grace; the result's limits say 1.5 s or less."""
    ceiling = 1.5
    wire = Wire(ctx, serve(target, [TOOLS], ceiling))
    for name, timeout in {"a-day-float64": f64(86400.0), "a-day-uint32": u(86400, 32),
                          "1e4-float32": f32(1e4)}.items():
        cid = _cid(name)
        started = time.monotonic()
        wire.send(call_frames(cid, "nap", kwargs=mp((s("seconds"), f64(30.0))), timeout=timeout))
        result = wire.result(cid, within=ceiling + GRACE + SLACK + 5)
        took = time.monotonic() - started
        assert result.error is not None and result.error.kind == "timeout", (name, result)
        assert "ran past its" in result.error.message, (name, result.error.message)  # the executor's own kill
        assert result.limits is not None and result.limits.timeout_s <= ceiling, (name, result.limits)
        assert took < ceiling + GRACE + SLACK, f"{name}: answered after {took:.1f} s under a {ceiling} s ceiling"


@pytest.mark.parametrize("target", TARGETS)
def test_a_subnormal_or_tiny_timeout_is_answered_at_once_with_a_known_kind(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """5e-324 (the smallest float, subnormal) and 1e-300 are valid timeouts (> 0, finite): the call
    can only be refused or killed at once. It is answered ``unavailable`` (did not run) or
    ``timeout`` within a second or so, and if it did not run its id is forgotten (it may be sent
    again)."""
    wire = Wire(ctx, serve(target, [TOOLS], 1.0))
    log = tmp_path / "runs.log"
    for name, timeout in {"subnormal": f64(5e-324), "1e-300": f64(1e-300), "float32-subnormal": f32(bits=1)}.items():
        cid = _cid(name)
        started = time.monotonic()
        wire.send(call_frames(cid, "nap", kwargs=mp((s("seconds"), f64(30.0)), (s("log"), s(str(log)))),
                              timeout=timeout))
        result = wire.result(cid)
        took = time.monotonic() - started
        assert result.error is not None and result.error.kind in ("unavailable", "timeout"), (name, result)
        assert took < 1.0 + SLACK, f"{name}: answered after {took:.1f} s"
        if result.error.kind == "unavailable":
            assert "did not run" in result.error.message, result.error.message


@pytest.mark.parametrize("target", TARGETS)
def test_a_calls_own_max_timeout_can_only_lower_its_ceiling_and_is_no_part_of_the_call(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """``max_timeout`` (b3b5650: where a broker puts its ceiling) is a field any client may write.
    Invalid values (inf, nan, 0, -1, over a day, a bool, a str) are refused with the call's id and
    nothing runs. A day there does not lift the 1.5 s ceiling; 0.5 there lowers the call's own. A
    resend carrying another max_timeout, or none, is the same call: answered from the cache, not run
    again, and not given more time."""
    ceiling = 1.5
    wire = Wire(ctx, serve(target, [TOOLS], ceiling))
    log = tmp_path / "runs.log"
    nap = mp((s("seconds"), f64(30.0)), (s("log"), s(str(log))))
    bad = _cid("bad-max")
    for n, value in enumerate([f64(float("inf")), f64(float("nan")), f64(0.0), f64(-1.0), f64(86401.0), b"\xc3",
                               s("1"), arr()], start=1):
        wire.send(call_frames(bad, "nap", kwargs=nap, timeout=f64(3600.0), extra=((s("max_timeout"), value),)))
        reply = wire.result(bad, nth=n)
        assert reply.error is not None and reply.error.kind in ("bad_arguments", "protocol"), (value, reply)
        assert "max_timeout" in reply.error.message, (value, reply.error.message)
    assert _lines(log) == [], "a call with an invalid max_timeout ran"
    lift = _cid("lift")
    frames = call_frames(lift, "nap", kwargs=nap, timeout=f64(3600.0), extra=((s("max_timeout"), f64(86400.0)),))
    started = time.monotonic()
    wire.send(frames)
    first = wire.result(lift, within=ceiling + GRACE + SLACK + 5)
    took = time.monotonic() - started
    assert first.error is not None and first.error.kind == "timeout", first
    assert first.limits is not None and first.limits.timeout_s <= ceiling, first.limits
    assert took < ceiling + GRACE + SLACK, f"a max_timeout of a day held the call {took:.1f} s"
    for n, other in enumerate([(), ((s("max_timeout"), f64(1e-3)),), ((s("max_timeout"), f64(3600.0)),)], start=2):
        wire.send(call_frames(lift, "nap", kwargs=nap, timeout=f64(3600.0), extra=other))
        again = wire.result(lift, nth=n, within=SLACK)
        assert again.error is not None and again.error.message == first.error.message, again
    assert len(_lines(log)) == 1, "a resend with another max_timeout ran again"
    lower = _cid("lower")
    wire.send(call_frames(lower, "nap", kwargs=mp((s("seconds"), f64(30.0))), timeout=f64(3600.0),
                          extra=((s("max_timeout"), f64(0.5)),)))
    cut = wire.result(lower, within=BOUND)
    assert cut.error is not None and cut.error.kind == "timeout", cut
    assert cut.limits is not None and cut.limits.timeout_s <= 0.5, cut.limits


def test_a_tools_own_timeout_of_any_odd_value_is_held_to_the_ceiling(
        make_client: Callable[..., ExecutorClient]) -> None:
    """@tool(timeout=...) of inf, -5, 0 (ignored: the default, at most the ceiling), 1e308 and
    10**30 (cut to the ceiling), 5e-324 (answered at once): none runs past the 1 s ceiling."""
    client = make_client(tools=[TOOLS], max_timeout=1)
    specs = {t.name: t for t in client.tools()}
    assert {"own_inf", "own_negative", "own_zero", "own_huge", "own_huge_int", "own_subnormal"} <= set(specs)
    for tool in ("own_inf", "own_negative", "own_zero", "own_huge", "own_huge_int"):
        started = time.monotonic()
        result = client.call(Call(tool=tool))
        took = time.monotonic() - started
        assert result.error is not None and result.error.kind == "timeout", (tool, result)
        assert result.limits is not None and result.limits.timeout_s <= 1.0, (tool, result.limits)
        assert took < 1.0 + GRACE + SLACK, f"{tool}: answered after {took:.1f} s under a 1 s ceiling"
    started = time.monotonic()
    tiny = client.call(Call(tool="own_subnormal"))
    assert tiny.error is not None and tiny.error.kind in ("unavailable", "timeout"), tiny
    assert time.monotonic() - started < 1.0 + SLACK


def test_cpu_seconds_over_the_ceiling_do_not_lengthen_a_calls_wall_clock(
        make_client: Callable[..., ExecutorClient]) -> None:
    """--cpu-s 100 under --max-timeout 1: a CPU burner and a sleeper are both killed at the 1 s wall
    clock (the CPU allowance is a second limit, never a longer one)."""
    client = make_client(tools=[TOOLS], max_timeout=1, cpu_s=100)
    for call in (Call(tool="burn", kwargs={"seconds": 30.0}), Call(tool="nap", kwargs={"seconds": 30.0}),
                 Call(tool="burn", kwargs={"seconds": 30.0}, timeout=100.0)):
        started = time.monotonic()
        result = client.call(call)
        took = time.monotonic() - started
        assert result.error is not None and result.error.kind == "timeout", (call, result)
        assert result.limits is not None and result.limits.timeout_s <= 1.0 and result.limits.cpu_s == 100
        assert took < 1.0 + GRACE + SLACK, f"{call.tool}: answered after {took:.1f} s"


def test_a_tool_forging_the_apply_notice_gets_no_grace_past_the_ceiling(
        make_client: Callable[..., ExecutorClient]) -> None:
    """The apply grace (60 s) is for a hardened --workspace-rw keeper applying a call's writes after
    the call ended. A tool that sends the keeper's ``applying`` notice itself, for every sequence
    number, and sleeps on is not given it: answered within the 1 s ceiling plus the grace, its
    forged notice taken for a malformed message (``crashed``) or the deadline reached (``timeout``).
    (Under the hardened profile the keeper turns a call's notice into a malformed one: the overlay
    red team's ``test_a_call_cannot_forge_its_keepers_apply_notice_to_buy_time``; not run here, since
    hardened executors must not run beside the host-mount tests.)"""
    client = make_client(tools=[TOOLS], max_timeout=1)
    started = time.monotonic()
    result = client.call(Call(tool="forge_applying", timeout=3600.0))
    took = time.monotonic() - started
    assert result.error is not None and result.error.kind in ("crashed", "timeout"), result
    assert took < 1.0 + GRACE + SLACK, f"answered after {took:.1f} s: the forged notice bought time"


def test_a_daemon_a_tool_leaves_behind_does_not_outlive_the_ceiling(
        make_client: Callable[..., ExecutorClient], tmp_path: Path) -> None:
    """The tool double-forks a daemon in its own session that ignores SIGTERM and holds a flock,
    then sleeps past the 1 s ceiling: the call is answered ``timeout`` and the lock comes free soon
    after (every process of the call is gone)."""
    client = make_client(tools=[TOOLS], max_timeout=1)
    lock, ready = tmp_path / "held.lock", tmp_path / "ready"
    started = time.monotonic()
    future = client.submit(Call(tool="lingering", kwargs={"lock": str(lock), "ready": str(ready)}, timeout=600.0))
    wait_until("the daemon to hold its lock", ready.exists, timeout=BOUND)
    result = future.result(timeout=BOUND)
    took = time.monotonic() - started
    assert result.error is not None and result.error.kind == "timeout", result
    assert took < 1.0 + GRACE + SLACK, f"answered after {took:.1f} s"

    def free() -> bool:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    wait_until("the daemon to be gone (its lock free)", free, timeout=GRACE + SLACK)


def test_a_queued_call_gets_only_what_is_left_of_the_ceiling(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    """One worker, a 2 s ceiling: the first call sleeps into it; the second, sent while it runs and
    asking for a minute, waits, then runs under what is left of the ceiling (or is answered
    ``unavailable`` without running): from its arrival to its answer, at most the ceiling plus the
    grace."""
    ceiling = 2.0
    wire = Wire(ctx, serve("executor", [TOOLS], ceiling, 1))
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a, b = _cid("first"), _cid("queued")
    wire.send(call_frames(a, "nap", kwargs=mp((s("log"), s(str(log_a)))), timeout=f64(60.0)))
    wait_until("the first call to run", lambda: _lines(log_a), timeout=BOUND)
    wait_until("half a second of it", lambda: time.time() - float(_lines(log_a)[0].split()[1]) >= 0.5)
    sent = time.monotonic()
    wire.send(call_frames(b, "nap", kwargs=mp((s("log"), s(str(log_b)))), timeout=f64(60.0)))
    second = wire.result(b, within=ceiling + GRACE + SLACK + 5)
    took = time.monotonic() - sent
    assert wire.result(a).error is not None
    assert second.error is not None and second.error.kind in ("timeout", "unavailable"), second
    assert took < ceiling + GRACE + SLACK, f"the queued call was answered {took:.1f} s after it was sent"
    if second.error.kind == "timeout":
        assert second.limits is not None and second.limits.timeout_s < ceiling - 0.4, second.limits


@pytest.mark.parametrize("target", TARGETS)
def test_resends_do_not_extend_a_call_past_the_ceiling(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """Lazy Pirate from two sockets: the same call resent every 0.2 s while it runs into the 1.5 s
    ceiling. Every send is answered, all with the one ``timeout`` of the one run, the first within
    the ceiling plus the grace; a resend afterwards gets the same answer from the cache."""
    ceiling = 1.5
    endpoint = serve(target, [TOOLS], ceiling)
    one, two = Wire(ctx, endpoint), Wire(ctx, endpoint)
    log = tmp_path / "runs.log"
    cid = _cid("pirate")
    frames = call_frames(cid, "nap", kwargs=mp((s("log"), s(str(log))), (s("seconds"), f64(30.0))),
                         timeout=f64(3600.0))
    started = time.monotonic()
    first: Result | None = None
    while first is None:
        assert time.monotonic() - started < ceiling + GRACE + SLACK, "no answer within the ceiling plus the grace"
        for w in (one, two):
            w.send(frames)
        for w in (one, two):
            if w._pump(0.2) and w.results.get(cid):
                first = w.results[cid][0]
    took = time.monotonic() - started
    assert first.error is not None and first.error.kind == "timeout", first
    assert took < ceiling + GRACE + SLACK, f"answered after {took:.1f} s"
    for w in (one, two):  # resends joined the call (one answer each), or came after it (from the cache)
        w.result(cid)
        w.drain(0.3)
        w.send(frames)
        w.result(cid, nth=len(w.results[cid]) + 1, within=SLACK)
    answers = one.results[cid] + two.results[cid]
    assert len({(r.error.message if r.error else "", r.worker.pid if r.worker else 0) for r in answers}) == 1, answers
    assert len(_lines(log)) == 1, "the call ran more than once"


@pytest.mark.parametrize("target", TARGETS)
def test_cancel_then_resend_neither_runs_a_call_again_nor_extends_it(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """A running call cancelled and then resent is answered ``cancelled`` again from the cache (never
    run again); a queued one likewise, having never run."""
    endpoint = serve(target, [TOOLS], 5.0)
    wire = Wire(ctx, endpoint)
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a, b = _cid("running"), _cid("queued")
    frames_a = call_frames(a, "nap", kwargs=mp((s("log"), s(str(log_a)))))
    frames_b = call_frames(b, "nap", kwargs=mp((s("log"), s(str(log_b)))))
    wire.send(frames_a)
    wait_until("the call to run", lambda: _lines(log_a), timeout=BOUND)
    wire.send(frames_b)  # one worker: it waits (in the executor's queue, or in the broker's)
    wire.send(encode(Cancel(id=b)))
    wire.send(encode(Cancel(id=a)))
    for cid in (a, b):
        assert (r := wire.result(cid)).error is not None and r.error.kind == "cancelled", r
    started = time.monotonic()
    wire.send(frames_a)
    wire.send(frames_b)
    for cid in (a, b):
        again = wire.result(cid, nth=2)
        assert again.error is not None and again.error.kind == "cancelled", again
    assert time.monotonic() - started < SLACK
    assert len(_lines(log_a)) == 1 and _lines(log_b) == [], (_lines(log_a), _lines(log_b))


def test_a_call_queued_at_a_broker_runs_at_most_the_ceiling_though_answered_later(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    """Documented (SPEC section 12), not a hole: an executor counts a call's timeout from its own
    arrival, so a call that waited in the broker's queue then runs up to the whole ceiling there. The
    run itself stays within the ceiling (plus the grace), and even a raw client that never cancels
    has its answer within the wait (at most the ceiling) plus the ceiling plus the grace; the
    Python client answers at its own bound and cancels (section 7)."""
    ceiling = 3.0
    wire = Wire(ctx, serve("broker", [TOOLS], ceiling, 1))
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a, b = _cid("first"), _cid("second")
    wire.send(call_frames(a, "nap", kwargs=mp((s("log"), s(str(log_a)))), timeout=f64(2.5)))
    wait_until("the first call to run", lambda: _lines(log_a), timeout=BOUND)
    sent = time.monotonic()
    wire.send(call_frames(b, "nap", kwargs=mp((s("log"), s(str(log_b))))))
    second = wire.result(b, within=2 * ceiling + GRACE + SLACK + 5)
    answered, took = time.time(), time.monotonic() - sent
    assert second.error is not None and second.error.kind in ("timeout", "unavailable"), second
    assert took < 2 * ceiling + GRACE + SLACK, f"answered {took:.1f} s after it was sent"
    if _lines(log_b):
        ran = answered - float(_lines(log_b)[0].split()[1])
        assert ran < ceiling + GRACE + SLACK, f"the queued call ran {ran:.1f} s under a {ceiling} s ceiling"


@pytest.mark.parametrize("command", ["serve", "broker"])
def test_a_ceiling_that_is_no_positive_number_of_seconds_up_to_a_day_is_refused_at_start(command: str) -> None:
    """--max-timeout nan, inf, 0, -1, 1e-400 (0.0 once parsed), 1e309 (inf), 86400.001: exit 2."""
    base = {"serve": ["serve", "--tools", TOOLS, "--bind", "ipc:///tmp/ciayn-never/x.sock"],
            "broker": ["broker", "--frontend", "ipc:///tmp/ciayn-never/f.sock", "--backend",
                       "ipc:///tmp/ciayn-never/b.sock"]}[command]
    for value in ("nan", "inf", "0", "-1", "1e-400", "1e309", "86400.001"):
        out = subprocess.run([*EXECUTOR, *base, f"--max-timeout={value}"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, (value, out.returncode, out.stderr[-500:])
        assert "--max-timeout" in out.stderr, (value, out.stderr[-500:])


# Closed in b3b5650 (was: the broker wrote its ceiling into the call's `timeout`, and a broker restarted
# with another --max-timeout, as when an operator first sets or changes it, rewrote the client's resend of
# a call in flight to another call: the executor holding it refused it as "this id was already used for a
# different call", that refusal became the call's answer, and its real result was ignored). The ceiling
# now travels as the call's `max_timeout`, which is no part of the resend key.
@pytest.mark.parametrize("restarted_with", ["the same ceiling", "another ceiling"])
def test_a_call_in_flight_across_a_broker_restart_keeps_matching_its_resend(
        pool: Pool, tmp_path: Path, restarted_with: str) -> None:
    """A call asking for an hour runs on an executor behind a broker with --max-timeout 20 (so it is
    sent there under a 20 s ceiling); the broker is killed and started again, with the same ceiling
    or with 10 s, and the client resends the call once it answers as the same pool (section 8): the
    resend joins the running call and the call's own result comes back; it ran once."""
    log = tmp_path / "runs.log"
    pool.start_broker("--max-timeout", "20")
    pool.add_executor([TOOLS], 1, "--timeout", "60")
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend, timeout=3600) as client:  # every call asks for an hour
        client.tools()
        future = client.submit(Call(tool="nap", kwargs={"seconds": 8.0, "log": str(log)}))
        wait_until("the call to run", lambda: _lines(log), timeout=BOUND)
        assert pool.broker is not None
        pool.kill(pool.broker)
        pool.start_broker("--max-timeout", "20" if restarted_with == "the same ceiling" else "10", recovery_s=3.0)
        result = future.result(timeout=60)
    assert result.ok and result.value == "woke", result
    assert len(_lines(log)) == 1


# -- hostile executors behind a broker


ECHO = ToolSpec(name="echo", signature="(x)", params=[Param(name="x")])


@pytest.fixture
def members(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Callable[..., HostileMember]]:
    made: list[HostileMember] = []

    def make(endpoint: str, ready: Ready | list[bytes] | None, name: str = "") -> HostileMember:
        m = HostileMember(ctx, endpoint, ready, name)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _joined(pool: Pool, n: int) -> None:
    wait_until(f"{n} executors in the pool", lambda: (r := pool.status(0.5)) is not None and len(r.executors) == n)


def _front(ctx: zmq.Context[zmq.Socket[bytes]], pool: Pool) -> Wire:
    wire = Wire(ctx, pool.frontend)
    wait_until("the broker to answer pings", lambda: _answers_ping(wire))
    return wire


@pytest.mark.parametrize("lie", ["a tool and a default of an hour", "a ceiling lower than it keeps"])
def test_a_member_cannot_hold_a_call_past_the_brokers_deadline_whatever_it_announces(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], members: Callable[..., HostileMember], lie: str) -> None:
    """A member announcing an hour as its tool's timeout and its default, and no ceiling, is sent a
    call asking for two hours under the broker's 1 s ceiling (its max_timeout), and the broker answers
    the client ``timeout`` itself at 1 s plus the grace. A member announcing a 0.5 s ceiling (and
    then keeping the call) is trusted to cut the call itself, and held to 0.5 s plus the grace. A
    resend afterwards is answered from the broker's cache, never sent to the member again."""
    if lie == "a tool and a default of an hour":
        pool.start_broker("--max-timeout", "1")
        spec = ECHO.model_copy(update={"timeout": 3600.0})
        ready = Ready(executor="liar", incarnation=1, tools=[spec], limits=Limits(timeout_s=3600.0))
        bound, sent_timeout = 1.0, 1.0
    else:
        pool.start_broker("--max-timeout", "10")
        ready = Ready(executor="liar", incarnation=1, tools=[ECHO], limits=Limits(), max_timeout_s=0.5)
        bound, sent_timeout = 0.5, 7200.0
    liar = members(pool.backend, ready)
    _joined(pool, 1)
    wire = _front(ctx, pool)
    cid = _cid("held")
    frames = call_frames(cid, "echo", arr(u(1, 0)), timeout=f64(7200.0))
    started = time.monotonic()
    wire.send(frames)
    sent = liar.expect(Call)
    result = wire.result(cid)
    took = time.monotonic() - started
    assert sent is not None and sent.id == cid and _told(sent) == sent_timeout, sent
    assert result.error is not None and result.error.kind == "timeout" and "'liar' did not answer" in \
        result.error.message, result
    assert took < bound + GRACE + SLACK, f"answered after {took:.1f} s"
    assert liar.expect(Cancel, timeout=5) is not None, "the broker did not cancel the call on the liar"
    wire.send(frames)
    again = wire.result(cid, nth=2, within=SLACK)
    assert again.error is not None and again.error.message == result.error.message, again
    assert liar.expect(Call, timeout=0.5) is None, "the resend was sent to the member again"


def _told(call: Call) -> float:
    """The longest the executor is told to let ``call`` run: its timeout, cut to its ``max_timeout``
    (the field a broker puts its ceiling in, b3b5650) when it has one."""
    ceiling = getattr(call, "max_timeout", None)
    return min(call.timeout or float("inf"), ceiling or float("inf"))


def _ready_body(**changes: Any) -> list[bytes]:
    fields = Ready(executor="odd", incarnation=1, tools=[ECHO], limits=Limits()).model_dump(
        mode="python", exclude_defaults=True)
    limits = changes.pop("limits", None)
    if limits is not None:
        fields["limits"] = limits
    fields.update(changes)
    return [VERSION, b"ready", pk(fields)]


def test_a_ready_with_an_invalid_ceiling_or_default_makes_no_member_and_a_tiny_one_cannot_stall_calls(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], members: Callable[..., HostileMember]) -> None:
    """``max_timeout_s`` or ``limits.timeout_s`` of nan, inf, 0, -1, over a day, a bool or a str
    make the ``ready`` a protocol error: the broker stays up, the sender is no member (its next
    heartbeat is answered "announce again"). A valid but absurd ceiling, 5e-324, joins; the broker
    holds calls to it at that plus the grace."""
    pool.start_broker()
    odd: tuple[Any, ...] = (float("nan"), float("inf"), 0.0, -1.0, 86401.0, True, "1")
    bad: list[dict[str, Any]] = [{"max_timeout_s": v} for v in odd]
    bad += [{"limits": {"timeout_s": v}} for v in (float("nan"), float("inf"), 0.0, -5.0, False)]
    for change in bad:
        m = members(pool.backend, None, name="odd")
        m.send(_ready_body(**change))
        m.send(Heartbeat(executor="odd"))
        bye = m.expect(Bye)
        assert bye is not None and not bye.refused and "unknown executor" in bye.reason, (change, bye)
        m.close()
    report = pool.status()
    assert report is not None and report.executors == [], report
    tiny = members(pool.backend, Ready(executor="tiny", incarnation=1, tools=[ECHO], limits=Limits(),
                                       max_timeout_s=5e-324))
    _joined(pool, 1)
    wire = _front(ctx, pool)
    assert wire.welcome().max_timeout_s == 5e-324
    cid = _cid("to-tiny")
    started = time.monotonic()
    wire.send(call_frames(cid, "echo", arr(u(1, 0))))
    assert tiny.expect(Call) is not None
    result = wire.result(cid)
    assert result.error is not None and result.error.kind == "timeout", result
    assert time.monotonic() - started < GRACE + SLACK


def test_apply_notices_again_and_again_extend_a_call_once_by_the_brokers_grace_only(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], members: Callable[..., HostileMember]) -> None:
    """The member announces a day of apply grace and lists the call in ``applying`` in every
    heartbeat for 15 s, never answering. With --max-timeout 1 --apply-grace 2 the broker answers
    ``timeout`` at 1 s + 2 s, or 2 s after the first notice plus 2 s: well before the notices end."""
    pool.start_broker("--max-timeout", "1", "--apply-grace", "2")
    liar = members(pool.backend, Ready(executor="applier", incarnation=1, tools=[ECHO], limits=Limits(),
                                       apply_grace_s=86400.0))
    _joined(pool, 1)
    wire = _front(ctx, pool)
    cid = _cid("applying")
    started = time.monotonic()
    wire.send(call_frames(cid, "echo", arr(u(1, 0)), timeout=f64(3600.0)))
    assert liar.expect(Call) is not None
    liar.applying = [cid]
    result = wire.result(cid, within=15.0)
    took = time.monotonic() - started
    liar.applying = []
    assert result.error is not None and result.error.kind == "timeout", result
    assert "2 s it was given to apply" in result.error.message, result.error.message
    assert took < 1.0 + GRACE + 2.0 + GRACE + SLACK, f"answered after {took:.1f} s"


def test_an_apply_notice_from_another_member_does_not_extend_a_call(
        pool: Pool, ctx: zmq.Context[zmq.Socket[bytes]], members: Callable[..., HostileMember]) -> None:
    """Two members with a day of apply grace each; the one not running the call lists it as
    applying in every heartbeat. Ignored: the call is answered at its 1 s ceiling plus the grace."""
    pool.start_broker("--max-timeout", "1", "--apply-grace", "30")
    a = members(pool.backend, Ready(executor="a", incarnation=1, tools=[ECHO], limits=Limits(), apply_grace_s=86400.0))
    b = members(pool.backend, Ready(executor="b", incarnation=1, tools=[ECHO], limits=Limits(), apply_grace_s=86400.0))
    _joined(pool, 2)
    wire = _front(ctx, pool)
    cid = _cid("other")
    started = time.monotonic()
    wire.send(call_frames(cid, "echo", arr(u(1, 0))))
    got: dict[str, Call] = {}
    wait_until("the call to reach a member", lambda: any(
        (c := m.expect(Call, timeout=0.05)) is not None and got.setdefault(m.name, c) for m in (a, b)))
    other = b if "a" in got else a
    other.applying = [cid]  # the member not running it lies about it; neither answers
    result = wire.result(cid, within=40.0)
    took = time.monotonic() - started
    assert result.error is not None and result.error.kind == "timeout", result
    assert "apply" not in result.error.message, result.error.message
    assert took < 1.0 + GRACE + SLACK, f"answered after {took:.1f} s: another member's notice extended it"


# ================================================================ 2. the canonical resend key


NFC, NFD = unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")
KELVIN = "\u212a"  # KELVIN SIGN, which NFKC folds to "K"


def _nest(depth: int, reverse: bool) -> bytes:
    """``depth`` maps, each {"b": 1, "a": <the next>}, written in either key order."""
    inner = mp()
    for _ in range(depth):
        pairs = [(s("b"), u(1, 0)), (s("a"), inner)]
        inner = mp(*(reversed(pairs) if reverse else pairs))
    return inner


def _same_pairs(log: str) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Calls of ``tally`` written two ways that are the same call (SPEC section 8)."""
    L = s(log)
    ints_short = [u(2**63 - 1, 64), u(0, 0), i(-1, 0), i(-32, 0), u(255, 8), i(-(2**63), 64), u(2**64 - 1, 64),
                  u(127, 0), i(-33, 8), u(65535, 16)]
    ints_wide = [i(2**63 - 1, 64), u(0, 64), i(-1, 64), i(-32, 8), u(255, 16), i(-(2**63), 64), u(2**64 - 1, 64),
                 i(127, 32), i(-33, 64), u(65535, 64)]
    return {
        "nan-signalling-and-quiet": ({"args": arr(L, f64(bits=0x7FF0000000000001))},
                                     {"args": arr(L, f64(bits=0x7FF8000000000000))}),
        "nan-negative-and-all-ones": ({"args": arr(L, f64(bits=0xFFF8000000000000))},
                                      {"args": arr(L, f64(bits=0x7FFFFFFFFFFFFFFF))}),
        "nan-float32-payload-deep": ({"kwargs": mp((s("x"), arr(mp((s("y"), f32(bits=0x7FC00001))))))},
                                     {"kwargs": mp((s("x"), arr(mp((s("y"), f64(bits=0xFFF0000000000001))))))}),
        "negative-zero-float32-and-64": ({"args": arr(L, f32(bits=0x80000000))}, {"args": arr(L, f64(-0.0))}),
        "ints-at-64-bit-edges-in-every-width": ({"args": arr(L, *ints_short)}, {"args": arr(L, *ints_wide)}),
        "bin-8-and-bin-32": ({"args": arr(L, bn(b"\x00\xff", 8))}, {"args": arr(L, bn(b"\x00\xff", 32))}),
        "nfd-key-str-8-and-str-32": ({"kwargs": mp((s(NFD, 8), u(1, 0)))}, {"kwargs": mp((s(NFD, 32), u(1, 0)))}),
        "empty-nul-and-prefix-keys-reordered": (
            {"kwargs": mp((s(""), u(1, 0)), (s("\x00"), u(2, 0)), (s("a\x00b"), u(3, 0)), (s("a"), u(4, 0)))},
            {"kwargs": mp((s("a"), u(4, 0)), (s("a\x00b"), u(3, 0)), (s("\x00"), u(2, 0)), (s(""), u(1, 0)))}),
        "63-maps-deep-reordered-at-every-level": ({"kwargs": mp((s("deep"), _nest(63, False)))},
                                                  {"kwargs": mp((s("deep"), _nest(63, True)))}),
        "wide-array-and-map-headers": (
            {"args": arr(L, u(1, 0)), "kwargs": mp((s("k"), u(1, 0)))},
            {"args": arr(L, u(1, 0), wide=True), "kwargs": mp((s("k"), u(1, 0)), wide=True)}),
        "unknown-fields-differ": ({"args": arr(L), "extra": ((s("zz"), arr(u(1, 0))),)},
                                  {"args": arr(L), "extra": ((s("zz"), s("other")), (s("trace"), mp())),
                                   "first": ((s("aa"), b"\xc0"),)}),
        "timeout-float32-and-int": ({"args": arr(L), "timeout": f32(4.0)}, {"args": arr(L), "timeout": u(4, 0)}),
    }


def _different_pairs(log: str) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Calls of ``tally`` that a tool can tell apart: another call under the id (refused)."""
    L = s(log)
    return {
        "nfc-and-nfd-key": ({"kwargs": mp((s(NFC), u(1, 0)))}, {"kwargs": mp((s(NFD), u(1, 0)))}),
        "nfc-and-nfd-value": ({"args": arr(L, s(NFC))}, {"args": arr(L, s(NFD))}),
        "kelvin-sign-and-k": ({"kwargs": mp((s("K"), u(1, 0)))}, {"kwargs": mp((s(KELVIN), u(1, 0)))}),
        "int-and-float-2-53": ({"args": arr(L, u(2**53, 64))}, {"args": arr(L, f64(float(2**53)))}),
        "uint64-max-and-its-float": ({"args": arr(L, u(2**64 - 1, 64))}, {"args": arr(L, f64(float(2**64 - 1)))}),
        "float32-zero-and-negative-zero": ({"args": arr(L, f32(0.0))}, {"args": arr(L, f64(-0.0))}),
        "nan-and-inf": ({"args": arr(L, f64(float("nan")))}, {"args": arr(L, f64(float("inf")))}),
        "empty-list-and-empty-map": ({"args": arr(L, arr())}, {"args": arr(L, mp())}),
        "a-nil-kwarg-and-none": ({"args": arr(L), "kwargs": mp((s("a"), b"\xc0"))}, {"args": arr(L)}),
        "a-nil-arg-and-none": ({"args": arr(L, b"\xc0")}, {"args": arr(L)}),
        "bin-and-str-deep": ({"kwargs": mp((s("x"), arr(arr(bn(b"a")))))}, {"kwargs": mp((s("x"), arr(arr(s("a")))))}),
        "true-and-1-in-a-map": ({"kwargs": mp((s("x"), b"\xc3"))}, {"kwargs": mp((s("x"), u(1, 0)))}),
        "a-key-with-a-trailing-nul": ({"kwargs": mp((s("a"), u(1, 0)))}, {"kwargs": mp((s("a\x00"), u(1, 0)))}),
        "timeout-float32-is-not-the-nearest-float64": ({"args": arr(L), "timeout": f64(1.1)},
                                                       {"args": arr(L), "timeout": f32(1.1)}),
        "two-timeouts-both-over-the-ceiling": ({"args": arr(L), "timeout": f64(20.0)},
                                               {"args": arr(L), "timeout": f64(30.0)}),
    }


def _tally(cid: str, log: str, parts: dict[str, Any]) -> list[bytes]:
    args = parts.get("args", arr(s(log)))
    if "kwargs" in parts and "args" not in parts:
        args = arr(s(log))
    return call_frames(cid, "tally", args, parts.get("kwargs"), parts.get("timeout"),
                       parts.get("extra", ()), parts.get("first", ()))


@pytest.mark.parametrize("target", TARGETS)
def test_a_resend_written_another_way_is_the_same_call(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """NaN payloads (signalling, negative, float 32, deep in a map), -0.0 as float 32 and 64, ints
    at the 64-bit edges in every width, bin and str headers, NFD keys, empty, NUL and prefix keys
    reordered, 63 maps deep reordered at every level, wide array and map headers, unknown fields,
    a float-32 timeout and an int one: each resend is answered with the first run's token, and
    nothing runs twice."""
    wire = Wire(ctx, serve(target, [TOOLS], 10.0))
    log = str(tmp_path / "runs.log")
    pairs = _same_pairs(log)
    for name, (first, resend) in pairs.items():
        cid = _cid(name[:60])
        wire.send(_tally(cid, log, first))
        one = wire.result(cid)
        assert one.ok, (name, one)
        wire.send(_tally(cid, log, resend))
        two = wire.result(cid, nth=2)
        assert two.ok and two.value == one.value, (name, two)
    assert len(_lines(Path(log))) == len(pairs), "a resend ran again"


@pytest.mark.parametrize("target", TARGETS)
def test_another_call_under_the_id_is_refused_where_a_tool_could_tell_them_apart(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """NFC and NFD (keys and values), the Kelvin sign and K, int and float at 2^53 and 2^64-1, 0.0
    as float 32 and -0.0, NaN and inf, [] and {}, a nil argument and none, bin and str deep down,
    true and 1, a trailing NUL in a key, a float-32 timeout and the float 64 next to it, two timeouts
    both over the 10 s ceiling (each cut to it, still two calls): refused ``protocol``, the first
    run's token not given away, and the first call's true resend still answered with it."""
    wire = Wire(ctx, serve(target, [TOOLS], 10.0))
    log = str(tmp_path / "runs.log")
    pairs = _different_pairs(log)
    for name, (first, other) in pairs.items():
        cid = _cid(name[:60])
        wire.send(_tally(cid, log, first))
        one = wire.result(cid)
        assert one.ok, (name, one)
        wire.send(_tally(cid, log, other))
        refused = wire.result(cid, nth=2)
        assert refused.error is not None and refused.error.kind == "protocol", (name, refused)
        assert "different call" in refused.error.message and str(one.value) not in str(refused.model_dump())
        wire.send(_tally(cid, log, first))
        assert wire.result(cid, nth=3).value == one.value, name
    assert len(_lines(Path(log))) == len(pairs)


def test_duplicate_keys_and_extension_types_are_refused_and_not_remembered(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    """A kwargs map repeating a key, a body repeating ``kwargs``, ``timeout`` or ``id``, an
    extension type (ext 1, a timestamp) in the arguments: ``protocol``, nothing runs, and the id
    may then be used for a good call. An NFC and an NFD key side by side are two keys, not a
    repeat."""
    wire = Wire(ctx, serve("executor", [TOOLS], 10.0))
    log = tmp_path / "runs.log"
    L = s(str(log))
    cid = _cid("dup")
    bodies = {
        "kwargs-repeats-a-key": call_frames(cid, "tally", arr(L), mp((s("a"), u(1, 0)), (s("a"), u(2, 0)))),
        "body-repeats-kwargs": call_frames(cid, "tally", arr(L), mp((s("a"), u(1, 0))),
                                           extra=((s("kwargs"), mp((s("b"), u(1, 0)))),)),
        "body-repeats-timeout": call_frames(cid, "tally", arr(L), timeout=f64(1.0),
                                            extra=((s("timeout"), f64(2.0)),)),
        "body-repeats-id": call_frames(cid, "tally", arr(L), extra=((s("id"), s("someone-else")),)),
        "ext-1-in-args": call_frames(cid, "tally", arr(L, b"\xd4\x01\x00")),
        "timestamp-in-kwargs": call_frames(cid, "tally", arr(L), mp((s("t"), b"\xd6\xff\x00\x00\x00\x01"))),
        "nested-map-repeats-a-key-with-another-width": call_frames(
            cid, "tally", arr(L), mp((s("m"), mp((s("k", 8), u(1, 0)), (s("k", 32), u(1, 0)))))),
    }
    for n, (name, frames) in enumerate(bodies.items(), start=1):
        wire.send(frames)
        reply = wire.result(cid, nth=n)
        assert reply.error is not None and reply.error.kind == "protocol", (name, reply)
    assert _lines(log) == []
    both = call_frames(cid, "tally", arr(L), mp((s(NFC), u(1, 0)), (s(NFD), u(2, 0))))
    wire.send(both)
    ran = wire.result(cid, nth=len(bodies) + 1)
    assert ran.ok, ran
    wire.send(call_frames(cid, "tally", arr(L), mp((s(NFD), u(2, 0)), (s(NFC), u(1, 0)))))
    assert wire.result(cid, nth=len(bodies) + 2).value == ran.value
    assert len(_lines(log)) == 1


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def test_the_key_of_the_largest_body_an_executor_accepts_costs_about_what_decoding_it_does(
        make_client: Callable[..., ExecutorClient], ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The worst body for the key: 61 MiB of kwargs, 131,000 keys of 488 bytes sharing a 480-byte
    prefix, shuffled (sorting compares the prefix every time), under the element budget. The key is
    computed before the tool is even looked up, so an unknown tool pays it. Measured in-process on
    an idle core: decoding 0.2-0.35 s and an 84 MiB peak; the key 0.3-0.6 s more and a 129 MiB peak
    on top (the canonical copy of the map and the 61 MiB packed key, built whole to be hashed):
    linear in the body, like the decoder, if about twice its memory. Against a real executor:
    answered in 1.1 s, its peak memory 271 MiB over a 40 MiB start. Bounds here: 10 s, 384 MiB,
    and a ping answered at once right after."""
    client = make_client(tools=[TOOLS])
    supervisor = client.local.proc.pid  # type: ignore[attr-defined]
    keys = ["k" * 480 + f"{n:08d}" for n in range(131_000)]
    random.Random(24).shuffle(keys)
    body = pk({"id": (cid := _cid("huge")), "tool": "no_such_tool", "kwargs": dict.fromkeys(keys, 0)})
    del keys
    assert 60 * 2**20 < len(body) < 64 * 2**20
    wire = Wire(ctx, client.endpoint)
    wire.ping()
    before = _vm(supervisor, "VmHWM")
    started = time.monotonic()
    wire.send([VERSION, b"call", body])
    reply = wire.result(cid, within=60.0)
    took = time.monotonic() - started
    grew_mib = (_vm(supervisor, "VmHWM") - before) / 1024
    assert reply.error is not None and reply.error.kind == "unknown_tool", reply
    assert took < 10.0, f"the executor took {took:.1f} s over one body"
    assert grew_mib < 6 * 64, f"the executor's peak memory grew by {grew_mib:.0f} MiB over one 61 MiB body"
    assert wire.ping() < 1.0


@pytest.mark.parametrize("target", TARGETS)
def test_a_resend_racing_its_first_send_runs_once_and_a_racing_other_body_is_refused(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, target: str) -> None:
    """Three sockets send the same call five times each, back to back, in two key orders and int
    widths, while a fourth sends another body under the id: every answer any of the three gets
    (those in flight joined the call, later ones come from the cache, and one more resend each
    afterwards) carries the one run's token, the fourth gets ``protocol``, and the tool ran once.
    Four connections have no order between them: when the fourth body is read first (about one run
    in 25 through the broker), it is the call, and every answer the three get is ``protocol``."""
    endpoint = serve(target, [TOOLS], 10.0)
    wires = [Wire(ctx, endpoint) for _ in range(4)]
    log = tmp_path / "runs.log"
    L = s(str(log))
    cid = _cid("race")
    ab = call_frames(cid, "tally", arr(L), mp((s("a"), u(1, 0)), (s("b"), u(2, 0))))
    ba = call_frames(cid, "tally", arr(L), mp((s("b"), u(2, 64)), (s("a"), u(1, 32))))
    other = call_frames(cid, "tally", arr(L), mp((s("a"), u(1, 0)), (s("b"), u(3, 0))))
    for n in range(5):
        for k, w in enumerate(wires[:3]):
            w.send(ab if (n + k) % 2 else ba)
        if n == 0:
            wires[3].send(other)
    for w in wires[:3]:  # sends while it ran joined it (one answer); later ones came from the cache
        w.result(cid)
        w.drain(0.3)
        w.send(ab)
        w.result(cid, nth=len(w.results[cid]) + 1, within=SLACK)
    tokens = {r.value for w in wires[:3] for r in w.results[cid]}
    thief = wires[3].result(cid)
    if thief.ok:  # the other body was read first: it ran, and the same call's resends are refused
        refused = [r for w in wires[:3] for r in w.results[cid]]
        assert all(r.error is not None and r.error.kind == "protocol" for r in refused), refused
        assert thief.value is not None, thief
    else:
        assert len(tokens) == 1 and None not in tokens, tokens
        assert thief.error is not None and thief.error.kind == "protocol" and thief.value is None, thief
    assert len(_lines(log)) == 1


def test_a_resend_after_its_result_left_the_brokers_cache_is_not_run_again(
        serve: Serve, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    """--result-cache-mb 1 and 1.6 MiB of later results from the same client push the first answer
    out: its resend in another key order and int width is ``unavailable`` ("already ran", not run
    again), another body under the id still ``protocol``."""
    wire = Wire(ctx, serve("broker", [TOOLS], None, 1, "--result-cache-mb", "1"))
    log = tmp_path / "runs.log"
    L = s(str(log))
    cid = _cid("evicted")
    wire.send(call_frames(cid, "tally", arr(L), mp((s("a"), u(1, 0)), (s("b"), u(2, 0)))))
    assert wire.result(cid).ok
    for n in range(4):
        filler = _cid(f"filler{n}")
        wire.send(call_frames(filler, "blob", kwargs=mp((s("kb"), u(400, 16)))))
        assert wire.result(filler).ok
    wire.send(call_frames(cid, "tally", arr(L), mp((s("b"), u(2, 64)), (s("a"), u(1, 16)))))
    again = wire.result(cid, nth=2)
    assert again.error is not None and again.error.kind == "unavailable", again
    assert "already ran" in again.error.message and "not run again" in again.error.message, again
    wire.send(call_frames(cid, "tally", arr(L), mp((s("a"), u(1, 0)))))
    other = wire.result(cid, nth=3)
    assert other.error is not None and other.error.kind == "protocol", other
    assert len(_lines(log)) == 1


# Two calls of resend_echo's echo whose 48-bit digests were equal under PYTHONHASHSEED=0 when the
# digest was 48 bits of Python's hash() of the canonical key (executor.calls.fingerprint at bb13877),
# found once offline with Brent's cycle finding (~3.6e7 hashes, 40 s of one core): x -> the digest of
# echo(x | 2**48). The tests below send them whatever the digest is now.
COLLIDING = (548061897775025, 495799397522077)


def _collide_under_seed_zero() -> bool:
    """Whether the pair still collides in Python's own hash() under seed 0 (another Python may hash
    otherwise; then the precomputed pair proves nothing)."""
    code = ("from protocol import Call, resend_key; "
            f"a, b = ({COLLIDING[0]}, {COLLIDING[1]}); m = (1 << 48) - 1; "
            "h = lambda x: hash(resend_key(Call(tool='echo', args=[x]))) & m; print(h(a) == h(b))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": "0"}, cwd=TESTS.parent)
    return out.stdout.strip() == "True"


def _send_colliding_pair(wire: Wire) -> tuple[Result, Result]:
    cid = _cid("collide")
    wire.send(call_frames(cid, "echo", arr(pk(COLLIDING[0]))))
    first = wire.result(cid)
    assert first.ok, first
    wire.send(call_frames(cid, "echo", arr(pk(COLLIDING[1]))))
    return first, wire.result(cid, nth=2)


# Closed in a7cb943 (was: the broker compared 48 bits of Python's hash() of the resend key, and
# `ciayn-executor broker` keeps the PYTHONHASHSEED it was started with, unlike `serve`, which re-execs with
# a clean environment; under PYTHONHASHSEED=0 it answered echo(495799397522077) with the cached result of
# echo(548061897775025) sent under the same id). Digests are now BLAKE2b keyed with a per-process secret.
def test_a_broker_under_a_known_hash_seed_refuses_a_colliding_call_under_the_same_id(
        tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker is started with PYTHONHASHSEED=0 in its environment; the two calls whose digests
    collided under that seed are sent under one id: the second is refused as another call."""
    if not _collide_under_seed_zero():
        pytest.skip("the precomputed pair does not collide on this Python (another hash function)")
    pool = Pool(tmp_path)
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "0")
        pool.start_broker()
        monkeypatch.delenv("PYTHONHASHSEED")
        pool.add_executor([RESEND_ECHO], 1)
        pool.wait_for_executors(1)
        first, second = _send_colliding_pair(_front(ctx, pool))
    finally:
        pool.stop()
    assert second.error is not None and second.error.kind == "protocol", (
        f"the colliding call got the first call's answer: {second.value!r} == {first.value!r}")


def test_an_executor_started_under_a_known_hash_seed_refuses_a_colliding_call_under_the_same_id(
        tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Held: ``serve`` starts again in a fresh interpreter with only the allowlisted environment, so
    PYTHONHASHSEED does not reach it and its hash is keyed at random: the pair that collides under
    seed 0 is refused."""
    if not _collide_under_seed_zero():
        pytest.skip("the precomputed pair does not collide on this Python (another hash function)")
    private = tmp_path / "ep"
    private.mkdir(mode=0o700)
    endpoint = f"ipc://{private}/x.sock"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*EXECUTOR, "serve", "--tools", RESEND_ECHO, "--bind", endpoint],
                                env={**os.environ, "PYTHONHASHSEED": "0"}, cwd=TESTS.parent, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wire = Wire(ctx, endpoint)
        wait_until("the executor to answer pings", lambda: _answers_ping(wire), timeout=START_BOUND)
        first, second = _send_colliding_pair(wire)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert second.error is not None and second.error.kind == "protocol", (first, second)
