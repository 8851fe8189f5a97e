"""Tool modules -> a registry of named tools, and their specs. A tool is a function marked with
``@executor.tool(...)`` or listed in its module's ``__all__``; ``--tools`` names a dotted module or a
``.py`` file. ``find_tools`` imports the modules and finds the tools in plain Python (the template
runs it); ``describe`` builds each ``ToolSpec`` by reflection, which imports pydantic, so the
template runs it in a child that exits; ``load_tools`` does both here. A tool whose annotations do
not resolve is refused (``RegistryError``, naming the tool and the parameter); one without a
docstring loads with a warning. Why and how: docs/executor.md#the-registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import pathlib
import sys
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, overload

from protocol.errors import CiaynError
from protocol.values import MAX_NAME_CHARS, MAX_TOOLS, ValueRefused, check_value

if TYPE_CHECKING:
    from protocol import ToolSpec

log = logging.getLogger("ciayn.executor.registry")
F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__ciayn_tool__"


class RegistryError(CiaynError):
    """A tool module that cannot be loaded, or tools that clash; the message is for the operator."""


@overload
def tool(fn: F) -> F: ...
@overload
def tool(
    *,
    bundleable: bool = False,
    no_repeat: bool = False,
    idempotent: bool = False,
    timeout: float | None = None,
    name: str | None = None,
) -> Callable[[F], F]: ...
def tool(
    fn: Any = None,
    *,
    bundleable: bool = False,
    no_repeat: bool = False,
    idempotent: bool = False,
    timeout: float | None = None,
    name: str | None = None,
) -> Any:
    """Mark a function as a tool. ``timeout`` is the tool's default wall-clock limit in seconds."""

    def mark(f: F) -> F:
        setattr(
            f,
            _MARK,
            {
                "bundleable": bundleable,
                "no_repeat": no_repeat,
                "idempotent": idempotent,
                "timeout": timeout,
                "name": name,
            },
        )
        return f

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True)
class Tool:
    """A tool found in a module: the name calls give, the function, its module and ``@tool``'s flags
    (bundleable, no_repeat, idempotent, timeout); ``spec`` once described (``describe``)."""

    name: str
    fn: Callable[..., Any]
    module: str
    flags: dict[str, Any] = field(default_factory=dict)
    spec: ToolSpec | None = None


def load_module(target: str) -> Any:
    """Import a tool module by dotted name or by file path."""
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).resolve()
            if not path.is_file():
                raise RegistryError(f"tool module file {target!r} does not exist")
            mod_name = f"ciayn_tools_{path.stem}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise RegistryError(f"cannot load {target!r} as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except RegistryError:
        raise
    except BaseException as e:  # a tool module may do anything at import, even sys.exit
        raise RegistryError(f"tool module {target!r} failed to import: {type(e).__name__}: {e}") from None


def tools_of(module: Any) -> list[Tool]:
    """The tools a module offers: marked functions, plus undecorated public functions in ``__all__``."""
    found: dict[int, Tool] = {}
    exported = set(getattr(module, "__all__", ()))
    for attr, obj in vars(module).items():
        if not callable(obj) or not inspect.isfunction(obj):
            continue
        flags = getattr(obj, _MARK, None)
        if flags is None and attr not in exported:
            continue
        flags = dict(flags or {})
        tool_name = flags.pop("name", None) or obj.__name__
        if id(obj) in found:
            continue
        where = f"{module.__name__}.{attr}"
        if inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj) or inspect.isgeneratorfunction(obj):
            raise RegistryError(f"tool {where} is an async or generator function; tools must be plain "
                                "functions that return a value")
        if not isinstance(tool_name, str) or not 0 < len(tool_name) <= MAX_NAME_CHARS:
            raise RegistryError(f"tool {where}: its name must be a string of 1 to {MAX_NAME_CHARS} characters, "
                                f"as a call's tool name is, not {str(tool_name)[:80]!r}")
        found[id(obj)] = Tool(name=tool_name, fn=obj, module=module.__name__, flags=flags)
    return list(found.values())


def describe(t: Tool) -> ToolSpec:
    """``t``'s ``ToolSpec``, built by reflection (this imports pydantic: see the module's docstring
    for where that runs). Raises ``RegistryError`` for a definition that cannot be used."""
    from protocol.spec import ToolDefinitionError, ToolSpec

    where = f"{t.module}.{t.fn.__name__}"
    try:
        spec = ToolSpec.from_function(t.fn, name=t.name, **t.flags)
    except ToolDefinitionError as e:
        hint = "" if "cannot be announced" in str(e) else "; fix the annotation or import the type"
        raise RegistryError(f"{e} (in {where}){hint}") from None
    if not spec.doc:
        log.warning("tool %s (%s) has no docstring: the model sees only its signature; "
                    "add one that says what it does and returns", t.name, where)
    try:
        check_value(spec.model_dump(), f"the spec of tool {where}")
    except ValueRefused as e:  # e.g. a default value msgpack cannot carry
        raise RegistryError(f"{e}; give its parameters defaults that are plain data") from None
    return spec


_PLAIN_TYPES: frozenset[Any] = frozenset([str, int, float, bool, bytes, type(None), None, Any, object, list, dict,
                                          tuple, pathlib.Path, pathlib.PurePath])


def schema_checks_it(t: Tool) -> bool:
    """Whether the JSON Schema of ``t``'s parameters says all that their annotations check, so that
    the supervisor's check of the schema (``ToolSpec.check_arguments``) takes the decision pydantic
    would: every annotation built only of str, int, float, bool, bytes, None, Any, paths, literals
    of those, and lists, tuples, unions and str-keyed dicts of them. Anything else (``Annotated``
    constraints and validators, models, enums, other classes) may check more than its schema says:
    the tool's workers check its arguments with pydantic, as ``ToolSpec.bind`` does, and the
    template then maps pydantic, which such a tool module imports anyway."""
    try:
        hints = typing.get_type_hints(t.fn, include_extras=True)
    except Exception:  # an annotation that does not resolve: ``describe`` says which
        return False
    hints.pop("return", None)
    return all(_plain(hint) for hint in hints.values())


def _plain(hint: Any) -> bool:
    if hint in _PLAIN_TYPES:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return all(a is None or type(a) in (str, int, bool) for a in args)
    if origin in (list, tuple, Union, types.UnionType):
        return all(a is Ellipsis or _plain(a) for a in args)
    if origin is dict:
        return len(args) == 2 and args[0] is str and _plain(args[1])
    return False


def load_tools(targets: Iterable[str]) -> dict[str, Tool]:
    """``find_tools``, each tool described (``describe``: its ``spec`` set)."""
    return {name: replace(t, spec=describe(t)) for name, t in find_tools(targets).items()}


def find_tools(targets: Iterable[str]) -> dict[str, Tool]:
    """Import every module and return its tools by name, not described; a name offered twice is an
    error."""
    registry: dict[str, Tool] = {}
    for target in targets:
        for t in tools_of(load_module(target)):
            other = registry.get(t.name)
            if other is not None:
                raise RegistryError(
                    f"two tools are named {t.name!r}: one in {other.module}, one in {t.module}; "
                    "rename one (@tool(name=...)) or load only one of the modules"
                )
            registry[t.name] = t
    if not registry:
        raise RegistryError("no tools found: mark functions with @executor.tool or list them in __all__")
    if len(registry) > MAX_TOOLS:
        raise RegistryError(f"{len(registry)} tools found; an executor serves at most {MAX_TOOLS} (each goes into "
                            "every prompt): load fewer modules")
    return registry
