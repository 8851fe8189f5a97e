"""The edges of the wire contract that an outside implementer (a client, an executor and a broker member
written in Node from the SPEC) found unwritten or misstated (issue 24): each is checked against a
real executor over a real socket, and against what ``protocol/SPEC.md`` says of it."""

from __future__ import annotations

import inspect
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from controller import ExecutorClient
from executor import registry, signals
from executor.status import fetch
from protocol import LATENCY_BUCKETS, VERSION, Call, Pong, Result, decode, encode
from protocol.schema import SPEC_PATH
from tests.support.waiting import wait_until

SPEC = " ".join(SPEC_PATH.read_text().split())  # prose as one line: phrases may wrap anywhere
EDGES = str(Path(__file__).parent / "tools" / "spec_edges.py")


@pytest.fixture
def edges(make_client: Callable[..., ExecutorClient]) -> ExecutorClient:
    return make_client(tools=[EDGES], workers=2)


def _answer(sock: zmq.Socket[bytes], frames: list[bytes]) -> Any:
    sock.send_multipart(frames)
    return decode(sock.recv_multipart())


def test_a_repr_value_is_at_most_what_the_spec_says(edges: ExecutorClient) -> None:
    """Before, the SPEC said 100,000 characters; the executor sends the cut plus its note."""
    result = edges.call(Call(tool="big_set"))
    assert result.ok and result.value_is_repr, result
    assert isinstance(result.value, str) and result.value.endswith("... [repr truncated]")
    assert len(result.value) == 100_020 and "`value` is at most 100,020 characters" in SPEC


def _map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map of raw-encoded (key, value) pairs, in this order."""
    return b"\xde" + len(pairs).to_bytes(2, "big") + b"".join(k + v for k, v in pairs)


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


BROKEN = (_pack("args"), b"\x81\x01\x02")  # an int key: the body is refused, whatever else it holds


@pytest.mark.parametrize(("fillers", "filler_bytes", "echoed"), [
    (63, 1, True),  # the id is the 64th field
    (64, 1, False),  # the 65th: not looked for
    (1, 60_000, True),  # starts and ends within the first 64 KiB
    (1, 66_000, False),  # starts past it
], ids=["64th-field", "65th-field", "within-64KiB", "past-64KiB"])
def test_how_far_the_id_of_a_broken_body_is_read(
        edges: ExecutorClient, dealer: Callable[..., zmq.Socket[bytes]], fillers: int, filler_bytes: int,
        echoed: bool) -> None:
    wire = dealer(edges.local.endpoint)  # type: ignore[attr-defined]
    cid = f"edge-{uuid.uuid4().hex[:8]}"
    pairs = [(_pack(f"f{i}"), _pack("x" * filler_bytes)) for i in range(fillers)]
    body = _map([*pairs, (_pack("id"), _pack(cid)), (_pack("tool"), _pack("big_set")), BROKEN])
    reply = _answer(wire, [VERSION, b"call", body])
    assert isinstance(reply, Result) and reply.error is not None and reply.error.kind == "protocol", reply
    assert reply.id == (cid if echoed else ""), reply
    assert "at most its first 64 top-level fields are looked at" in SPEC and "`PEEK_BYTES` = 64 KiB" in SPEC


def test_a_ping_broken_at_frame_level_is_answered_with_a_result_and_one_broken_in_its_body_with_a_pong(
        edges: ExecutorClient, dealer: Callable[..., zmq.Socket[bytes]]) -> None:
    wire = dealer(edges.local.endpoint)  # type: ignore[attr-defined]
    body = _map([(_pack("nonce"), _pack(7)), (_pack("extra"), b"\xc1")])  # 0xc1: never valid msgpack
    for frames in ([b"ciayn/2", b"ping", body], [VERSION, b"ping"], [VERSION, b"ping", body, b"more"]):
        reply = _answer(wire, frames)
        assert isinstance(reply, Result) and reply.id == "" and reply.error is not None, (frames, reply)
        assert reply.error.kind == "protocol"
    pong = _answer(wire, [VERSION, b"ping", body])
    assert isinstance(pong, Pong) and pong.nonce == 7 and pong.error is not None and pong.error.kind == "protocol"
    assert "a message broken at frame level (not three frames, another version tag, an unknown kind) is " \
           "answered with a `result`" in SPEC


def test_an_answer_for_a_client_that_is_gone_is_dropped_and_its_resend_gets_it(
        edges: ExecutorClient, dealer: Callable[..., zmq.Socket[bytes]]) -> None:
    endpoint = edges.local.endpoint  # type: ignore[attr-defined]
    identity = b"c" + uuid.uuid4().bytes
    call = Call(id=uuid.uuid4().hex, tool="flagged_tool", kwargs={"seconds": 0.5})
    first = dealer(endpoint, routing_id=identity)
    first.send_multipart(encode(call))
    wait_until("the call to run", lambda: fetch(endpoint).busy == 1)
    first.close(0)  # gone before its answer
    wait_until("the call to be answered", lambda: fetch(endpoint).served >= 1)
    back = dealer(endpoint, routing_id=identity)  # the same client, reconnected
    back.send_multipart(encode(Pong()))  # any message: the connection is up; the answer is not queued for it
    assert isinstance(decode(back.recv_multipart()), Result)  # (the refusal of that pong, id "")
    assert not back.poll(500), "an answer for a client that was gone was kept for it"
    resent = _answer(back, encode(call))
    assert isinstance(resent, Result) and resent.ok and resent.id == call.id, resent
    assert fetch(endpoint).served == 1, "the resend ran the call again"  # answered from the cache
    assert "An answer for a client that is not connected when it is ready" in SPEC


def test_status_buckets_are_the_bounds_the_spec_lists(edges: ExecutorClient) -> None:
    listed = re.search(r"of wall times: ([0-9., ]+) and \+Inf \((\d+) bounds\)", SPEC)
    assert listed, "the SPEC does not list the latency buckets"
    bounds = [float(b) for b in listed.group(1).replace(" and ", ", ").split(", ")]
    assert [*bounds, float("inf")] == list(LATENCY_BUCKETS) and int(listed.group(2)) == len(LATENCY_BUCKETS)
    for _ in range(3):
        assert edges.call(Call(tool="flagged_tool")).ok
    [stats] = [t for t in fetch(edges.local.endpoint).tools if t.name == "flagged_tool"]  # type: ignore[attr-defined]
    assert len(stats.buckets) == len(LATENCY_BUCKETS) and stats.buckets[-1] == stats.calls == 3
    assert stats.buckets == sorted(stats.buckets)  # cumulative


def test_tool_modules_and_signals_are_what_the_spec_says(edges: ExecutorClient) -> None:
    specs = {s.name: s for s in edges.tools()}
    assert set(specs) == {"big_set", "flagged_tool", "signal_then_fail", "listed"}  # not _private
    flagged, listed = specs["flagged_tool"], specs["listed"]
    assert (flagged.idempotent, flagged.no_repeat, flagged.bundleable, flagged.timeout) == (True, True, True, 5)
    assert (listed.idempotent, listed.no_repeat, listed.bundleable, listed.timeout) == (False, False, False, None)
    failed = edges.call(Call(tool="signal_then_fail"))
    assert failed.error is not None and failed.error.kind == "tool_error"
    assert [(s.kind, s.message) for s in failed.signals] == [("note", "looked"), ("complete", "done anyway")]
    section = SPEC[SPEC.index("## 13. Tools in the Python executor"):]
    flags = [p for p in inspect.signature(registry.tool).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert "@tool(" + ", ".join(f"{p.name}={p.default}" for p in flags) + ")" in section
    for name in ("complete", "exit", "note"):
        params = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}".replace("'", '"')
                           for p in inspect.signature(getattr(signals, name)).parameters.values())
        assert f"signals.{name}({params})" in section, name
    assert "its `__all__` lists" in section
