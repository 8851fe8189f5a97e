"""Call fingerprints for repeat detection.

Two calls have the same fingerprint when they name the same tool with the same arguments: keyword
order, quote style and (given the tool's spec) positional-vs-keyword form and default values written
out or left out do not matter (``deploy("prod")`` is ``deploy(target="prod", count=1)`` when ``count``
defaults to 1), but types do, so ``'1'`` differs from ``1`` and ``'True'`` from ``True``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from protocol.messages import Call
from protocol.spec import BindError, ToolSpec


def _canonical(value: Any) -> Any:
    """Dicts with sorted keys (msgpack keeps insertion order, so the bytes are stable; a dict stays
    a map, so ``{"a": 1}`` never matches the list ``[["a", 1]]``); tuples as lists."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def fingerprint(call: Call, spec: ToolSpec | None = None) -> str:
    """A stable hex digest of the call's tool and canonical arguments."""
    if spec is not None:
        try:
            named: dict[str, Any] = {**spec.defaults(), **spec.bind(call.args, call.kwargs)}
            body: Any = [call.tool, _canonical(named)]
        except BindError:
            body = [call.tool, _canonical(call.args), _canonical(call.kwargs)]
    else:
        body = [call.tool, _canonical(call.args), _canonical(call.kwargs)]
    packed = msgpack.packb(body, use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()
