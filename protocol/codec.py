"""Frames <-> messages. The only place that serialises or checks a message.

A message travels as three frames: ``[VERSION, kind, body]`` where ``body`` is the msgpack encoding of
the message's fields. A ROUTER socket adds its routing identity in front; the socket owner strips it
before calling ``decode``. ``decode`` trusts nothing: it bounds sizes, checks the version and the kind,
refuses non-str map keys and validates the fields strictly. Whatever is wrong, it raises
``ProtocolError`` (carrying an ``ErrorInfo`` of kind ``protocol`` the receiver can send back) and
nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
from pydantic import ValidationError

from protocol.messages import BY_KIND, Body, ErrorInfo, Message, Result
from protocol.values import ValueRefused, check_value

VERSION = b"ciayn/1"
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a whole message body; sockets set ZMQ MAXMSGSIZE to this too
MAX_KIND_BYTES = 32
_KINDS = {k.encode(): k for k in BY_KIND}


class ProtocolError(ValueError):
    """A message that could not be encoded or decoded. ``error`` is a ready ``protocol`` ErrorInfo;
    ``call_id`` is the id of the offending call when it could be read."""

    def __init__(self, message: str, call_id: str | None = None) -> None:
        super().__init__(message)
        self.error = ErrorInfo(kind="protocol", message=message)
        self.call_id = call_id

    def result(self) -> Result:
        """The reply a receiver sends back for this error."""
        return Result(id=self.call_id or "", ok=False, error=self.error)


def encode(msg: Body, *, max_bytes: int = MAX_FRAME_BYTES) -> list[bytes]:
    """Serialise a message. Values msgpack cannot carry raise ``ProtocolError`` naming the field."""
    fields = msg.model_dump(mode="python", exclude_defaults=True)
    try:
        _check_fields(fields)
        body = msgpack.packb(fields, use_bin_type=True)
    except (ValueRefused, TypeError, OverflowError, ValueError) as e:
        raise ProtocolError(f"cannot encode {msg.KIND}: {e}", getattr(msg, "id", None)) from None
    if len(body) > max_bytes:
        raise ProtocolError(
            f"{msg.KIND} message is {len(body)} bytes, over the {max_bytes}-byte limit",
            getattr(msg, "id", None),
        )
    return [VERSION, msg.KIND.encode(), body]


def _check_fields(fields: dict[Any, Any]) -> None:
    """Every field, not only the free-form ones: a non-str key or an odd type nested in, say, a tool's
    JSON Schema must fail here, on both sides, rather than slip past pydantic's ``Any``."""
    for name, value in fields.items():
        if type(name) is not str:
            raise ValueRefused(f"the body has a {type(name).__name__} key {name!r}; keys must be str")
        check_value(value, name)


def _frame_bytes(frame: Any) -> bytes:
    """A frame's bytes: ``bytes``-like objects and ``zmq.Frame`` only (``bytes(n)`` of an int would
    allocate ``n`` zero bytes)."""
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, bytearray | memoryview):
        return bytes(frame)
    inner = getattr(frame, "bytes", None)  # zmq.Frame, without importing zmq here
    if isinstance(inner, bytes):
        return inner
    raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")


def decode(frames: Sequence[bytes | bytearray | memoryview], *, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse and validate one message; raise ``ProtocolError`` (only) if anything is wrong."""
    try:
        if len(frames) != 3:
            raise ProtocolError(f"expected 3 frames [version, kind, body], got {len(frames)}")
        version, kind_frame, body = (_frame_bytes(f) for f in frames)
        if version != VERSION:
            raise ProtocolError(
                f"unsupported protocol version {version[:32]!r}; this side speaks {VERSION.decode()}"
            )
        kind = _KINDS.get(kind_frame) if len(kind_frame) <= MAX_KIND_BYTES else None
        if kind is None:
            raise ProtocolError(f"unknown message kind {kind_frame[:MAX_KIND_BYTES]!r}")
        if len(body) > max_bytes:
            raise ProtocolError(f"{kind} body is {len(body)} bytes, over the {max_bytes}-byte limit")
        try:
            fields = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
        except Exception as e:  # msgpack raises many types for malformed input
            raise ProtocolError(f"{kind} body is not valid msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(fields, dict):
            raise ProtocolError(f"{kind} body must be a map, got {type(fields).__name__}")
        call_id = fields.get("id") if isinstance(fields.get("id"), str) else None
        try:
            _check_fields(fields)
        except ValueRefused as e:
            raise ProtocolError(f"{kind} carries a value that is not allowed: {e}", call_id) from None
        try:
            return BY_KIND[kind].model_validate(fields)  # type: ignore[return-value]
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5]
            )
            raise ProtocolError(f"invalid {kind} message: {problems}", call_id) from None
    except ProtocolError:
        raise
    except Exception as e:  # anything unforeseen still becomes a protocol error, never a crash
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from None
