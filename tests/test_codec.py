"""The wire codec: every message round-trips, and ``decode`` refuses anything malformed with
``ProtocolError`` (kind ``protocol``) and nothing else; ``encode`` refuses values that may not cross."""

from __future__ import annotations

import keyword
import math
import time
import tracemalloc
from datetime import date
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    ERROR_KINDS,
    MAX_FRAME_BYTES,
    VERSION,
    Body,
    Bye,
    Call,
    Cancel,
    ErrorInfo,
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
    Signal,
    Stats,
    Status,
    ToolSpec,
    ToolStats,
    Welcome,
    WorkerInfo,
    decode,
    encode,
    parse_call,
)
from protocol.messages import BY_KIND, MESSAGE_TYPES
from protocol.spec import Param
from protocol.values import CONTAINER_COST, INT_MAX, INT_MIN, MAX_DEPTH, MAX_ELEMENTS, unpack
from tests.support.bombs import BOMBS


def read_file(path: str, start: int = 0) -> str:
    """Read a file."""
    return path


SPEC = ToolSpec.from_function(read_file, bundleable=True, idempotent=True, timeout=3.0)
LIMITS = Limits(timeout_s=5.0, cpu_s=4.0, memory_mb=256, max_output_kb=64, max_result_kb=128, open_files=32)

SAMPLES: list[Body] = [
    Call(tool="read_file", id="c-0"),
    Call(
        tool="read_file",
        args=["a", 1, -2.5, None, True, b"\x00\xff", [1, [2]], {"k": {"n": None}}],
        kwargs={"start": 3, "big": INT_MAX, "small": INT_MIN, "inf": math.inf, "s": "é✓\x00"},
        id="c-1",
        timeout=2.5,
    ),
    Result(id="c-1", ok=True),
    Result(
        id="c-2",
        ok=False,
        value={"partial": [1, 2]},
        value_is_repr=True,
        error=ErrorInfo(kind="crashed", message="worker died", type="X", traceback="tb", signal=9),
        stdout="out",
        stderr="err",
        signals=[Signal(kind="complete", message="done"), Signal(kind="note")],
        worker=WorkerInfo(id=1, pid=1234, incarnation=2, restarted=True),
        stats=Stats(wall_s=0.5, cpu_s=0.25, peak_rss_kb=2048),
        limits=LIMITS,
        executor="ex-1",
    ),
    Result.failure("c-3", "timeout", "ran past 5 s"),
    Hello(),
    Hello(client="ctl-1"),
    Welcome(executor="ex-1", incarnation=3, tools=[SPEC], limits=LIMITS, workers=4, profile="hardened"),
    Ping(),
    Ping(nonce=2**40),
    Pong(nonce=7, executor="ex-1", incarnation=3, busy=1, queued=2),
    Cancel(id="c-1"),
    Ready(executor="ex-2", incarnation=1, tools=[SPEC, SPEC.model_copy(update={"name": "b"})], limits=Limits()),
    Heartbeat(),
    Heartbeat(executor="ex-2"),
    Bye(executor="ex-2", reason="shutdown"),
    Bye(executor="ex-2", reason="no", refused=True),
    Pong(nonce=3, error=ErrorInfo(kind="protocol", message="invalid ping message")),
    Status(),
    Report(role="broker", id="b-1", capacity=4, executors=[ExecutorStatus(executor="ex-2", tools=["a"])],
           tools=[ToolStats(name="a", calls=2, buckets=[1, 2])]),
]


def _frames(kind: str, body: Any) -> list[bytes]:
    return [VERSION, kind.encode(), msgpack.packb(body, use_bin_type=True)]


def _decode_error(frames: Any, **kw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        decode(frames, **kw)
    error = caught.value
    assert error.error.kind == "protocol"
    assert error.error.message == str(error)
    reply = error.result()
    assert (reply.ok, reply.id, reply.error) == (False, error.call_id or "", error.error)
    return error


# -- Round trips --------------------------------------------------------------------------------------


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", [pytest.param(m, id=f"{m.KIND}-{i}") for i, m in enumerate(SAMPLES)])
def test_every_message_round_trips(msg: Body) -> None:
    frames = encode(msg)
    assert frames[0] == VERSION
    assert frames[1] == msg.KIND.encode()
    assert len(frames) == 3
    decoded = decode(frames)
    assert type(decoded) is type(msg)
    assert decoded.model_dump() == msg.model_dump()  # a ToolSpec's private argument checker stays home


def test_frames_of_other_buffer_types_decode() -> None:
    frames = encode(SAMPLES[1])
    assert decode([bytearray(f) for f in frames]) == SAMPLES[1]
    assert decode([memoryview(f) for f in frames]) == SAMPLES[1]
    assert decode([zmq.Frame(f) for f in frames]) == SAMPLES[1]  # type: ignore[misc]
    assert decode(tuple(frames)) == SAMPLES[1]


def test_fields_at_their_default_are_left_out() -> None:
    assert msgpack.unpackb(encode(Call(tool="f", id="a"))[2]) == {"id": "a", "tool": "f"}
    assert msgpack.unpackb(encode(Ping())[2]) == {}


def test_tuples_travel_as_lists() -> None:
    call = Call(tool="f", args=[(1, (2, 3))], kwargs={"t": ()}, id="x")
    assert decode(encode(call)) == Call(tool="f", args=[[1, [2, 3]]], kwargs={"t": []}, id="x")


def test_non_finite_floats_cross_in_values() -> None:
    decoded = decode(encode(Result(id="r", ok=True, value=[math.nan, -math.inf])))
    assert isinstance(decoded, Result)
    assert math.isnan(decoded.value[0]) and decoded.value[1] == -math.inf


def test_value_at_the_depth_limit_crosses() -> None:
    value: Any = []
    for _ in range(MAX_DEPTH):
        value = [value]
    assert decode(encode(Result(id="r", ok=True, value=value))) == Result(id="r", ok=True, value=value)


# -- decode refuses -----------------------------------------------------------------------------------

GOOD_CALL = {"tool": "f", "id": "c-9"}
READY = {"executor": "e", "incarnation": 1, "tools": []}
FAILED = {"id": "r", "ok": False}

MALFORMED: list[tuple[str, Any, str]] = [
    # Frame count.
    ("no-frames", [], "expected 3 frames"),
    ("one-frame", [VERSION], "expected 3 frames"),
    ("two-frames", [VERSION, b"ping"], "expected 3 frames"),
    ("four-frames", [b"identity", VERSION, b"ping", b"\x80"], "expected 3 frames"),
    ("not-a-sequence", None, "malformed"),
    ("an-int", 5, "malformed"),
    ("str-frames", ["ciayn/1", "ping", "\x80"], "must be bytes"),
    ("int-frame", [VERSION, b"ping", 10**6], "must be bytes"),
    ("none-frame", [VERSION, None, b"\x80"], "must be bytes"),
    # Version and kind.
    ("wrong-version", [b"ciayn/2", b"ping", b"\x80"], "unsupported protocol version"),
    ("empty-version", [b"", b"ping", b"\x80"], "unsupported protocol version"),
    ("upper-case-version", [b"CIAYN/1", b"ping", b"\x80"], "unsupported protocol version"),
    ("unknown-kind", [VERSION, b"exec", b"\x80"], "unknown message kind"),
    ("empty-kind", [VERSION, b"", b"\x80"], "unknown message kind"),
    ("upper-case-kind", [VERSION, b"Call", b"\x80"], "unknown message kind"),
    ("huge-kind", [VERSION, b"call" * 1000, b"\x80"], "unknown message kind"),
    ("base-kind", [VERSION, b"body", b"\x80"], "unknown message kind"),
    # Not msgpack, not a map.
    ("empty-body", [VERSION, b"ping", b""], "not valid msgpack"),
    ("reserved-byte", [VERSION, b"ping", b"\xc1"], "not valid msgpack"),
    ("truncated-map", [VERSION, b"ping", b"\x82\xa5nonce"], "not valid msgpack"),
    ("extra-data", [VERSION, b"ping", b"\x80\x80"], "not valid msgpack"),
    ("huge-claimed-array", [VERSION, b"call", b"\xdd\xff\xff\xff\xff"], "not valid msgpack"),
    ("deep-array-bomb", [VERSION, b"call", b"\x91" * 100_000], "not valid msgpack"),
    ("list-body", _frames("call", ["f", [], {}]), "must be a map"),
    ("str-body", _frames("ping", "nonce"), "must be a map"),
    ("nil-body", _frames("ping", None), "must be a map"),
    ("int-body", _frames("ping", 1), "must be a map"),
    # Non-str keys.
    ("int-key", _frames("call", {1: "f"}), "not valid msgpack"),
    ("bytes-key", _frames("call", {b"tool": "f"}), "keys must be str"),
    ("nested-int-key", _frames("call", {**GOOD_CALL, "kwargs": {"a": {1: 2}}}), "not valid msgpack"),
    ("nested-bytes-key", _frames("call", {**GOOD_CALL, "kwargs": {"a": {b"k": 2}}}), "keys must be str"),
    ("bytes-kwarg-name", _frames("call", {**GOOD_CALL, "kwargs": {b"k": 2}}), "keys must be str"),
    ("bytes-key-in-value", _frames("result", {"id": "r", "ok": True, "value": [{b"k": 1}]}), "keys must be str"),
    (
        "bytes-key-in-tool-schema",
        _frames(
            "welcome",
            {
                "executor": "e",
                "incarnation": 1,
                "tools": [{"name": "t", "signature": "()", "parameters": {"properties": {b"x": {}}}}],
                "limits": {},
            },
        ),
        "keys must be str",
    ),
    # Values that may not cross.
    ("ext-type-arg", _frames("call", {**GOOD_CALL, "args": [msgpack.ExtType(5, b"x")]}), "max_ext_len"),
    ("timestamp-value", _frames("result", {"id": "r", "ok": True, "value": msgpack.Timestamp(1, 0)}), "max_ext_len"),
    ("ext-type-string-field", _frames("hello", {"client": msgpack.ExtType(1, b"")}), "extension types"),
    # Wrong field types (strict: no coercion).
    ("tool-not-str", _frames("call", {"tool": 1, "id": "c-9"}), "tool"),
    ("tool-missing", _frames("call", {"id": "c-9"}), "tool"),
    ("args-not-list", _frames("call", {**GOOD_CALL, "args": "abc"}), "args"),
    ("kwargs-not-map", _frames("call", {**GOOD_CALL, "kwargs": [1]}), "kwargs"),
    ("id-not-str", _frames("call", {"tool": "f", "id": 5}), "id"),
    ("timeout-str-and-no-id", _frames("call", {"tool": "f", "timeout": "5"}), "timeout"),
    ("empty-id", _frames("call", {"tool": "f", "id": ""}), "id"),
    ("id-with-space", _frames("call", {"tool": "f", "id": "a b"}), "id"),
    ("id-with-newline", _frames("call", {"tool": "f", "id": "a\nINFO forged"}), "id"),
    ("id-too-long", _frames("call", {"tool": "f", "id": "x" * 129}), "id"),
    ("empty-tool", _frames("call", {"tool": "", "id": "c"}), "tool"),
    ("cancel-without-id", _frames("cancel", {}), "id"),
    ("negative-nonce", _frames("ping", {"nonce": -1}), "nonce"),
    ("repeated-key", [VERSION, b"ping", b"\x82\xa5nonce\x01\xa5nonce\x02"], "repeats a key"),
    ("ok-str", _frames("result", {"id": "r", "ok": "yes"}), "ok"),
    ("ok-int", _frames("result", {"id": "r", "ok": 1}), "ok"),
    ("ok-missing", _frames("result", {"id": "r"}), "ok"),
    ("error-kind-unknown", _frames("result", {**FAILED, "error": {"kind": "oops", "message": "m"}}), "error.kind"),
    ("signal-kind-unknown", _frames("result", {"id": "r", "ok": True, "signals": [{"kind": "rm -rf"}]}), "kind"),
    ("nonce-str", _frames("ping", {"nonce": "1"}), "nonce"),
    ("nonce-float", _frames("ping", {"nonce": 1.5}), "nonce"),
    ("nonce-bool", _frames("ping", {"nonce": True}), "nonce"),
    ("tools-not-list", _frames("welcome", {"executor": "e", "incarnation": 1, "tools": {}, "limits": {}}), "tools"),
    ("memory-str", _frames("ready", {**READY, "limits": {"memory_mb": "1"}}), "limits.memory_mb"),
    ("str-as-bytes", _frames("hello", {"client": b"ctl"}), "client"),
    # Unknown fields are ignored, but must still be values.
    ("bad-value-in-unknown-field", _frames("call", {**GOOD_CALL, "future": [{b"k": 1}]}), "keys must be str"),
]


@pytest.mark.parametrize(("frames", "mention"), [pytest.param(f, m, id=i) for i, f, m in MALFORMED])
def test_decode_refuses_malformed_messages(frames: Any, mention: str) -> None:
    error = _decode_error(frames)
    assert mention in str(error)


def test_decode_refuses_values_nested_too_deep() -> None:
    value: Any = []
    for _ in range(MAX_DEPTH + 1):
        value = [value]
    error = _decode_error(_frames("call", {**GOOD_CALL, "args": value}))
    assert "deeper than" in str(error)
    assert error.call_id == "c-9"


def test_decode_refuses_an_oversized_body_before_unpacking() -> None:
    frames = encode(Result(id="r", ok=True, stdout="x" * 1000))
    error = _decode_error(frames, max_bytes=100)
    assert "over the 100-byte limit" in str(error)
    assert decode(frames, max_bytes=len(frames[2])) == Result(id="r", ok=True, stdout="x" * 1000)
    assert MAX_FRAME_BYTES == 64 * 1024 * 1024


@pytest.mark.parametrize(
    ("body", "call_id"),
    [
        pytest.param({"id": "c-7", "tool": 5}, "c-7", id="bad-tool"),
        pytest.param({"id": "c-7", "tool": "f", "args": [{1: 2}]}, "c-7", id="int-key-deep-in-args"),
        pytest.param({"id": "c-7", "tool": "f", "args": [[[]] * 70_000]}, "c-7", id="over-the-budget"),
        pytest.param({"id": "c-7", "tool": "f", "args": [msgpack.ExtType(1, b"")]}, "c-7", id="ext-type"),
        pytest.param({"tool": ["f"], "id": "c-7"}, "c-7", id="id-after-a-bad-field"),
        pytest.param({"id": "c-7", "tool": "f", "args": [{b"k": 1}]}, "c-7", id="bad-value"),
        pytest.param({"id": 7, "tool": "f"}, None, id="id-not-str"),
        pytest.param({"tool": 5}, None, id="no-id"),
    ],
)
def test_protocol_error_carries_the_call_id_when_readable(body: dict[Any, Any], call_id: str | None) -> None:
    error = _decode_error(_frames("call", body))
    assert error.call_id == call_id
    assert error.result().id == (call_id or "")


def test_no_call_id_from_an_unreadable_body() -> None:
    assert _decode_error([VERSION, b"call", b"\xc1"]).call_id is None


# -- encode refuses -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("msg", "where"),
    [
        pytest.param(Call(tool="f", args=[{1, 2}], id="c"), "args[0] is a set", id="set"),
        pytest.param(Call(tool="f", args=[frozenset()], id="c"), "args[0] is a frozenset", id="frozenset"),
        pytest.param(Call(tool="f", args=[1j], id="c"), "args[0] is a complex", id="complex"),
        pytest.param(Call(tool="f", args=[2**64], id="c"), "outside 64 bits", id="int-over-64-bits"),
        pytest.param(Call(tool="f", args=[INT_MIN - 1], id="c"), "outside 64 bits", id="int-under-64-bits"),
        pytest.param(Call(tool="f", kwargs={"n": [2**100]}, id="c"), "kwargs['n'][0]", id="nested-huge-int"),
        pytest.param(Call(tool="f", args=[object()], id="c"), "object", id="object"),
        pytest.param(Call(tool="f", args=[Path("x")], id="c"), "PosixPath", id="path"),
        pytest.param(Call(tool="f", args=[date(2020, 1, 1)], id="c"), "date", id="date"),
        pytest.param(Call(tool="f", args=[bytearray(b"x")], id="c"), "bytearray", id="bytearray"),
        pytest.param(Call(tool="f", kwargs={"a": {1: "x"}}, id="c"), "int key", id="int-key"),
        pytest.param(Call(tool="f", kwargs={"a": {b"k": "x"}}, id="c"), "bytes key", id="bytes-key"),
        pytest.param(Result(id="c", ok=True, value={(1, 2): 1}), "tuple key", id="tuple-key"),
        pytest.param(Result(id="c", ok=True, value=[1, {"a": {2.5}}]), "value[1]['a']", id="nested-set"),
    ],
)
def test_encode_refuses_values_that_cannot_cross(msg: Body, where: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        encode(msg)
    assert where in str(caught.value)
    assert caught.value.call_id == "c"
    assert caught.value.error.kind == "protocol"


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic warns about the int key it serialises
def test_encode_refuses_a_non_str_key_in_a_tool_schema() -> None:
    """Otherwise the receiver would refuse a message the sender thought fine."""
    bad = SPEC.model_copy(update={"parameters": {"properties": {1: {}}}})
    with pytest.raises(ProtocolError) as caught:
        encode(Welcome(executor="e", incarnation=1, tools=[bad], limits=Limits()))
    assert "keys must be str" in str(caught.value)


def test_encode_refuses_an_oversized_message() -> None:
    with pytest.raises(ProtocolError) as caught:
        encode(Result(id="r", ok=True, stdout="x" * 1000), max_bytes=100)
    assert "over the 100-byte limit" in str(caught.value)
    assert caught.value.call_id == "r"


# -- Properties ---------------------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=INT_MIN, max_value=INT_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n) and not n.endswith("__")
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(VALUES, max_size=3), st.dictionaries(NAMES, VALUES, max_size=3))
def test_any_grammar_value_round_trips_from_text_to_the_wire(args: list[Any], kwargs: dict[str, Any]) -> None:
    text = "tool_x(" + ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]) + ")"
    call = parse_call(text)
    assert (call.tool, call.args, call.kwargs) == ("tool_x", args, kwargs)
    sent = call.model_copy(update={"id": "id-1"})
    assert decode(encode(sent)) == sent


@settings(max_examples=100, deadline=None)
@given(VALUES)
def test_any_value_round_trips_as_a_result(value: Any) -> None:
    msg = Result(id="r", ok=True, value=value)
    assert decode(encode(msg)) == msg


KINDS = st.sampled_from([k.encode() for k in BY_KIND])
FIELD_NAMES = sorted({name for m in MESSAGE_TYPES for name in m.model_fields} | {"KIND", "x"})
WIRE_VALUES = st.recursive(
    SCALARS | st.integers() | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4) | st.integers(), children, max_size=3),
    max_leaves=12,
)
FIELD_MAPS = st.dictionaries(st.sampled_from(FIELD_NAMES), WIRE_VALUES, max_size=6)


def _pack(value: Any) -> bytes:
    try:
        return bytes(msgpack.packb(value, use_bin_type=True))
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"


def _decode_only_raises_protocol_error(frames: Any) -> None:
    try:
        msg = decode(frames)
    except ProtocolError as e:
        assert e.error.kind in ("protocol", "bad_arguments")  # the latter: a call whose only fault is its timeout
    else:
        assert isinstance(msg, Body)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_random_frames_only_raise_protocol_error(frames: list[bytes]) -> None:
    _decode_only_raises_protocol_error(frames)


@settings(max_examples=300, deadline=None)
@given(KINDS, st.binary(max_size=200))
def test_random_bodies_only_raise_protocol_error(kind: bytes, body: bytes) -> None:
    _decode_only_raises_protocol_error([VERSION, kind, body])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(KINDS, FIELD_MAPS | WIRE_VALUES)
def test_random_msgpack_bodies_only_raise_protocol_error(kind: bytes, body: Any) -> None:
    _decode_only_raises_protocol_error([VERSION, kind, _pack(body)])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_valid_messages_only_raise_protocol_error(msg: Body, data: st.DataObject) -> None:
    body = bytearray(encode(msg)[2])
    for _ in range(data.draw(st.integers(1, 4))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del body[data.draw(st.integers(0, len(body))) :]
    _decode_only_raises_protocol_error([VERSION, msg.KIND.encode(), bytes(body)])


# -- Compatible evolution: a newer peer's message --------------------------------------------------------


def test_a_message_from_a_newer_peer_decodes_ignoring_fields_this_side_does_not_know() -> None:
    """Within ``ciayn/1`` a peer of a later release may add fields anywhere, top level or nested, and
    this side must still understand the rest (SPEC, Versioning)."""
    tool = {"name": "t", "signature": "(a)", "params": [{"name": "a", "since": "v1.2"}], "cost": "cheap"}
    welcome = _frames("welcome", {"executor": "e", "incarnation": 1, "tools": [tool],
                                  "limits": {"timeout_s": 5.0, "gpu_s": 3}, "region": "eu", "flags": [1, {"x": 2}]})
    msg = decode(welcome)
    assert isinstance(msg, Welcome)
    assert msg.tools[0].name == "t" and msg.tools[0].params[0].name == "a" and msg.limits.timeout_s == 5.0
    result = decode(_frames("result", {"id": "r", "ok": False, "trace_id": "abc",
                                       "error": {"kind": "timeout", "message": "m", "retry_after": 2},
                                       "worker": {"id": 0, "pid": 1, "incarnation": 1, "node": "n1"}}))
    assert isinstance(result, Result) and result.error is not None and result.error.kind == "timeout"
    call = decode(_frames("call", {"id": "c", "tool": "f", "priority": 3, "deadline_unix": 1.5e9}))
    assert call == Call(id="c", tool="f")
    assert decode(_frames("ping", {"nonce": 4, "sent_at": 1.0})) == Ping(nonce=4)


# -- Timeouts, ids, nonces: errors the sender can match ---------------------------------------------------


@pytest.mark.parametrize("timeout", [0, 0.0, -1.0, math.inf, -math.inf, math.nan, 86400.5, 1e300, "5", True])
def test_an_invalid_call_timeout_is_bad_arguments_naming_the_call(timeout: Any) -> None:
    error = _decode_error_any(_frames("call", {"id": "c-5", "tool": "f", "timeout": timeout}))
    assert error.error.kind == "bad_arguments" and "timeout" in str(error)
    assert error.reply() == Result(id="c-5", ok=False, error=error.error)


@pytest.mark.parametrize("timeout", [1, 0.001, 86400, 86400.0])
def test_a_valid_call_timeout_may_be_an_int_or_a_float(timeout: float) -> None:
    call = decode(_frames("call", {"id": "c-5", "tool": "f", "timeout": timeout}))
    assert isinstance(call, Call) and call.timeout == timeout


def test_a_malformed_ping_is_answered_with_a_pong_carrying_its_nonce_and_the_error() -> None:
    error = _decode_error(_frames("ping", {"nonce": 77, "extra": {b"bytes": 1}}))
    reply = error.reply()
    assert isinstance(reply, Pong) and reply.nonce == 77
    assert reply.error is not None and reply.error.kind == "protocol" and "keys must be str" in reply.error.message
    unreadable = _decode_error(_frames("ping", {"nonce": "seven"})).reply()
    assert isinstance(unreadable, Pong) and unreadable.nonce == 0 and unreadable.error is not None


def test_a_malformed_cancel_is_answered_without_the_calls_id() -> None:
    """The reply to a broken cancel must not look like the answer to the call it names."""
    error = _decode_error(_frames("cancel", {"id": "c-1", "extra": [{1: 2}]}))
    assert error.reply() == Result(id="", ok=False, error=error.error)


def test_an_unreadable_id_is_not_echoed() -> None:
    for bad in ("", "a b", "x" * 129, "é", "a\nb"):
        assert _decode_error(_frames("call", {"id": bad, "tool": 5})).call_id is None


def test_the_id_is_found_within_the_first_64_kib_whatever_follows() -> None:
    body = msgpack.packb({"id": "c-8", "tool": "f", "args": ["x" * 100_000]})
    error = _decode_error([VERSION, b"call", body[:-10]])  # truncated far from the id
    assert error.call_id == "c-8"
    late = msgpack.packb({"tool": "f", "args": ["x" * 100_000], "id": "c-8"})
    assert _decode_error([VERSION, b"call", late[:-1]]).call_id is None  # past PEEK_BYTES: not looked for


def test_a_call_without_an_id_encodes_but_is_refused_on_decode() -> None:
    """The client always sends an id; a call without one (another implementation's bug) is refused
    by the receiver, which has no id to answer with."""
    error = _decode_error(encode(Call(tool="f")))
    assert "must carry an id" in str(error) and error.call_id is None


def _decode_error_any(frames: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        decode(frames)
    return caught.value


# -- Work bounds: the element budget, on both sides --------------------------------------------------------


def _call_body_cost(n_args: int) -> int:
    """The budget a call {id, tool, args: [n ints]} spends (see protocol.values)."""
    return (CONTAINER_COST + 2 * 3) + (CONTAINER_COST + n_args)


def test_sender_and_receiver_agree_on_the_element_budget() -> None:
    n = MAX_ELEMENTS - _call_body_cost(0)
    assert _call_body_cost(n) == MAX_ELEMENTS
    at_limit = Call(id="c", tool="f", args=[0] * n)
    assert decode(encode(at_limit)) == at_limit
    with pytest.raises(ProtocolError, match="budget"):
        encode(Call(id="c", tool="f", args=[0] * (n + 1)))
    over = msgpack.packb({"id": "c", "tool": "f", "args": [0] * (n + 1)})
    assert "more than" in str(_decode_error([VERSION, b"call", over]))


@pytest.mark.parametrize("make", [pytest.param(m, id=k) for k, m in BOMBS.items()])
def test_a_body_built_to_cost_work_is_refused_quickly_in_bounded_memory(make: Any) -> None:
    frames = make()
    started = time.perf_counter()
    error = _decode_error(frames)
    took = time.perf_counter() - started
    assert error.call_id == "c-1"
    assert took < 1.5, f"decoding took {took:.2f} s"  # ~0.05 s on an idle core; 8-37 s before the budget
    tracemalloc.start()
    try:
        _decode_error(frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, f"decoding peaked at {peak / 1e6:.0f} MB"


# -- Properties: valid messages round-trip, random bytes only ever give protocol errors, quickly ----------

IDS = st.from_regex(r"[!-~]{1,128}", fullmatch=True)
SHORT = st.text(max_size=12)
FLOATS = st.floats(allow_nan=False, allow_infinity=False, width=64)
NATS = st.integers(min_value=0, max_value=2**31)
ERRORS = st.builds(ErrorInfo, kind=st.sampled_from(ERROR_KINDS), message=SHORT,
                   type=st.none() | SHORT, traceback=st.none() | SHORT, signal=st.none() | st.integers(1, 64))
LIMITS_ST = st.builds(Limits, timeout_s=st.floats(0.001, 86400), memory_mb=st.integers(1, 1 << 20),
                   max_output_kb=st.integers(1, 1 << 20), cpu_s=st.none() | st.floats(0.5, 1000))
PARAMS = st.builds(Param, name=NAMES, kind=st.sampled_from(
    ["positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"]),
    required=st.booleans())
SPECS = st.builds(ToolSpec, name=NAMES, signature=SHORT, doc=SHORT, params=st.lists(PARAMS, max_size=3),
                  parameters=st.dictionaries(SHORT, VALUES, max_size=2), bundleable=st.booleans(),
                  idempotent=st.booleans(), timeout=st.none() | st.floats(0.1, 100))
MESSAGES = st.one_of(
    st.builds(Call, id=IDS, tool=NAMES, args=st.lists(VALUES, max_size=3),
              kwargs=st.dictionaries(NAMES, VALUES, max_size=3), timeout=st.none() | st.floats(0.001, 86400)),
    st.builds(Result, id=IDS | st.just(""), ok=st.booleans(), value=VALUES, value_is_repr=st.booleans(),
              error=st.none() | ERRORS, stdout=SHORT, stderr=SHORT,
              signals=st.lists(st.builds(Signal, kind=st.sampled_from(["complete", "exit", "note"]), message=SHORT),
                               max_size=2),
              worker=st.none() | st.builds(WorkerInfo, id=NATS, pid=NATS, incarnation=NATS, restarted=st.booleans()),
              stats=st.none() | st.builds(Stats, wall_s=FLOATS, cpu_s=FLOATS, peak_rss_kb=NATS),
              limits=st.none() | LIMITS_ST, executor=st.none() | SHORT),
    st.builds(Hello, client=SHORT),
    st.builds(Welcome, executor=SHORT, incarnation=NATS, tools=st.lists(SPECS, max_size=2), limits=LIMITS_ST,
              workers=NATS, profile=SHORT),
    st.builds(Ping, nonce=st.integers(0, INT_MAX)),
    st.builds(Pong, nonce=st.integers(0, INT_MAX), executor=SHORT, incarnation=NATS, busy=NATS, queued=NATS,
              error=st.none() | ERRORS),
    st.builds(Cancel, id=IDS),
    st.builds(Ready, executor=SHORT, incarnation=NATS, tools=st.lists(SPECS, max_size=2), limits=LIMITS_ST,
              capacity=st.integers(1, 4096), held=st.lists(IDS, max_size=3)),
    st.builds(Heartbeat, executor=SHORT),
    st.builds(Bye, executor=SHORT, reason=SHORT, refused=st.booleans()),
    st.just(Status()),
    st.builds(Report, role=st.sampled_from(["executor", "broker"]), id=SHORT, served=NATS,
              executors=st.lists(st.builds(ExecutorStatus, executor=SHORT, tools=st.lists(SHORT, max_size=2)),
                                 max_size=2),
              tools=st.lists(st.builds(ToolStats, name=SHORT, calls=NATS, buckets=st.lists(NATS, max_size=3)),
                             max_size=2)),
)


def test_the_property_strategies_cover_every_message_type() -> None:
    seen: set[str] = set()

    @settings(max_examples=400, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(MESSAGES)
    def collect(msg: Body) -> None:
        seen.add(msg.KIND)

    collect()
    assert seen == set(BY_KIND)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(MESSAGES)
def test_any_valid_message_round_trips(msg: Body) -> None:
    decoded = decode(encode(msg))
    assert type(decoded) is type(msg)
    assert decoded.model_dump() == msg.model_dump()


@settings(max_examples=500, deadline=None)
@given(KINDS, st.binary(max_size=400))
def test_random_bytes_only_give_protocol_errors_quickly(kind: bytes, body: bytes) -> None:
    started = time.perf_counter()
    try:
        decode([VERSION, kind, body])
    except ProtocolError as e:
        assert e.error.kind in ("protocol", "bad_arguments")
        assert isinstance(e.reply(), Result | Pong)
    assert time.perf_counter() - started < 0.5


def test_unpack_bounds_any_untrusted_msgpack_the_same_way() -> None:
    """``protocol.values.unpack`` is the bounded unpacker for msgpack that is not a message body."""
    assert unpack(msgpack.packb({"ok": [1, 2]})) == {"ok": [1, 2]}
    for make in BOMBS.values():
        body = make()[2]
        started = time.perf_counter()
        with pytest.raises(ValueError):
            unpack(body)
        assert time.perf_counter() - started < 1.5
