"""The wire codec: every message round-trips, and ``decode`` refuses anything malformed with
``ProtocolError`` (kind ``protocol``) and nothing else; ``encode`` refuses values that may not cross."""

from __future__ import annotations

import keyword
import math
from datetime import date
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    MAX_FRAME_BYTES,
    VERSION,
    Body,
    Bye,
    Call,
    Cancel,
    ErrorInfo,
    Heartbeat,
    Hello,
    Limits,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Result,
    Signal,
    Stats,
    ToolSpec,
    Welcome,
    WorkerInfo,
    decode,
    encode,
    parse_call,
)
from protocol.messages import BY_KIND, MESSAGE_TYPES
from protocol.values import INT_MAX, INT_MIN, MAX_DEPTH


def read_file(path: str, start: int = 0) -> str:
    """Read a file."""
    return path


SPEC = ToolSpec.from_function(read_file, bundleable=True, idempotent=True, timeout=3.0)
LIMITS = Limits(timeout_s=5.0, cpu_s=4.0, memory_mb=256, max_output_kb=64, max_result_kb=128, open_files=32)

SAMPLES: list[Body] = [
    Call(tool="read_file"),
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
    assert decoded == msg


def test_frames_of_other_buffer_types_decode() -> None:
    frames = encode(SAMPLES[1])
    assert decode([bytearray(f) for f in frames]) == SAMPLES[1]
    assert decode([memoryview(f) for f in frames]) == SAMPLES[1]
    assert decode([zmq.Frame(f) for f in frames]) == SAMPLES[1]  # type: ignore[misc]
    assert decode(tuple(frames)) == SAMPLES[1]


def test_fields_at_their_default_are_left_out() -> None:
    assert msgpack.unpackb(encode(Call(tool="f"))[2]) == {"tool": "f"}
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
    ("ext-type-arg", _frames("call", {**GOOD_CALL, "args": [msgpack.ExtType(5, b"x")]}), "ExtType"),
    ("timestamp-value", _frames("result", {"id": "r", "ok": True, "value": msgpack.Timestamp(1, 0)}), "Timestamp"),
    ("ext-type-string-field", _frames("hello", {"client": msgpack.ExtType(1, b"")}), "ExtType"),
    # Wrong field types (strict: no coercion).
    ("tool-not-str", _frames("call", {"tool": 1, "id": "c-9"}), "tool"),
    ("tool-missing", _frames("call", {"id": "c-9"}), "tool"),
    ("args-not-list", _frames("call", {**GOOD_CALL, "args": "abc"}), "args"),
    ("kwargs-not-map", _frames("call", {**GOOD_CALL, "kwargs": [1]}), "kwargs"),
    ("id-not-str", _frames("call", {"tool": "f", "id": 5}), "id"),
    ("timeout-str", _frames("call", {**GOOD_CALL, "timeout": "5"}), "timeout"),
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
    # Unknown extra fields.
    ("extra-field", _frames("call", {**GOOD_CALL, "code": "import os"}), "code"),
    ("extra-nested-field", _frames("result", {**FAILED, "error": {"kind": "memory", "message": "", "x": 1}}), "x"),
    ("extra-field-on-empty-message", _frames("heartbeat", {"executor": "e", "exec": "x"}), "exec"),
    ("kind-field-smuggled", _frames("ping", {"KIND": "call"}), "KIND"),
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
        pytest.param({"id": "c-7", "tool": "f", "evil": 1}, "c-7", id="extra-field"),
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
        assert e.error.kind == "protocol"
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
