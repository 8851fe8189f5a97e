"""Tool specifications: what a tool is called, what it takes, and how arguments bind to it.

Both sides build specs the same way (``ToolSpec.from_function``) and bind arguments the same way
(``ToolSpec.bind``), so a call the controller accepts is a call the executor accepts.
"""

from __future__ import annotations

import inspect
import json
import operator
import reprlib
import warnings
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, field_validator

from protocol.errors import BindError, CiaynError
from protocol.values import MAX_NAME_CHARS, MAX_TOOLS

__all__ = ["MAX_NAME_CHARS", "MAX_TOOLS", "BindError", "Param", "ToolDefinitionError", "ToolSpec"]

ParamKind = Literal["positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"]
_KINDS: dict[Any, ParamKind] = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}
NO_DOC = ""  # a tool without a docstring: the prompt shows its signature alone (the registry warns)
MAX_SHOWN_VALUE_CHARS = 60  # of a refused argument value, in a bad-arguments message
# What a tool's spec may take of every prompt it goes into (CIAYN's tool list, ReAct's tool schema):
# a hostile executor or broker announcing its tools must not fill the model's context.
MAX_SIGNATURE_CHARS = 4096
MAX_DOC_CHARS = 32768
MAX_SCHEMA_BYTES = 65536  # the parameters' JSON Schema, encoded
MAX_SCHEMA_DEPTH = 32


class ToolDefinitionError(CiaynError, ValueError):
    """A tool whose definition cannot be used (an annotation that does not resolve); the message names
    the tool and the parameter."""


class Param(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    kind: ParamKind = "positional_or_keyword"
    required: bool = True


class ToolSpec(BaseModel):
    """A tool as the controller (and the model) sees it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # as a call's ``tool`` may be
    signature: str = Field(max_length=MAX_SIGNATURE_CHARS)
    doc: str = Field(default=NO_DOC, max_length=MAX_DOC_CHARS)
    parameters: dict[str, Any] = Field(default_factory=dict)  # JSON Schema of the arguments
    params: list[Param] = Field(default_factory=list)
    bundleable: bool = False
    no_repeat: bool = False
    idempotent: bool = False
    timeout: float | None = None  # the tool's own default wall-clock limit
    # Checks argument values against the function's annotations. Set by ``from_function`` (where the
    # function is at hand: the executor), never sent: a spec decoded from the wire binds by name only.
    _arguments: Any = PrivateAttr(default=None)

    @field_validator("parameters")
    @classmethod
    def _bounded_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """At most MAX_SCHEMA_BYTES encoded, MAX_SCHEMA_DEPTH deep, every key a name's length."""
        _check_schema(schema, 0)
        size = len(json.dumps(schema, default=str))
        if size > MAX_SCHEMA_BYTES:
            raise ValueError(f"the parameters' schema takes {size} bytes, over {MAX_SCHEMA_BYTES}")
        return schema

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        bundleable: bool = False,
        no_repeat: bool = False,
        idempotent: bool = False,
        timeout: float | None = None,
        name: str | None = None,
    ) -> ToolSpec:
        tool_name = name or fn.__name__
        sig = _signature(fn, tool_name)
        too_long = [p for p in sig.parameters if len(p) > MAX_NAME_CHARS]
        if too_long:
            raise ToolDefinitionError(f"tool {tool_name!r}: parameter name {too_long[0][:40]}... is longer than "
                                      f"{MAX_NAME_CHARS} characters")
        params = [
            Param(name=p.name, kind=_KINDS[p.kind], required=p.default is inspect.Parameter.empty)
            for p in sig.parameters.values()
        ]
        for p in params:
            if p.kind.startswith("var_"):
                p.required = False
        model = _arguments_model(fn.__name__, sig)
        try:
            spec = cls(
                name=tool_name,
                signature=str(sig),
                doc=inspect.getdoc(fn) or NO_DOC,
                parameters=_json_schema(sig, model),
                params=params,
                bundleable=bundleable,
                no_repeat=no_repeat,
                idempotent=idempotent,
                timeout=timeout,
            )
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ToolDefinitionError(f"tool {tool_name!r} cannot be announced: {problems}") from None
        spec._arguments = model
        return spec

    def prompt_block(self) -> str:
        """The text a CIAYN prompt shows for this tool: ``name(signature)`` then the docstring (the
        signature alone when the tool has none)."""
        if not self.doc:
            return f"{self.name}{self.signature}"
        return f'{self.name}{self.signature}\n"""\n{self.doc}\n"""'

    def bind(self, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map ``args``/``kwargs`` onto parameter names, as Python would, or raise ``BindError``.

        Returns the arguments by name (a ``*args`` parameter gets a list, ``**kwargs`` a dict)."""
        bound: dict[str, Any] = {}
        positional = [p for p in self.params if p.kind in ("positional_only", "positional_or_keyword")]
        var_pos = next((p for p in self.params if p.kind == "var_positional"), None)
        var_kw = next((p for p in self.params if p.kind == "var_keyword"), None)
        for i, value in enumerate(args):
            if i < len(positional):
                bound[positional[i].name] = value
            elif var_pos is not None:
                bound.setdefault(var_pos.name, []).append(value)
            else:
                raise BindError(
                    f"{self.name}() takes {len(positional)} positional argument"
                    f"{'' if len(positional) == 1 else 's'} but {len(args)} were given"
                )
        by_name = {p.name: p for p in self.params if not p.kind.startswith("var_")}
        extra: dict[str, Any] = {}
        for key, value in kwargs.items():
            p = by_name.get(key)
            if p is None or p.kind == "positional_only":
                if var_kw is None:
                    raise BindError(f"{self.name}() got an unexpected argument {key!r}{self._expected()}")
                extra[key] = value
            elif key in bound:
                raise BindError(f"{self.name}() got multiple values for argument {key!r}")
            else:
                bound[key] = value
        if var_kw is not None and extra:
            bound[var_kw.name] = extra
        missing = [p.name for p in self.params if p.required and p.name not in bound]
        if missing:
            names = ", ".join(repr(m) for m in missing)
            raise BindError(
                f"{self.name}() is missing the required argument{'s' if len(missing) > 1 else ''} {names}"
            )
        if self._arguments is not None:
            self._check_types(bound)
        return bound

    def check_arguments(self, bound: dict[str, Any]) -> None:
        """Check bound argument values (``bind``'s result) against the annotations, or raise
        ``BindError`` naming the first bad parameter: with the pydantic model where the function was at
        hand (``from_function``: ``bind`` already did), else against ``parameters``, the JSON Schema
        a spec from the wire carries (the executor's supervisor: its tools' functions live in the
        template only). The schema is checked for the parts pydantic writes (``_SchemaCheck``),
        within a bound on the work, so that a schema a hostile tool module made costs the
        supervisor little."""
        if self._arguments is not None:
            self._check_types(bound)
            return
        properties = self.parameters.get("properties")
        if not isinstance(properties, dict):
            return
        check = _SchemaCheck(self.parameters)
        for p in self.params:
            if p.name in bound and not p.kind.startswith("var_") and p.name in properties:
                try:
                    problem = check.problem(properties[p.name], bound[p.name])
                except Exception:  # a schema it cannot read is not checked: never a crash of the supervisor
                    problem = None
                if problem is not None:
                    where, what, value = problem
                    path = "".join(f"[{_shown(part)}]" for part in where[:MAX_SCHEMA_DEPTH])
                    raise BindError(f"{self.name}() argument {p.name!r}{path}: {what}, got {_shown(value)}")

    def defaults(self) -> dict[str, Any]:
        """The default value of each optional named parameter, as the JSON Schema records it."""
        properties = self.parameters.get("properties") or {}
        return {
            p.name: properties[p.name]["default"]
            for p in self.params
            if not p.required and not p.kind.startswith("var_") and "default" in properties.get(p.name, {})
        }

    def _check_types(self, bound: dict[str, Any]) -> None:
        """Check named argument values against the annotations (pydantic, strict JSON rules: a string
        is not an int, a list may fill a tuple); a ``BindError`` names the first bad parameter."""
        named = {p.name for p in self.params if not p.kind.startswith("var_")}
        values = {k: v for k, v in bound.items() if k in named}
        try:
            text = json.dumps(values, default=_json_bytes)
        except (TypeError, ValueError):
            return  # not JSON-shaped (cannot come from the wire): nothing to compare
        try:
            self._arguments.model_validate_json(text, strict=True)
        except ValidationError as e:
            error = e.errors(include_url=False)[0]
            where = error.get("loc") or ("?",)
            param = str(where[0])
            path = "".join(f"[{part!r}]" for part in where[1:])
            shown = repr(_at(values, where))
            if len(shown) > MAX_SHOWN_VALUE_CHARS:
                shown = shown[: MAX_SHOWN_VALUE_CHARS - 3] + "..."
            raise BindError(
                f"{self.name}() argument {param!r}{path}: {error.get('msg', 'invalid value')}, got {shown}"
            ) from None

    def _expected(self) -> str:
        names = [p.name for p in self.params if not p.kind.startswith("var_")]
        return f"; its parameters are: {', '.join(names)}" if names else "; it takes no arguments"


def _signature(fn: Callable[..., Any], name: str) -> inspect.Signature:
    """The signature with string annotations resolved, so a tool module that uses
    ``from __future__ import annotations`` shows ``path: str`` (not ``path: 'str'``) and gets a typed
    schema. An annotation that does not resolve (``b: itn``) is a ``ToolDefinitionError`` naming the
    tool and the parameter: the model would otherwise be shown a type that does not exist."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception as e:
        raw = inspect.signature(fn)
        namespace = getattr(fn, "__globals__", {})
        for p in [*raw.parameters.values(), None]:
            annotation = raw.return_annotation if p is None else p.annotation
            if not isinstance(annotation, str):
                continue
            try:
                eval(annotation, dict(namespace))  # what inspect's eval_str does, one at a time
            except Exception as bad:
                what = "the return annotation" if p is None else f"the annotation of parameter {p.name!r}"
                raise ToolDefinitionError(
                    f"tool {name}: {what} ({annotation!r}) does not resolve: {type(bad).__name__}: {bad}"
                ) from None
        raise ToolDefinitionError(f"tool {name}: its annotations do not resolve: {type(e).__name__}: {e}") from None


def _arguments_model(fn_name: str, sig: inspect.Signature) -> Any:
    """A pydantic model of the named parameters (None if pydantic cannot map an annotation)."""
    fields: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = create_model(f"{fn_name}_args", **fields)
            model.model_json_schema()
    except Exception:
        return None
    return model


def _check_schema(node: Any, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the parameters' schema is nested deeper than {MAX_SCHEMA_DEPTH}")
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str) or len(key) > MAX_NAME_CHARS:
                raise ValueError(f"the parameters' schema has a key of over {MAX_NAME_CHARS} characters")
            _check_schema(value, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _check_schema(value, depth + 1)


def _json_schema(sig: inspect.Signature, model: Any) -> dict[str, Any]:
    """JSON Schema of a signature's named parameters (pydantic does the type mapping); untyped
    parameters when pydantic cannot map an annotation."""
    names = [
        p for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if model is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            schema: dict[str, Any] = model.model_json_schema()
    else:
        schema = {
            "type": "object",
            "properties": {p.name: {} for p in names},
            "required": [p.name for p in names if p.default is inspect.Parameter.empty],
        }
    schema.pop("title", None)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        schema["additionalProperties"] = True
    return schema


def _json_bytes(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("latin-1")
    raise TypeError(type(value).__name__)


def _at(values: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        try:
            values = values[part]
        except (KeyError, IndexError, TypeError):
            return values
    return values


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str, bytes), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "null": (type(None),), "array": (list, tuple), "object": (dict,),
}
_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "null": "null", "array": "a list", "object": "a map"}
_NULL = {"type": "null"}
_Problem = tuple[tuple[Any, ...], str, Any]  # where in the value, what is wrong, the bad part
SCHEMA_CHECK_STEPS = 100_000  # schema nodes visited per call at most; past it the rest goes unchecked
SCHEMA_REF_CHAIN = 32  # $refs followed in a row without going into the value
SCHEMA_CHECK_DEPTH = 256  # schema nodes nested in one check (anyOf, $ref, items...): far below Python's recursion limit


class _SchemaCheck:
    """The parts of JSON Schema that pydantic writes for annotations, checked the way pydantic's
    strict mode checks the JSON it came from (a bool is no number, bytes pass as a string, a list
    fills a tuple): ``type``, ``enum``, ``const``, ``anyOf``/``oneOf``/``allOf``, local ``$ref`` into
    ``$defs``, ``properties``/``required``/``additionalProperties``, ``items``/``prefixItems``/
    ``minItems``/``maxItems``, numeric bounds and string lengths. Everything else (``pattern``,
    ``format``) is not checked: a pattern would run a tool module's regular expression in the
    supervisor. Work and nesting are bounded (``SCHEMA_CHECK_STEPS``, ``SCHEMA_CHECK_DEPTH``): a
    schema that needs more leaves the rest unchecked, as an annotation pydantic cannot map always
    did."""

    def __init__(self, root: dict[str, Any]) -> None:
        defs = root.get("$defs")
        self.defs: dict[str, Any] = defs if isinstance(defs, dict) else {}
        self.steps = SCHEMA_CHECK_STEPS
        self.depth = 0
        self.enums: dict[int, frozenset[Any]] = {}  # id of an ``enum`` list -> its entries' keys (``_among``)

    def problem(self, schema: Any, value: Any, refs: int = 0) -> _Problem | None:
        """What is wrong with ``value`` (``_Problem``), or None when it passes (or goes unchecked)."""
        self.steps -= 1
        if self.steps < 0 or self.depth >= SCHEMA_CHECK_DEPTH or not isinstance(schema, dict):
            return None
        self.depth += 1
        try:
            return self._check(schema, value, refs)
        finally:
            self.depth -= 1

    def _check(self, schema: dict[str, Any], value: Any, refs: int) -> _Problem | None:
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self.defs.get(ref.removeprefix("#/$defs/")) if ref.startswith("#/$defs/") else None
            if target is not None and refs < SCHEMA_REF_CHAIN:
                found = self.problem(target, value, refs + 1)
                if found is not None:
                    return found
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                found = None
                for branch in branches:
                    found = self.problem(branch, value, refs)
                    if found is None:
                        break
                if found is not None:
                    self.steps -= len(branches)
                    # ``X | None`` given something that is not None: what is wrong with it as an X
                    left = [b for b in branches if value is None or b != _NULL]
                    return self.problem(left[0], value, refs) if len(left) == 1 else ((), _one_of(branches), value)
        all_of = schema.get("allOf")
        for branch in all_of if isinstance(all_of, list) else ():
            found = self.problem(branch, value, refs)
            if found is not None:
                return found
        return self._plain(schema, value)

    def _plain(self, schema: dict[str, Any], value: Any) -> _Problem | None:
        kinds = schema.get("type")
        names = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
        names = [n for n in names if isinstance(n, str)]
        if names and not any(_is(name, value) for name in names):
            return (), f"should be {' or '.join(_TYPE_WORDS.get(n, str(n)) for n in names)}", value
        if "const" in schema and not _same(value, schema["const"]):
            return (), f"should be {schema['const']!r}", value
        enum = schema.get("enum")
        if isinstance(enum, list) and not self._among(value, enum):
            return (), f"should be one of {', '.join(_shown(e) for e in enum[:10])}", value
        if type(value) in (int, float):
            return _bounds(schema, value)
        if isinstance(value, str | bytes):
            wrong = _size(schema, len(value), "minLength", "maxLength", "characters")
            return None if wrong is None else ((), wrong, value)
        if isinstance(value, list | tuple):
            return self._array(schema, value)
        if isinstance(value, dict):
            return self._object(schema, value)
        return None

    def _among(self, value: Any, enum: list[Any]) -> bool:
        """Whether ``value`` is one of ``enum`` (JSON equality). The entries are made a set once per
        check (their scan charged to the budget once), so a long list of values against a long
        ``Literal`` costs a lookup each; past the budget, or for entries that are no set's, it passes."""
        allowed = self.enums.get(id(enum))
        if allowed is None:
            if not self._afford(len(enum)):
                return True
            try:
                allowed = self.enums[id(enum)] = frozenset(_json_key(e) for e in enum)
            except TypeError:  # a list or a map among the entries: compared one by one
                return not self._afford(len(enum)) or any(_same(value, e) for e in enum)
        try:
            return _json_key(value) in allowed
        except TypeError:  # the value is a list or a map: no entry of a set of scalars is one
            return False

    def _afford(self, work: int) -> bool:
        """Charge ``work`` (the entries of one keyword scanned) to the budget; whether it is left."""
        self.steps -= work
        return self.steps >= 0

    def _array(self, schema: dict[str, Any], value: list[Any] | tuple[Any, ...]) -> _Problem | None:
        wrong = _size(schema, len(value), "minItems", "maxItems", "items")
        if wrong is not None:
            return (), wrong, value
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items")
        for i, item in enumerate(value):
            found = self._part(i, prefix[i] if i < len(prefix) else items, item, "is one item too many")
            if found is not None:
                return found
        return None

    def _object(self, schema: dict[str, Any], value: dict[str, Any]) -> _Problem | None:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        required = required if isinstance(required, list) and self._afford(len(required)) else ()
        for name in required:
            if isinstance(name, str) and name not in value:
                return (), f"is missing the key {_shown(name)}", value
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            found = self._part(key, properties.get(key, extra), item, "is not an accepted key")
            if found is not None:
                return found
        return None

    def _part(self, at: Any, schema: Any, item: Any, refused: str) -> _Problem | None:
        """What is wrong with the item at ``at`` of a list or map: ``refused`` where its schema is
        ``false`` (no item may be there), else its own problem, with ``at`` in front of where."""
        if schema is False:
            return (at,), refused, item
        found = self.problem(schema, item)
        return None if found is None else ((at, *found[0]), found[1], found[2])


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_SHOWN_VALUE_CHARS


def _shown(value: Any) -> str:
    """``repr(value)`` in at most ``MAX_SHOWN_VALUE_CHARS``, without building the whole of it first
    (an argument may be megabytes)."""
    shown = _REPR.repr(value)
    return shown if len(shown) <= MAX_SHOWN_VALUE_CHARS else shown[: MAX_SHOWN_VALUE_CHARS - 3] + "..."


def _is(name: str, value: Any) -> bool:
    kinds = _JSON_TYPES.get(name)
    return kinds is None or ((type(value) is not bool or name == "boolean") and isinstance(value, kinds))


def _json_key(value: Any) -> tuple[bool, Any]:
    """A key under which two values are equal as JSON values are (``true`` is not ``1``, ``1.0`` is
    ``1``, bytes are the string of their latin-1 characters, as ``_check_types`` sends them to
    pydantic): TypeError for an unhashable value."""
    key = (type(value) is bool, value.decode("latin-1") if type(value) is bytes else value)
    hash(key)
    return key


def _same(value: Any, expected: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, and ``1.0`` is ``1``."""
    return _json_key(value) == _json_key(expected) if _hashable(value) and _hashable(expected) else (
        (type(value) is bool) == (type(expected) is bool) and value == expected)


def _hashable(value: Any) -> bool:
    return type(value) in (str, bytes, int, float, bool, type(None))


def _one_of(branches: list[Any]) -> str:
    words = [_TYPE_WORDS.get(str(b.get("type")), "") if isinstance(b, dict) else "" for b in branches]
    return f"should be {' or '.join(words)}" if all(words) else "matches none of the types it may be"


def _size(schema: dict[str, Any], n: int, low_key: str, high_key: str, noun: str) -> str | None:
    low, high = schema.get(low_key), schema.get(high_key)
    low = low if type(low) is int else 0
    high = high if type(high) is int else None
    if low <= n and (high is None or n <= high):
        return None
    if high is None:
        return f"should have at least {low} {noun}"
    if low == high:
        return f"should have {low} {noun}"
    return f"should have {low} to {high} {noun}" if low else f"should have at most {high} {noun}"


_BOUNDS = (("minimum", ">=", operator.ge), ("maximum", "<=", operator.le), ("exclusiveMinimum", ">", operator.gt),
           ("exclusiveMaximum", "<", operator.lt))


def _bounds(schema: dict[str, Any], value: float) -> _Problem | None:
    for key, word, holds in _BOUNDS:
        bound = schema.get(key)
        if isinstance(bound, int | float) and type(bound) is not bool and not holds(value, bound):
            return (), f"should be {word} {bound}", value
    return None
