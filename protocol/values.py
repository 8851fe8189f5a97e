"""The one definition of a *data value* that may cross the wire, and of what it may cost.

A value is None, bool, int within 64 bits, float (finite or not), str, bytes, or a list/tuple/dict (str
keys) of values, nested at most ``MAX_DEPTH`` deep. Anything else (sets, complex numbers, huge ints,
objects, non-str keys) is refused at the boundary with a message that names where it was found.

A message also has a work budget, ``MAX_ELEMENTS``: every container costs one plus its number of
items, a map's keys and values both counting as items (``[1, [2]]`` costs 3 + 2 = 5; ``{"a": 1}``
costs 3). The sender counts while checking (``check_value``) and the receiver while unpacking
(``protocol.codec``), by the same rule, so neither side builds a message the other refuses, and no
body inside the byte cap can cost the receiver more than a bounded number of objects.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import CiaynError

MAX_DEPTH = 64  # containers below a field's own value: a field's value nests at most 65 containers
MAX_ELEMENTS = 256 * 1024  # what one message may cost (see above): bounds the receiver's work
CONTAINER_COST = 4  # what a container costs beyond its items: building one costs more than a scalar
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1


class ValueRefused(CiaynError, ValueError):
    """A value that msgpack (or this protocol) cannot carry."""


class ElementBudget:
    """What is left of one message's ``MAX_ELEMENTS``; ``take`` raises ``ValueRefused`` when spent."""

    __slots__ = ("left",)

    def __init__(self, limit: int = MAX_ELEMENTS) -> None:
        self.left = limit

    def take(self, n: int, where: str) -> None:
        self.left -= n
        if self.left < 0:
            raise ValueRefused(f"{where} takes the message over its budget of {MAX_ELEMENTS} elements")


def check_value(value: Any, where: str = "value", depth: int = 0, budget: ElementBudget | None = None) -> None:
    """Raise ``ValueRefused`` naming the first part of ``value`` that may not cross the wire, or the
    container that takes it over ``budget`` (one message's ``MAX_ELEMENTS`` when not given)."""
    if budget is None:
        budget = ElementBudget()
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
        budget.take(CONTAINER_COST + len(value), where)
        for i, item in enumerate(value):
            check_value(item, f"{where}[{i}]", depth + 1, budget)
        return
    if t is dict:
        budget.take(CONTAINER_COST + 2 * len(value), where)
        for key, item in value.items():
            if type(key) is not str:
                raise ValueRefused(f"{where} has a {type(key).__name__} key {repr(key)[:60]}; keys must be str")
            check_value(item, f"{where}[{key!r}]", depth + 1, budget)
        return
    raise ValueRefused(f"{where} is a {t.__name__}, which cannot cross the wire")
