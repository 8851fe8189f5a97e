"""Bodies built to cost a decoder work (issue 10): each a ``call`` message within the size cap whose
arguments are millions of tiny containers, repeated keys or deep nesting. ``protocol.decode`` must
refuse every one quickly and in bounded memory (tests/test_codec.py), and an executor must go on
serving while they arrive (tests/test_wire_endpoint.py)."""

from __future__ import annotations

from collections.abc import Callable

from protocol import VERSION


def _array(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def _call_with_args(args: bytes) -> list[bytes]:
    return [VERSION, b"call", b"\x83\xa2id\xa3c-1\xa4tool\xa1f\xa4args" + args]


BOMBS: dict[str, Callable[[], list[bytes]]] = {
    # The attacker's body: 16 M empty arrays inside the size cap (8-37 s and up to 4.9 GB before).
    "16M-empty-arrays": lambda: _call_with_args(_array(16_000_000, b"\x90")),
    "1000-arrays-of-16k-empty-arrays": lambda: _call_with_args(_array(1000, _array(16_000, b"\x90"))),
    "4000-arrays-of-4k-empty-maps": lambda: _call_with_args(_array(4000, _array(4000, b"\x80"))),
    "60-arrays-of-250k-short-strings": lambda: _call_with_args(_array(60, _array(250_000, b"\xa2ab"))),
    "100-maps-of-130k-repeated-keys": lambda: _call_with_args(
        _array(100, b"\xdf" + (130_000).to_bytes(4, "big") + b"\xa1a\x90" * 130_000)),
    "deep-nesting": lambda: _call_with_args(b"\x91" * 1_000_000),
}
