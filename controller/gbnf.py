"""GBNF grammars that let a model write only valid CIAYN calls (llama.cpp grammar-constrained sampling).

``call_grammar(tools)`` returns a llama.cpp GBNF grammar that admits exactly one call of one of the
given tools, in the shape ``protocol.parse_call`` accepts: the bare tool name, ``(``, the tool's
arguments, ``)``. Positional-only parameters are written positionally, every other parameter as
``name=value`` in declaration order; required parameters must appear, optional ones may;
``*args``/``**kwargs`` are never filled. Each value is a Python literal: a double-quoted or
triple-quoted string, an int, a float, True/False/None, or a list or dict (string keys) of those,
nested at most ``MAX_DEPTH`` brackets deep. Where the tool's JSON Schema gives a parameter a type
(``string``, ``integer``, ``number``, ``boolean``, ``null``, ``array`` with ``items``, ``object`` with
``additionalProperties``, ``enum``/``const``, ``anyOf``/``oneOf``), the value is narrowed to it. A
``string`` with ``"not": {"enum": [...]}`` (or ``const``) admits any double-quoted string but those
(``controller.progress`` keeps calls that already failed out of the grammar that way), and one with
``minLength`` / ``maxLength`` a double-quoted string of that many characters (an escape counts as
the one character it stands for; ``MAX_STRING_CHARS`` at most).

The grammar is built as data first (``Grammar``: named rules over ``Lit``/``Chars``/``Seq``/``Alt``/
``Repeat``/``Ref``) and rendered to text last, so tests can walk the same rules to derive random
admitted texts and check each one with ``parse_call``. The rules never recurse (each nesting level has
its own rules), so every derivation ends and llama.cpp never meets left recursion.

What a context-free grammar cannot promise, and this one does not: distinct keys in a dict literal
(``parse_call`` rejects ``{"a": 1, "a": 2}``), and ``parse_call``'s whole-text caps (``MAX_CALL_CHARS``,
``MAX_ELEMENTS``), which the request's ``max_tokens`` keeps far away.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.spec import Param, ToolSpec

MAX_DEPTH = 3  # brackets a list/dict value may nest: [[[1]]] is the deepest
MAX_ITEMS = 16  # entries of one list or dict literal
MAX_STRING_CHARS = 256  # characters (or escapes) of a "double-quoted" string
# Characters (or escapes) of a """triple-quoted""" string. llama.cpp silently turns a repetition bound
# above 2000 (its MAX_REPETITION_THRESHOLD) into "unbounded", so this is the largest honest bound.
MAX_TEXT_CHARS = 2000
INT_DIGITS = 18  # 10**18 - 1 fits in a signed 64-bit int, which is what parse_call accepts
EXPONENT_DIGITS = 2  # 1e99 at most: a float literal can never overflow to inf
WS = " "  # the optional whitespace admitted after "(", around "=" and ",", and before ")"


# --- The rule representation ---------------------------------------------------------------------


@dataclass(frozen=True)
class Lit:
    """Exactly this text."""

    text: str


@dataclass(frozen=True)
class Chars:
    """One character in (or, when ``negated``, not in) the inclusive ranges ``(low, high)``."""

    ranges: tuple[tuple[str, str], ...]
    negated: bool = False

    def matches(self, char: str) -> bool:
        inside = any(lo <= char <= hi for lo, hi in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class Seq:
    """Each item in turn."""

    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Alt:
    """One of the options."""

    options: tuple[Expr, ...]


@dataclass(frozen=True)
class Repeat:
    """``item`` between ``low`` and ``high`` times (both bounds are finite)."""

    item: Expr
    low: int
    high: int


@dataclass(frozen=True)
class Ref:
    """The rule of this name."""

    name: str


Expr = Lit | Chars | Seq | Alt | Repeat | Ref


@dataclass
class Grammar:
    """Named rules; ``root`` is the start rule. ``to_gbnf()`` renders llama.cpp GBNF text."""

    rules: dict[str, Expr] = field(default_factory=dict)
    root: str = "root"

    def to_gbnf(self) -> str:
        return "".join(f"{name} ::= {_render(expr, top=True)}\n" for name, expr in self.rules.items())

    def __str__(self) -> str:
        return self.to_gbnf()


def seq(*items: Expr) -> Expr:
    """A sequence, flattened, without empty parts; a single item stands for itself."""
    flat: list[Expr] = []
    for item in items:
        if isinstance(item, Seq):
            flat.extend(item.items)
        elif not (isinstance(item, Lit) and not item.text):
            flat.append(item)
    merged: list[Expr] = []
    for item in flat:  # adjacent literals read better as one
        if merged and isinstance(item, Lit) and isinstance(merged[-1], Lit):
            merged[-1] = Lit(merged[-1].text + item.text)
        else:
            merged.append(item)
    if not merged:
        return Lit("")
    return merged[0] if len(merged) == 1 else Seq(tuple(merged))


def alt(*options: Expr) -> Expr:
    flat: list[Expr] = []
    for option in options:
        for o in option.options if isinstance(option, Alt) else (option,):
            if o not in flat:
                flat.append(o)
    return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def opt(item: Expr) -> Expr:
    return Repeat(item, 0, 1)


# --- Rendering ------------------------------------------------------------------------------------

_LIT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CLASS_ESCAPES = {"\\": "\\\\", '"': '\\"', "]": "\\]", "[": "\\[", "-": "\\-", "\n": "\\n", "\t": "\\t"}


def _char(c: str, escapes: Mapping[str, str]) -> str:
    if c in escapes:
        return escapes[c]
    code = ord(c)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02X}"
    if not c.isprintable():
        return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"
    return c


def _render(expr: Expr, top: bool = False) -> str:
    if isinstance(expr, Lit):
        return '"' + "".join(_char(c, _LIT_ESCAPES) for c in expr.text) + '"'
    if isinstance(expr, Chars):
        parts = []
        for lo, hi in expr.ranges:
            parts.append(_char(lo, _CLASS_ESCAPES) + ("" if lo == hi else "-" + _char(hi, _CLASS_ESCAPES)))
        body = "".join(parts)
        if not expr.negated and body.startswith("^"):
            body = "\\x5E" + body[1:]
        return "[" + ("^" if expr.negated else "") + body + "]"
    if isinstance(expr, Ref):
        return expr.name
    if isinstance(expr, Seq):
        text = " ".join(_render(item) for item in expr.items)
        return text if top else f"({text})"
    if isinstance(expr, Alt):
        text = " | ".join(_render(option, top=True) for option in expr.options)
        return text if top else f"({text})"
    item = _render(expr.item)
    if (expr.low, expr.high) == (0, 1):
        return item + "?"
    if expr.low == expr.high:
        return f"{item}{{{expr.low}}}"
    return f"{item}{{{expr.low},{expr.high}}}"


# --- Literal values -------------------------------------------------------------------------------

_STRING_SPECIAL = (('"', '"'), ("\\", "\\"), ("\x00", "\x1f"))  # what a short string spells with an escape
_HEX = Chars((("0", "9"), ("a", "f"), ("A", "F")))
_DIGIT = Chars((("0", "9"),))
_RULE_NAME = re.compile(r"[^A-Za-z0-9]+")
_SCALAR_RULES = {"string": "string", "integer": "int", "number": "number", "boolean": "bool"}


class _Builder:
    """Adds rules to a grammar on demand, so a grammar holds only what its tools can use."""

    def __init__(self) -> None:
        self.own: dict[str, Expr] = {}  # root, calls and parameters, in order
        self.shared: dict[str, Expr | None] = {}  # value rules, in order of first use
        self.named_types: dict[tuple[str, int], Ref] = {}

    def grammar(self) -> Grammar:
        rules = dict(self.own)
        for name, expr in self.shared.items():
            assert expr is not None, name
            rules[name] = expr
        return Grammar(rules)

    def name(self, hint: str) -> str:
        base = _RULE_NAME.sub("-", hint).strip("-").lower() or "rule"
        name, n = base, 2
        while name in self.own or name in self.shared or name in _SHARED_NAMES:
            name, n = f"{base}-{n}", n + 1
        return name

    # Shared rules are defined once, the first time something refers to them.
    def ref(self, name: str) -> Ref:
        if name not in self.shared:
            self.shared[name] = None  # reserve the slot: a rule comes before the rules it uses
            self.shared[name] = self._define(name)
        return Ref(name)

    def ws(self) -> Expr:
        return self.ref("ws")

    def sep(self) -> Expr:
        return seq(self.ws(), Lit(","), self.ws())

    def _define(self, name: str) -> Expr:
        level = _level_of(name)
        if name == "ws":
            return opt(Lit(WS))
        if name == "escape":
            surrogate_free = alt(
                seq(Chars((("0", "9"), ("a", "c"), ("A", "C"), ("e", "f"), ("E", "F"))), Repeat(_HEX, 3, 3)),
                seq(Chars((("d", "d"), ("D", "D"))), Chars((("0", "7"),)), Repeat(_HEX, 2, 2)),
            )
            return seq(
                Lit("\\"), alt(Chars((('"', '"'), ("\\", "\\"), ("n", "n"), ("t", "t"))), seq(Lit("u"), surrogate_free))
            )
        if name == "string":
            return alt(self.ref("short-string"), self.ref("long-string"))
        if name == "short-string":
            return seq(Lit('"'), Repeat(self.ref("str-char"), 0, MAX_STRING_CHARS), Lit('"'))
        if name == "str-char":
            return alt(Chars(_STRING_SPECIAL, negated=True), self.ref("escape"))
        if name == "long-string":
            return seq(Lit('"""'), Repeat(self.ref("text-item"), 0, MAX_TEXT_CHARS), Lit('"""'))
        if name == "text-item":
            # One or two quotes only when a non-quote follows: no """ can end the string early,
            # and the body never ends in a quote (which would merge with the closing """).
            tail = self.ref("text-tail")
            return alt(self.ref("text-char"), self.ref("escape"), seq(Lit('"'), tail), seq(Lit('""'), tail))
        if name == "text-tail":
            return alt(self.ref("text-char"), self.ref("escape"))
        if name == "text-char":
            return Chars((('"', '"'), ("\\", "\\"), ("\x00", "\x08"), ("\x0b", "\x1f")), negated=True)
        if name == "int":
            return seq(opt(Lit("-")), self._digits())
        if name == "float":
            exponent = seq(
                Chars((("e", "e"), ("E", "E"))),
                opt(Chars((("+", "+"), ("-", "-")))),
                Repeat(_DIGIT, 1, EXPONENT_DIGITS),
            )
            return seq(opt(Lit("-")), self._digits(), Lit("."), Repeat(_DIGIT, 1, INT_DIGITS), opt(exponent))
        if name == "number":
            return alt(self.ref("float"), self.ref("int"))
        if name == "bool":
            return alt(Lit("True"), Lit("False"))
        if name == "scalar":
            return alt(self.ref("string"), self.ref("number"), self.ref("bool"), Lit("None"))
        if name.startswith("value"):
            return alt(self.ref("scalar"), self.ref(_level_name("list", level)), self.ref(_level_name("dict", level)))
        if name.startswith("list"):
            return self._list(self.value_ref(level + 1))
        if name.startswith("dict"):
            return self._dict(self.value_ref(level + 1))
        raise AssertionError(f"no shared rule {name!r}")

    def _digits(self) -> Expr:
        return alt(Lit("0"), seq(Chars((("1", "9"),)), Repeat(_DIGIT, 0, INT_DIGITS - 1)))

    def _list(self, item: Expr) -> Expr:
        ws = self.ws()
        items = seq(item, Repeat(seq(self.sep(), item), 0, MAX_ITEMS - 1))
        return seq(Lit("["), ws, opt(seq(items, ws)), Lit("]"))

    def _dict(self, value: Expr) -> Expr:
        ws = self.ws()
        entry = seq(self.ref("short-string"), ws, Lit(":"), ws, value)
        entries = seq(entry, Repeat(seq(self.sep(), entry), 0, MAX_ITEMS - 1))
        return seq(Lit("{"), ws, opt(seq(entries, ws)), Lit("}"))

    def value_ref(self, level: int) -> Ref:
        """Any literal at nesting ``level`` (1 = an argument itself); containers only up to MAX_DEPTH."""
        return self.ref("scalar" if level > MAX_DEPTH else _level_name("value", level))

    def typed(self, schema: Any, level: int, hint: str) -> Expr:
        """A value rule narrowed to what ``schema`` allows, or any value where it says nothing usable."""
        key = (json.dumps(schema, sort_keys=True, default=str), level)
        if key in self.named_types:
            return self.named_types[key]
        expr = self._narrow(schema, level, hint)
        if expr is None:
            return self.value_ref(level)
        if isinstance(expr, Ref | Lit):
            return expr
        name = self.name(hint)
        self.own[name] = expr
        self.named_types[key] = Ref(name)
        return self.named_types[key]

    def _narrow(self, schema: Any, level: int, hint: str) -> Expr | None:
        if not isinstance(schema, Mapping):
            return None
        for word in ("enum", "const"):
            if word in schema:
                values = schema[word] if word == "enum" else [schema[word]]
                literals = [_python_literal(v) for v in values] if isinstance(values, list) else [None]
                if literals and all(lit is not None for lit in literals):
                    return alt(*(Lit(lit) for lit in literals if lit is not None))
        for word in ("anyOf", "oneOf"):
            if isinstance(schema.get(word), list) and schema[word]:
                branches = [self._narrow(s, level, f"{hint}-{i}") for i, s in enumerate(schema[word])]
                if any(b is None for b in branches):
                    return None
                return alt(*(b for b in branches if b is not None))
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            return self._narrow(schema["allOf"][0], level, hint)
        kinds = schema.get("type")
        if isinstance(kinds, list) and kinds:
            branches = [self._narrow({**schema, "type": k}, level, hint) for k in kinds]
            if any(b is None for b in branches):
                return None
            return alt(*(b for b in branches if b is not None))
        if kinds == "null":
            return Lit("None")
        if kinds == "string" and ("minLength" in schema or "maxLength" in schema or "not" in schema):
            low, high = _length_bounds(schema)
            excluded = _excluded_strings(schema["not"]) if isinstance(schema.get("not"), Mapping) else frozenset()
            if low > high:
                return None
            if excluded:
                rest = self._string_except("", excluded, low, high)
                return None if rest is None else seq(Lit('"'), rest)  # None: no string is left
            if (low, high) != (0, MAX_STRING_CHARS):
                return seq(Lit('"'), Repeat(self.ref("str-char"), low, high), Lit('"'))
        if kinds in _SCALAR_RULES:
            return self.ref(_SCALAR_RULES[kinds])
        if kinds == "array":
            if level > MAX_DEPTH:
                return Lit("[]")
            items = schema.get("items")
            if "prefixItems" in schema or not isinstance(items, Mapping) or not items:
                return self.ref(_level_name("list", level))
            return self._list(self.typed(items, level + 1, f"{hint}-item"))
        if kinds == "object":
            if level > MAX_DEPTH:
                return Lit("{}")
            values = schema.get("additionalProperties")
            if schema.get("properties") or not isinstance(values, Mapping) or not values:
                return self.ref(_level_name("dict", level))
            return self._dict(self.typed(values, level + 1, f"{hint}-value"))
        return None

    def _string_except(self, prefix: str, excluded: frozenset[str], low: int, high: int) -> Expr | None:
        """The rest of a double-quoted string (after ``"`` and ``prefix``) of ``low`` to ``high``
        characters whose value is none of ``excluded``: while the text follows one of them it is
        spelled in plain characters (no escape can spell an excluded value), and once it leaves them
        all, anything a string may hold. None when no such string exists."""
        depth = len(prefix)
        following = sorted({v[depth] for v in excluded if len(v) > depth and v.startswith(prefix)})
        options: list[Expr] = [] if prefix in excluded or depth < low else [Lit('"')]
        if depth < high:
            leave = Chars((*_STRING_SPECIAL, *((c, c) for c in following)), negated=True)
            free = Repeat(self.ref("str-char"), max(0, low - depth - 1), high - depth - 1)
            options.append(seq(leave, free, Lit('"')))
            for c in following:
                rest = self._string_except(prefix + c, excluded, low, high)
                if rest is not None:
                    options.append(seq(Lit(c), rest))
        return alt(*options) if options else None

    def call(self, tool: ToolSpec) -> Ref:
        """The rule for one call of ``tool``: ``name(`` arguments ``)``."""
        _check_callable_name(tool.name, f"tool name {tool.name!r}")
        rule = self.name(f"call-{tool.name}")
        self.own[rule] = Lit("")  # reserve the position: a call before its parameters
        ws = self.ws()
        by_position, must, keyword_items = self._parameters(tool)
        args = self._arguments(by_position, must, keyword_items)
        required_any = must > 0 or any(required for _, required in keyword_items)
        if args is None:
            body = seq(Lit(f"{tool.name}("), ws, Lit(")"))
        elif required_any:
            body = seq(Lit(f"{tool.name}("), ws, args, ws, Lit(")"))
        else:
            body = seq(Lit(f"{tool.name}("), ws, opt(seq(args, ws)), Lit(")"))
        self.own[rule] = body
        return Ref(rule)

    def _parameters(self, tool: ToolSpec) -> tuple[list[Expr], int, list[tuple[Expr, bool]]]:
        """The argument rules of ``tool``: the positional ones in order, how many of those must be
        given, and the keyword ones, each with whether it is required. Positional slots up to the last
        positional-only parameter are filled positionally, in order: slot k can only be given when
        every slot before it is. The rest go by keyword; ``*args``/``**kwargs`` are never filled."""
        properties = tool.parameters.get("properties", {}) if isinstance(tool.parameters, Mapping) else {}
        slots = [p for p in tool.params if p.kind in ("positional_only", "positional_or_keyword")]
        last_only = max((i for i, p in enumerate(slots) if p.kind == "positional_only"), default=-1)
        positional = slots[: last_only + 1]
        positional_names = {p.name for p in positional}
        must = max((i for i, p in enumerate(positional) if p.required), default=-1) + 1
        by_position = [self._argument(tool, properties, p, by_keyword=False) for p in positional]
        keyword_items: list[tuple[Expr, bool]] = []
        for p in tool.params:
            if p.name in positional_names or p.kind.startswith("var_"):
                continue
            if not _passable_by_keyword(p.name):
                if p.required:
                    raise ValueError(
                        f"Tool {tool.name!r} requires the parameter {p.name!r}, which cannot be written "
                        "as a keyword argument in a call."
                    )
                continue
            keyword_items.append((self._argument(tool, properties, p, by_keyword=True), p.required))
        return by_position, must, keyword_items

    def _argument(self, tool: ToolSpec, properties: Any, p: Param, by_keyword: bool) -> Expr:
        """The rule for one argument of ``tool``: its value narrowed to its schema in ``properties``,
        or (``by_keyword``) a rule of its own for ``name=value``."""
        hint = f"{tool.name}-{p.name}" if _IDENTIFIER.match(p.name) else f"{tool.name}-arg"
        schema = properties.get(p.name) if isinstance(properties, Mapping) else None
        if not by_keyword:
            return self.typed(schema, 1, hint)
        name = self.name(hint)
        self.own[name] = Lit("")  # reserve the name and the position: before its value's rules
        value = self.typed(schema, 1, f"{hint}-value")
        self.own[name] = seq(Lit(p.name), self.ws(), Lit("="), self.ws(), value)
        return Ref(name)

    def _arguments(self, by_position: list[Expr], must: int, keyword_items: list[tuple[Expr, bool]]) -> Expr | None:
        """The argument list: the first ``must`` positional values, each later one only after the one
        before it, then the keyword items in order (the required ones always), commas between; None
        when the tool takes no arguments."""
        sep = self.sep()

        def keyword_tail(i: int) -> list[Expr]:  # after something was written: each with its comma
            return [seq(sep, item) if required else opt(seq(sep, item)) for item, required in keyword_items[i:]]

        def keyword_head(i: int) -> Expr | None:  # nothing written yet: the first one has no comma
            if i == len(keyword_items):
                return None
            item, required = keyword_items[i]
            first = seq(item, *keyword_tail(i + 1))
            rest = None if required else keyword_head(i + 1)
            return first if rest is None else alt(first, rest)

        def optional_chain(k: int) -> list[Expr]:  # positional slots k.. (each needs the one before)
            if k >= len(by_position):
                return []
            return [opt(seq(sep, by_position[k], *optional_chain(k + 1)))]

        if must:
            return seq(
                by_position[0], *(seq(sep, v) for v in by_position[1:must]), *optional_chain(must), *keyword_tail(0)
            )
        if by_position:
            head = keyword_head(0)
            with_positional = seq(by_position[0], *optional_chain(1), *keyword_tail(0))
            return with_positional if head is None else alt(with_positional, head)
        return keyword_head(0)


_SHARED_NAMES = frozenset(
    {
        "root",
        "ws",
        "escape",
        "string",
        "short-string",
        "str-char",
        "long-string",
        "text-item",
        "text-tail",
        "text-char",
        "int",
        "float",
        "number",
        "bool",
        "scalar",
    }
    | {_n for level in range(1, MAX_DEPTH + 1) for _n in (f"value-{level}", f"list-{level}", f"dict-{level}")}
    | {"value", "list", "dict"}
)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _level_name(kind: str, level: int) -> str:
    return kind if level == 1 else f"{kind}-{level}"


def _level_of(name: str) -> int:
    head, _, tail = name.rpartition("-")
    return int(tail) if head in ("value", "list", "dict") and tail.isdigit() else 1


def _passable_by_keyword(name: str) -> bool:
    """Whether ``name=...`` is a keyword argument ``parse_call`` accepts."""
    return (
        bool(_IDENTIFIER.match(name))
        and not keyword.iskeyword(name)
        and not (name.startswith("__") or name.endswith("__"))
    )


def _check_callable_name(name: str, what: str) -> None:
    if not _passable_by_keyword(name):
        raise ValueError(
            f"The {what} cannot be called in a CIAYN call: it must be a plain ASCII "
            "identifier, not a Python keyword and not a dunder name."
        )


def _length_bounds(schema: Mapping[str, Any]) -> tuple[int, int]:
    """A string schema's ``minLength`` and ``maxLength``, within what a double-quoted literal holds."""
    low, high = schema.get("minLength", 0), schema.get("maxLength", MAX_STRING_CHARS)
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= 0 else MAX_STRING_CHARS
    return low, min(high, MAX_STRING_CHARS)


def _excluded_strings(schema: Mapping[str, Any]) -> frozenset[str]:
    """The strings a ``not`` schema names (``enum`` or ``const``) that a plain double-quoted literal
    spells without escapes; others cannot be kept out this way and are left admitted."""
    values = schema.get("enum") if "enum" in schema else [schema.get("const")]
    if not isinstance(values, list):
        return frozenset()
    return frozenset(
        v for v in values
        if isinstance(v, str) and len(v) <= MAX_STRING_CHARS and not any(c in '"\\' or c < " " for c in v)
    )


def _python_literal(value: Any) -> str | None:
    """The literal the grammar writes for an enum/const value, or None if it has none."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10**INT_DIGITS else None
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else None
    if isinstance(value, str) and "\x00" not in value:
        # JSON's escapes (\" \\ \n \t \b \f \r \uXXXX for controls) are Python's too.
        return json.dumps(value, ensure_ascii=False)
    return None


# --- Public API -----------------------------------------------------------------------------------


def call_rules(tools: Iterable[ToolSpec]) -> Grammar:
    """The grammar of one call of one of ``tools``, as rules (see ``call_grammar``)."""
    builder = _Builder()
    builder.own["root"] = Lit("")  # root comes first
    calls: list[Expr] = []
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"Two tools are named {tool.name!r}.")
        seen.add(tool.name)
        calls.append(builder.call(tool))
    if not calls:
        raise ValueError("A call grammar needs at least one tool.")
    builder.own["root"] = alt(*calls)
    return builder.grammar()


def call_grammar(tools: Sequence[ToolSpec]) -> str:
    """llama.cpp GBNF text admitting exactly one call of one of ``tools`` that ``parse_call`` accepts.

    Pass it as ``grammar`` in a llama.cpp (or llama-cpp-python server) completion request."""
    return call_rules(tools).to_gbnf()


def value_rules(schema: Mapping[str, Any] | None = None) -> Grammar:
    """The grammar of one literal value, narrowed to a JSON Schema where it is understood."""
    builder = _Builder()
    builder.own["root"] = Lit("")
    builder.own["root"] = builder.typed(dict(schema) if schema else {}, 1, "root-value")
    return builder.grammar()


def value_grammar(schema: Mapping[str, Any] | None = None) -> str:
    """llama.cpp GBNF text admitting one literal value (see ``value_rules``)."""
    return value_rules(schema).to_gbnf()
