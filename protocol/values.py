"""The one definition of a *data value* that may cross the wire, and of what it may cost.

A value is None, bool, int within 64 bits, float (finite or not), str, bytes, or a list/tuple/dict (str
keys) of values, nested at most ``MAX_DEPTH`` deep. Anything else (sets, complex numbers, huge ints,
objects, non-str keys) is refused at the boundary with a message that names where it was found.

A message also has a work budget, ``MAX_ELEMENTS``: every container costs one plus its number of
items, a map's keys and values both counting as items (``[1, [2]]`` costs 3 + 2 = 5; ``{"a": 1}``
costs 3). The sender counts while checking (``check_value``) and the receiver while unpacking
(``unpack``), by the same rule, so neither side builds a message the other refuses, and no
body inside the byte cap can cost the receiver more than a bounded number of objects.
"""

from __future__ import annotations

import gc
from itertools import repeat
from typing import Any

import msgpack

from protocol.errors import CiaynError

MAX_DEPTH = 64  # containers below a field's own value: a field's value nests at most 65 containers
MAX_ELEMENTS = 256 * 1024  # what one message may cost (see above): bounds the receiver's work
CONTAINER_COST = 4  # what a container costs beyond its items: building one costs more than a scalar
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
MAX_NAME_CHARS = 256  # tool, parameter, client, executor and profile names
MAX_TOOLS = 1024  # tools an executor, or a whole pool behind a broker, serves
MAX_BODY_DEPTH = MAX_DEPTH + 2  # containers, counting a message's body map and a field's own value


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


class _Unpacking:
    """The unpacker's hooks: count elements (``protocol.values``' rule) and nesting as each container
    is finished, refuse non-str keys, and stop the unpacker as soon as a bound is passed. A container
    is never longer than the budget (``max_*_len``), so what is built before the stop is bounded too."""

    __slots__ = ("height", "left")

    def __init__(self) -> None:
        self.left = MAX_ELEMENTS
        self.height: dict[int, int] = {}  # id() of each finished container -> containers nested in it

    def list_hook(self, items: list[Any]) -> list[Any]:
        self.left -= CONTAINER_COST + len(items)
        if self.left < 0:
            raise ValueRefused(f"the body costs more than {MAX_ELEMENTS} elements")
        height = max(map(self.height.get, map(id, items), repeat(0))) + 1 if items else 1
        if height > MAX_BODY_DEPTH:
            raise ValueRefused(f"the body nests containers deeper than {MAX_BODY_DEPTH} levels")
        self.height[id(items)] = height
        return items

    def pairs_hook(self, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
        self.left -= CONTAINER_COST + 2 * len(pairs)
        if self.left < 0:
            raise ValueRefused(f"the body costs more than {MAX_ELEMENTS} elements")
        mapping = dict(pairs)
        if len(mapping) != len(pairs):
            raise ValueRefused("a map repeats a key")
        if not _STR_ONLY.issuperset(map(type, mapping)):
            bad = next(k for k in mapping if type(k) is not str)
            raise ValueRefused(f"a map has a {type(bad).__name__} key {repr(bad)[:60]}; keys must be str")
        height = max(map(self.height.get, map(id, mapping.values()), repeat(0))) + 1 if pairs else 1
        if height > MAX_BODY_DEPTH:
            raise ValueRefused(f"the body nests containers deeper than {MAX_BODY_DEPTH} levels")
        self.height[id(mapping)] = height
        return mapping


_STR_ONLY = frozenset([str])


def _no_extensions(code: int, data: bytes) -> Any:
    raise ValueRefused(f"msgpack extension types are not allowed (found type {code})")


def unpack(body: bytes) -> Any:
    """msgpack ``body`` as a value, bounded in work: the element budget, nesting, str keys only, no
    extension types (``ValueRefused``, a ``ValueError``, when a bound is passed; msgpack's own
    exceptions for malformed input). For any msgpack an untrusted peer sends, not only message
    bodies (e.g. what a worker, which shares its process with tool code, replies)."""
    hooks = _Unpacking()
    collecting = gc.isenabled()
    gc.disable()  # the body builds up to MAX_ELEMENTS containers: no collections meanwhile
    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True,
            max_str_len=len(body), max_bin_len=len(body), max_ext_len=0,
            max_array_len=MAX_ELEMENTS, max_map_len=MAX_ELEMENTS // 2,
            list_hook=hooks.list_hook, object_pairs_hook=hooks.pairs_hook, ext_hook=_no_extensions,
        )
    finally:
        if collecting:
            gc.enable()
