"""Call fingerprints: when two calls are the same call.

Two notions, one canonical form of a value (``canonical``: maps with their keys sorted at every
depth, tuples as lists, every NaN one NaN; numbers keep their type, so ``1`` is not ``1.0``, ``'1'``
is not ``1`` and ``True`` is not ``1``):

- ``resend_key(call)``: the bytes a resend of a call id must match (SPEC.md section 8, "the same
  call"): the canonical msgpack encoding of ``[tool, args, kwargs, timeout]``. How a sender wrote
  its body does not matter (field and key order, an int's width, a float 32 or 64, a timeout of 5 or
  5.0); what the tool would see does. Executors and brokers compare these bytes (or a digest of
  them); the conformance vectors in ``protocol/vectors/resend.json`` fix them for other languages.
- ``fingerprint(call, spec)``: repeat detection in the controller (``no_repeat``), looser: given the
  tool's spec, positional-vs-keyword form and default values written out or left out do not matter
  either (``deploy("prod")`` is ``deploy(target="prod", count=1)`` when ``count`` defaults to 1).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from protocol.messages import Call
from protocol.spec import BindError, ToolSpec

_SCALARS = frozenset({str, bytes, int, bool, type(None)})


def canonical(value: Any) -> Any:
    """``value`` with dicts' keys sorted (msgpack keeps insertion order, so the bytes are stable; a
    dict stays a map, so ``{"a": 1}`` never matches the list ``[["a", 1]]``), tuples as lists and
    every NaN as the one quiet NaN. Python orders str keys by code point, which is the order of
    their UTF-8 bytes. A list of scalars only (the bulk of a large argument) is taken as it is."""
    kind = type(value)
    if kind is dict:
        return {k: canonical(value[k]) for k in sorted(value)}
    if kind is list or kind is tuple:
        if set(map(type, value)) <= _SCALARS:
            return value
        return [canonical(v) for v in value]
    if kind is float and math.isnan(value):
        return math.nan
    return value


def resend_key(call: Call) -> bytes:
    """The canonical encoding of what makes a call that call: its tool, arguments and timeout (a
    float, or nil). msgpack writes every int in its shortest form and every float as float 64."""
    timeout = None if call.timeout is None else float(call.timeout)
    packed: bytes = msgpack.packb([call.tool, canonical(call.args), canonical(call.kwargs), timeout],
                                  use_bin_type=True)
    return packed


def fingerprint(call: Call, spec: ToolSpec | None = None) -> str:
    """A stable hex digest of the call's tool and canonical arguments, for repeat detection."""
    if spec is not None:
        try:
            named: dict[str, Any] = {**spec.defaults(), **spec.bind(call.args, call.kwargs)}
            body: Any = [call.tool, canonical(named)]
        except BindError:
            body = [call.tool, canonical(call.args), canonical(call.kwargs)]
    else:
        body = [call.tool, canonical(call.args), canonical(call.kwargs)]
    packed = msgpack.packb(body, use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()
