"""Tool specifications: what a tool is called, what it takes, and how arguments bind to it.

Both sides build specs the same way (``ToolSpec.from_function``) and bind arguments the same way
(``ToolSpec.bind``), so a call the controller accepts is a call the executor accepts.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

ParamKind = Literal["positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"]
_KINDS: dict[Any, ParamKind] = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}
NO_DOC = "No docstring provided"


class BindError(ValueError):
    """Arguments that do not fit a tool's signature; the message names the parameter."""


class Param(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    kind: ParamKind = "positional_or_keyword"
    required: bool = True


class ToolSpec(BaseModel):
    """A tool as the controller (and the model) sees it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    signature: str
    doc: str = NO_DOC
    parameters: dict[str, Any] = Field(default_factory=dict)  # JSON Schema of the arguments
    params: list[Param] = Field(default_factory=list)
    bundleable: bool = False
    no_repeat: bool = False
    idempotent: bool = False
    timeout: float | None = None  # the tool's own default wall-clock limit

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
        sig = _signature(fn)
        params = [
            Param(name=p.name, kind=_KINDS[p.kind], required=p.default is inspect.Parameter.empty)
            for p in sig.parameters.values()
        ]
        for p in params:
            if p.kind.startswith("var_"):
                p.required = False
        return cls(
            name=name or fn.__name__,
            signature=str(sig),
            doc=inspect.getdoc(fn) or NO_DOC,
            parameters=_json_schema(fn.__name__, sig),
            params=params,
            bundleable=bundleable,
            no_repeat=no_repeat,
            idempotent=idempotent,
            timeout=timeout,
        )

    def prompt_block(self) -> str:
        """The text a CIAYN prompt shows for this tool: ``name(signature)`` then the docstring."""
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
        return bound

    def _expected(self) -> str:
        names = [p.name for p in self.params if not p.kind.startswith("var_")]
        return f"; its parameters are: {', '.join(names)}" if names else "; it takes no arguments"


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature with string annotations resolved, so a tool module that uses
    ``from __future__ import annotations`` shows ``path: str`` (not ``path: 'str'``) and gets a typed
    schema; as written when a name does not resolve."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:
        return inspect.signature(fn)


def _json_schema(fn_name: str, sig: inspect.Signature) -> dict[str, Any]:
    """JSON Schema of a signature's named parameters (pydantic does the type mapping)."""
    fields: dict[str, Any] = {}
    var_kw = False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
            continue
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = create_model(f"{fn_name}_args", **fields)
            schema: dict[str, Any] = model.model_json_schema()
    except Exception:  # an annotation pydantic cannot map: fall back to untyped parameters
        schema = {
            "type": "object",
            "properties": {name: {} for name in fields},
            "required": [n for n, (_, d) in fields.items() if d is ...],
        }
    schema.pop("title", None)
    if var_kw:
        schema["additionalProperties"] = True
    return schema
