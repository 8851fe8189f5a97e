"""Frames <-> messages. The only place that serialises or checks a message.

A message travels as three frames: ``[VERSION, kind, body]`` where ``body`` is the msgpack encoding of
the message's fields. A ROUTER socket adds its routing identity in front; the socket owner strips it
before calling ``decode``. ``decode`` trusts nothing and bounds its work as well as its input: the
body's bytes (``MAX_FRAME_BYTES``), each container's length, the elements of the whole body
(``MAX_ELEMENTS``, counted while unpacking, so a body of millions of empty arrays is refused after the
budget, not built), its nesting, its key types; no msgpack extension types; then the fields, strictly,
ignoring unknown ones (compatible evolution within ``ciayn/1``). Whatever is wrong, it raises
``ProtocolError`` and nothing else; the error already knows its reply (``reply()``), which carries the
call's id or the ping's nonce whenever the body holds a readable one, wherever else it is broken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
from pydantic import ValidationError

from protocol.errors import CiaynError
from protocol.messages import (
    BY_KIND,
    ID_PATTERN,
    MAX_TIMEOUT_S,
    Body,
    Call,
    ErrorInfo,
    ErrorKind,
    Message,
    Pong,
    Result,
)
from protocol.values import (
    CONTAINER_COST,
    INT_MAX,
    MAX_ELEMENTS,
    ElementBudget,
    ValueRefused,
    check_value,
    unpack,
)

VERSION = b"ciayn/1"
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a message body
MAX_KIND_BYTES = 32
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 4096  # a whole message: version, kind, body and a routing identity
# Sockets set ZMQ_MAXMSGSIZE (a per-frame limit libzmq enforces by dropping the connection) to this,
# above MAX_MESSAGE_BYTES, so that a body somewhat over the cap reaches ``decode`` and gets a
# ``protocol`` reply instead of a silent disconnect.
SOCKET_MAX_FRAME_BYTES = 2 * MAX_FRAME_BYTES
_KINDS = {k.encode(): k for k in BY_KIND}
_ID_KINDS = ("call", "result")  # a readable id in these is echoed (a cancel's reply never carries one)
_ID_CHARS = frozenset(range(0x21, 0x7F))


class ProtocolError(CiaynError, ValueError):
    """A message that could not be encoded or decoded. ``error`` is a ready ErrorInfo (kind
    ``protocol``, or ``bad_arguments`` for a call whose only fault is its timeout); ``call_id`` is the
    id of the offending call when it could be read; ``about`` the message kind when it was known and
    ``nonce`` a malformed ping's readable nonce."""

    def __init__(self, message: str, call_id: str | None = None, *, kind: ErrorKind = "protocol",
                 about: str = "", nonce: int | None = None) -> None:
        super().__init__(message)
        self.error = ErrorInfo(kind=kind, message=message)
        self.call_id = call_id
        self.about = about
        self.nonce = nonce

    def result(self) -> Result:
        """A ``result`` reply for this error (the id is "" when none could be read)."""
        return Result(id=self.call_id or "", ok=False, error=self.error)

    def reply(self) -> Result | Pong:
        """The reply a receiver sends back: a ``pong`` carrying the error for a malformed ping (so the
        pinger can match it), a ``result`` with the call's id for a malformed call, else a ``result``
        with id "" (so that it can never be taken for the answer to a call)."""
        if self.about == "ping":
            return Pong(nonce=self.nonce or 0, error=self.error)
        if self.about not in ("call", ""):
            return Result(id="", ok=False, error=self.error)
        return self.result()


def encode(msg: Body, *, max_bytes: int = MAX_FRAME_BYTES) -> list[bytes]:
    """Serialise a message. Values that may not cross (see ``protocol.values``), a body over the
    element budget or over ``max_bytes`` raise ``ProtocolError`` naming the field."""
    fields = msg.model_dump(mode="python", exclude_defaults=True)
    call_id = getattr(msg, "id", None) or None
    try:
        _check_fields(fields)
        body = msgpack.packb(fields, use_bin_type=True)
    except (ValueRefused, TypeError, OverflowError, ValueError) as e:
        raise ProtocolError(f"cannot encode {msg.KIND}: {e}", call_id, about=msg.KIND) from None
    if len(body) > max_bytes:
        raise ProtocolError(f"{msg.KIND} message is {len(body)} bytes, over the {max_bytes}-byte limit",
                            call_id, about=msg.KIND)
    return [VERSION, msg.KIND.encode(), body]


def _check_fields(fields: dict[Any, Any]) -> None:
    """Every field, not only the free-form ones: a non-str key or an odd type nested in, say, a tool's
    JSON Schema must fail here, on both sides, rather than slip past pydantic's ``Any``. One element
    budget for the whole body, counted as ``decode`` counts it."""
    budget = ElementBudget()
    budget.take(CONTAINER_COST + 2 * len(fields), "the body")
    for name, value in fields.items():
        if type(name) is not str:
            raise ValueRefused(f"the body has a {type(name).__name__} key {name!r}; keys must be str")
        check_value(value, name, 0, budget)


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


PEEK_BYTES = 64 * 1024  # where a receiver looks for the id of a body it cannot decode (senders put it first)
_STR_HEADERS = frozenset([*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB])
_UINT_HEADERS = frozenset([*range(0x00, 0x80), 0xCC, 0xCD, 0xCE, 0xCF])


def peek(body: bytes, field: str) -> Any:
    """The top-level ``field`` of a msgpack map, if it is a str or a non-negative int that starts within
    the first ``PEEK_BYTES`` of the body, else None. Read without building anything else (other values
    are skipped), so it works on a body that fails to decode for a reason elsewhere, at a bounded cost."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=PEEK_BYTES, max_ext_len=0,
                                    max_array_len=MAX_ELEMENTS, max_map_len=MAX_ELEMENTS // 2)
        unpacker.feed(body[:PEEK_BYTES])
        for _ in range(min(unpacker.read_map_header(), 64)):  # a valid body has a few fields
            key = unpacker.unpack() if body[unpacker.tell()] in _STR_HEADERS else unpacker.skip()
            if key != field:
                unpacker.skip()
                continue
            head = body[unpacker.tell()]
            return unpacker.unpack() if head in _STR_HEADERS or head in _UINT_HEADERS else None
    except Exception:  # a body broken before the field: there is nothing to read
        return None
    return None


def valid_id(value: Any) -> str | None:
    """``value`` if it is a well-formed call id (``ID_PATTERN``), else None: only those are echoed."""
    if type(value) is str and 0 < len(value) <= 128 and _ID_CHARS.issuperset(value.encode()):
        return value
    return None


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
        try:
            return _decode_body(kind, body, max_bytes)
        except ProtocolError as e:
            if kind in _ID_KINDS and e.call_id is None:
                e.call_id = valid_id(peek(body, "id"))
            elif kind == "ping":
                nonce = peek(body, "nonce")
                e.nonce = nonce if type(nonce) is int and 0 <= nonce <= INT_MAX else None
            e.about = kind
            raise
    except ProtocolError:
        raise
    except Exception as e:  # anything unforeseen still becomes a protocol error, never a crash
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from None


def _decode_body(kind: str, body: bytes, max_bytes: int) -> Message:
    if len(body) > max_bytes:
        raise ProtocolError(f"{kind} body is {len(body)} bytes, over the {max_bytes}-byte limit")
    try:
        fields = unpack(body)
    except ValueRefused as e:
        raise ProtocolError(f"{kind} body refused: {e}") from None
    except Exception as e:  # msgpack raises many types for malformed input
        raise ProtocolError(f"{kind} body is not valid msgpack: {type(e).__name__}: {e}"[:500]) from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"{kind} body must be a map, got {type(fields).__name__}")
    call_id = valid_id(fields.get("id")) if kind in _ID_KINDS else None
    try:
        msg = BY_KIND[kind].model_validate(fields, extra="ignore")
    except ValidationError as e:
        errors = e.errors(include_url=False)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in errors[:5]
        )
        if kind == "call" and call_id and all(err["loc"][:1] == ("timeout",) for err in errors):
            raise ProtocolError(f"invalid call timeout ({problems}); give a number of seconds in "
                                f"(0, {MAX_TIMEOUT_S:g}]", call_id, kind="bad_arguments") from None
        raise ProtocolError(f"invalid {kind} message: {problems}"[:2000], call_id) from None
    if isinstance(msg, Call) and not msg.id:
        raise ProtocolError(f"a call must carry an id ({ID_PATTERN})")
    return msg  # type: ignore[return-value]
