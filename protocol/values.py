"""The one definition of a *data value* that may cross the wire.

A value is None, bool, int within 64 bits, finite-or-not float, str, bytes, or a list/tuple/dict (str keys)
of values, nested at most ``MAX_DEPTH`` deep. Anything else (sets, complex numbers, huge ints, objects,
non-str keys) is refused at the boundary with a message that names where it was found.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1


class ValueRefused(ValueError):
    """A value that msgpack (or this protocol) cannot carry."""


def check_value(value: Any, where: str = "value", depth: int = 0) -> None:
    """Raise ``ValueRefused`` naming the first part of ``value`` that may not cross the wire."""
    if depth > MAX_DEPTH:
        raise ValueRefused(f"{where} is nested deeper than {MAX_DEPTH} levels")
    t = type(value)
    if value is None or t is bool or t is str or t is bytes or t is float:
        return
    if t is int:
        if not INT_MIN <= value <= INT_MAX:
            raise ValueRefused(f"{where} is an integer outside 64 bits")
        return
    if t is list or t is tuple:
        for i, item in enumerate(value):
            check_value(item, f"{where}[{i}]", depth + 1)
        return
    if t is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise ValueRefused(f"{where} has a {type(key).__name__} key {key!r}; keys must be str")
            check_value(item, f"{where}[{key!r}]", depth + 1)
        return
    raise ValueRefused(f"{where} is a {t.__name__}, which cannot cross the wire")
