"""The CIAYN call grammar: one line of model output -> a ``Call`` descriptor, never code.

The text is cleaned of the markup weak models wrap around calls (think blocks, markdown fences,
backticks), bounded in size and nesting, parsed with ``ast`` and then accepted only if it matches an
allowlist: one expression statement that calls a bare name with literal data arguments. Anything else
raises ``CallRejected``, whose message is written for the model: what was wrong and what to write.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from typing import Any

from protocol.errors import CiaynError
from protocol.messages import Call
from protocol.spec import BindError, ToolSpec
from protocol.values import INT_MAX, INT_MIN

MAX_CALL_CHARS = 512 * 1024  # a whole file passed to a write tool must fit
MAX_NESTING = 32  # brackets outside strings
MAX_ELEMENTS = 20_000  # literal nodes in one call
MAX_CALLS = 32  # calls in one bundle
MAX_SEPARATORS = 2 * MAX_ELEMENTS + MAX_CALLS  # commas, semicolons, line breaks outside strings
EXPECTED_SHAPE = 'Reply with exactly one call such as: tool_name(arg="value")'

_THINK_TAG = re.compile(r"<(/?)(?:think|thinking)>", re.IGNORECASE)
_FENCE = re.compile(r"^[ \t]*(```+|~~~+)[ \t]*([A-Za-z0-9_+\-.]*)[ \t]*$", re.MULTILINE)
_ONE_LINE_FENCE = re.compile(r"^(```+|~~~+)(.*?)(?:\1)?$", re.DOTALL)
# A one-line fence's language tag: any word followed by whitespace and then something shaped like a
# call (```json f()```); a call written with a space before "(" keeps its name (```f (1)``` stays).
_FENCE_LANGUAGE = re.compile(r"^[A-Za-z0-9_+\-.]+\s+(?=[A-Za-z_][A-Za-z0-9_]*\s*\()")
# Chat-template wrappers some servers leave around a reply (Qwen/Hermes tool-call tags, end tokens).
_WRAPPER_OPEN = re.compile(r"^\s*(?:<\|im_start\|>\s*assistant\s*|<tool_call>\s*)+", re.IGNORECASE)
_WRAPPER_CLOSE = re.compile(
    r"(?:\s*(?:</tool_call>|<\|im_end\|>|<\|eot_id\|>|<\|endoftext\|>|<\|end\|>|</s>))+\s*$", re.IGNORECASE
)
_STRAY_CLOSE = re.compile(r"\)\s*(?:```+|`)\s*$")  # a closing fence or backtick after the call's ")"
MAX_PROSE_CANDIDATES = 4  # lines tried as the start of a call after leading prose
_LINE_STARTS_LIKE_CALL = re.compile(r"^[ \t]*[A-Za-z_][A-Za-z0-9_]*\s*\(", re.MULTILINE)
# Strings and comments (what is inside them does not count), brackets and separators, for the bounds.
_SCAN = re.compile(  # strings as unrolled loops: linear, no ambiguous backtracking
    r"[rRbBuUfF]{0,2}(?:"
    r'"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*"""'
    r"|'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''"
    r'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"'
    r"|'[^'\\\n]*(?:\\.[^'\\\n]*)*')"
    r"|#[^\n]*|[(\[{]|[)\]}]|[,;\n]",
    re.DOTALL,
)
_STARTS_LIKE_CALL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\(")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

_NODE_WORDS: dict[type[ast.AST], str] = {
    ast.Name: "a variable name",
    ast.Attribute: "an attribute access",
    ast.Subscript: "a subscript",
    ast.Call: "a nested function call",
    ast.Lambda: "a lambda",
    ast.ListComp: "a list comprehension",
    ast.SetComp: "a set comprehension",
    ast.DictComp: "a dict comprehension",
    ast.GeneratorExp: "a generator expression",
    ast.BinOp: "an operator expression",
    ast.BoolOp: "a boolean expression",
    ast.Compare: "a comparison",
    ast.UnaryOp: "an operator expression",
    ast.IfExp: "a conditional expression",
    ast.NamedExpr: "an assignment expression (:=)",
    ast.Set: "a set",
    ast.Starred: "a starred expression",
    ast.JoinedStr: "an f-string with fields",
    ast.Await: "an await expression",
    ast.Yield: "a yield expression",
    ast.YieldFrom: "a yield expression",
    ast.Slice: "a slice",
}


class CallRejected(CiaynError, ValueError):
    """Model output that is not one valid call. ``str()`` is a message for the model.

    ``code`` is a short machine-readable reason (``syntax``, ``not_a_call``, ``callee``, ``argument``,
    ``too_large``, ``unknown_tool``, ``bad_arguments``, ``bundle``, ``empty``, ...)."""

    def __init__(self, message: str, code: str = "rejected", call_text: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.call_text = call_text


def _reject(what: str, code: str, hint: str = EXPECTED_SHAPE) -> CallRejected:
    return CallRejected(f"{what} {hint}", code)


def split_think(text: str) -> tuple[str, str]:
    """Split the reasoning a model wraps around its reply off it: ``(reply, reasoning)``.

    Removes ``<think>...</think>`` (or ``<thinking>``) blocks before and after the reply (each ends at
    its first close tag), everything from an unclosed leading open tag (the model is still
    thinking), and everything before a leading close tag that has no open tag (chat templates that
    open the block themselves). Only blocks at the edges go: a think tag inside a string argument
    is data. One pass over the tags, so many tags cost linear time."""
    tags = list(_THINK_TAG.finditer(text))
    if not tags:
        return text, ""
    thoughts: list[str] = []
    start, first = 0, 0  # text[start:] and tags[first:] are what remains
    if tags[0].group(1):  # a close tag with no open tag before it
        thoughts.append(text[: tags[0].start()])
        start, first = tags[0].end(), 1
    while first < len(tags):
        while start < len(text) and text[start].isspace():
            start += 1
        if tags[first].start() != start or tags[first].group(1):
            break
        close = next((i for i in range(first + 1, len(tags)) if tags[i].group(1)), None)
        if close is None:
            thoughts.append(text[tags[first].end() :])
            return "", _join(thoughts)
        thoughts.append(text[tags[first].end() : tags[close].start()])
        start, first = tags[close].end(), close + 1
    end, last = len(text), len(tags) - 1
    trailing: list[str] = []
    while last >= first:
        while end > start and text[end - 1].isspace():
            end -= 1
        if tags[last].end() != end or not tags[last].group(1):
            break
        opening = next((i for i in range(last - 1, first - 1, -1) if not tags[i].group(1)), None)
        if opening is None:
            break
        trailing.insert(0, text[tags[opening].end() : tags[last].start()])
        end, last = tags[opening].start(), opening - 1
    return text[start:end].strip(), _join(thoughts + trailing)


def _join(thoughts: list[str]) -> str:
    return "\n\n".join(t.strip() for t in thoughts if t.strip())


def _strip_think(text: str) -> str:
    return split_think(text)[0]


def strip_markup(text: str) -> str:
    """Remove think blocks, chat-template wrappers (``<tool_call>``, ``<|im_end|>``), markdown fences
    and backticks around a call, and a stray closing fence or backtick after it; normalise line ends."""
    text = _strip_think(text.replace("\r\n", "\n").replace("\r", "\n")).strip()
    text = _WRAPPER_CLOSE.sub("", _WRAPPER_OPEN.sub("", text, count=1), count=1).strip()
    if text.startswith(("```", "~~~")) or not _STARTS_LIKE_CALL.match(text):
        fences = list(_FENCE.finditer(text))
        if fences:
            # From the first fence line to the last one, so fences inside a string argument survive.
            start = fences[0].end() + 1
            end = fences[-1].start() if len(fences) > 1 else len(text)
            text = text[start:end].strip()
        elif text.startswith(("```", "~~~")):
            m = _ONE_LINE_FENCE.match(text)
            if m:
                text = _FENCE_LANGUAGE.sub("", m.group(2).strip(), count=1)
    if text.startswith("`") and not text.startswith("``"):
        text = text[1:-1] if text.endswith("`") and len(text) > 1 else text[1:]
        text = text.strip()
    stray = _STRAY_CLOSE.search(text)
    if stray is not None:
        text = text[: stray.start() + 1]
    return text


def _repair_triple_quotes(text: str) -> str | None:
    """RA.Aid's repair of file content holding unescaped triple quotes: when the first line opens a
    triple-quoted string and the last line closes one of the same kind, escape that triple quote
    wherever it appears unescaped on the lines between. None when the text is not of that shape.
    The repaired text is parsed and checked like any other reply."""
    lines = text.split("\n")
    if len(lines) < 3:
        return None
    for quote in ('"""', "'''"):
        if quote in lines[0] and quote in lines[-1]:
            pattern = re.compile(r"(?<!\\)" + re.escape(quote))
            middle = [pattern.sub("\\\\" + quote, line) for line in lines[1:-1]]
            if middle != lines[1:-1]:
                return "\n".join([lines[0], *middle, lines[-1]])
            return None
    return None


def _after_prose(text: str) -> list[str]:
    """Where a call may start after leading prose (``Sure!\\ndone()``): the text from each line
    that starts like a call, a few at most."""
    starts = [m.start() for m in _LINE_STARTS_LIKE_CALL.finditer(text) if m.start() > 0]
    return [text[i:].strip() for i in starts[:MAX_PROSE_CANDIDATES]]


def _check_length(text: str) -> None:
    if len(text) > MAX_CALL_CHARS:
        raise _reject(
            f"Your reply is {len(text)} characters long; the limit is {MAX_CALL_CHARS}.",
            "too_large",
            f"Split the work into smaller calls. {EXPECTED_SHAPE}",
        )


def _check_structure(text: str) -> None:
    """Bound bracket nesting and the number of separators outside strings, so ``ast.parse`` never
    builds a tree far larger than any acceptable call (100 000 one-line statements took seconds)."""
    depth = 0
    deepest = 0
    separators = 0
    for m in _SCAN.finditer(text):
        c = m.group()
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth -= 1
        elif c in ",;\n":
            separators += 1
    if deepest > MAX_NESTING:
        raise _reject(f"Your reply nests brackets {deepest} deep; the limit is {MAX_NESTING}.", "too_deep")
    if separators > MAX_SEPARATORS:
        raise _reject(
            f"Your reply holds {separators} commas, semicolons and line breaks outside strings; "
            f"the limit is {MAX_SEPARATORS}.",
            "too_large",
            f"Split the work into smaller calls. {EXPECTED_SHAPE}",
        )


def _parse_module(text: str) -> ast.Module:
    if not text:
        raise CallRejected(f"Your reply was empty. {EXPECTED_SHAPE}", "empty")
    _check_structure(text)
    try:
        return ast.parse(text, mode="exec")
    except SyntaxError as e:
        where = f" (line {e.lineno}, column {e.offset})" if e.lineno else ""
        raise _reject(f"Your reply is not valid Python: {e.msg}{where}.", "syntax") from None
    except ValueError as e:  # null bytes
        raise _reject(f"Your reply cannot be parsed: {e}.", "syntax") from None
    except (MemoryError, RecursionError):
        raise _reject("Your reply is too deeply nested to parse.", "too_deep") from None


class _Converter:
    """Turns the argument nodes of an accepted call into plain data, counting nodes as it goes."""

    def __init__(self) -> None:
        self.nodes = 0

    def value(self, node: ast.expr, where: str, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_ELEMENTS:
            raise _reject(f"The arguments hold more than {MAX_ELEMENTS} values.", "too_large")
        if depth > MAX_NESTING:
            raise _reject(f"{where} nests lists or dicts deeper than {MAX_NESTING} levels.", "too_deep")
        if isinstance(node, ast.Constant):
            return self.constant(node.value, where)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            operand = node.operand
            number = operand.value if isinstance(operand, ast.Constant) else None
            if type(number) is int or type(number) is float:  # not bool, not complex
                return self.constant(-number, where)
        if isinstance(node, ast.List | ast.Tuple):
            return [self.value(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(node.elts)]
        if isinstance(node, ast.Dict):
            out: dict[str, Any] = {}
            for key, item in zip(node.keys, node.values, strict=True):
                if key is None:
                    raise self.bad(where, "a ** unpacking inside a dict")
                if not (isinstance(key, ast.Constant) and type(key.value) is str):
                    raise self.bad(where, "a dict whose keys are not all strings")
                if key.value in out:
                    raise self.bad(where, f"a dict with the key {key.value!r} twice")
                out[key.value] = self.value(item, f"{where}[{key.value!r}]", depth + 1)
            return out
        if isinstance(node, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in node.values):
            return "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
        raise self.bad(where, _NODE_WORDS.get(type(node), f"a {type(node).__name__} expression"))

    def constant(self, value: Any, where: str) -> Any:
        t = type(value)
        if value is None or t in (bool, str, bytes):
            return value
        if t is int:
            if not INT_MIN <= value <= INT_MAX:
                raise self.bad(where, "an integer that does not fit in 64 bits")
            return value
        if t is float:
            if not math.isfinite(value):
                raise self.bad(where, "a number that is not finite")
            return value
        if t is complex:
            raise self.bad(where, "a complex number")
        raise self.bad(where, repr(value))

    @staticmethod
    def bad(where: str, what: str) -> CallRejected:
        return CallRejected(
            f"{where} is {what}; arguments must be literal values: strings, numbers, True/False/None, "
            'and lists or dicts of those. Write for example: tool_name(path="a.txt", lines=[1, 2]).',
            "argument",
        )


def _name_at(lines: list[str], node: ast.AST, name: str) -> str:
    """The source text where ``name`` (a Name or keyword node) starts, as written: Python folds
    full-width and other compatibility characters into ASCII names, the source shows them."""
    line = lines[getattr(node, "lineno", 1) - 1].encode()
    written = line[getattr(node, "col_offset", 0) :].decode(errors="replace")
    return written[: len(name)] if written.startswith(name) else written.split("=")[0].split("(")[0].strip()


def _checked_name(name: str, source: str, what: str) -> str:
    if source != name or not _IDENTIFIER.match(name):
        raise _reject(f"The {what} {source or name!r} is not a plain ASCII name.", "name")
    if name.startswith("__") or name.endswith("__"):
        raise _reject(f"The {what} {name!r} is a dunder name, which is not allowed.", "dunder")
    return name


def _call_from_statement(stmt: ast.stmt, lines: list[str]) -> Call:
    if not isinstance(stmt, ast.Expr):
        kind = type(stmt).__name__.lower()
        raise _reject(f"Your reply is a Python {kind} statement, not a function call.", "not_a_call")
    node = stmt.value
    if not isinstance(node, ast.Call):
        word = _NODE_WORDS.get(type(node), "an expression")
        if isinstance(node, ast.Constant):
            word = "plain text or a constant"
        raise _reject(f"Your reply is {word}, not a function call.", "not_a_call")
    func = node.func
    if not isinstance(func, ast.Name):
        what = _NODE_WORDS.get(type(func), "an expression")
        raise _reject(f"The function being called is {what}; call a tool by its bare name.", "callee")
    tool = _checked_name(func.id, _name_at(lines, func, func.id), "tool name")
    conv = _Converter()
    args: list[Any] = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Starred):
            raise _reject("A *starred argument is not allowed; pass each value literally.", "argument")
        args.append(conv.value(arg, f"Positional argument {i + 1} of {tool}"))
    kwargs: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise _reject("A **keyword unpacking is not allowed; pass each argument by name.", "argument")
        name = _checked_name(kw.arg, _name_at(lines, kw, kw.arg), "argument name")
        if name in kwargs:
            raise _reject(f"The argument {name!r} is given twice.", "duplicate_keyword")
        kwargs[name] = conv.value(kw.value, f"Argument {name!r} of {tool}")
    return Call(tool=tool, args=args, kwargs=kwargs)


def _check_against_tools(call: Call, tools: Mapping[str, ToolSpec]) -> ToolSpec:
    spec = tools.get(call.tool)
    if spec is None:
        names = ", ".join(sorted(tools)) or "(none)"
        raise CallRejected(
            f"There is no tool named {call.tool!r}. The available tools are: {names}. {EXPECTED_SHAPE}",
            "unknown_tool",
        )
    try:
        spec.bind(call.args, call.kwargs)
    except BindError as e:
        raise CallRejected(
            f"{e}. The tool's signature is {spec.name}{spec.signature}. {EXPECTED_SHAPE}", "bad_arguments"
        ) from None
    return spec


def _statements(text: str) -> tuple[list[ast.stmt], list[str], str]:
    """The statements of a reply, its source lines and the cleaned text they were parsed from.

    A reply that does not parse gets two more chances, each through the same parser and checks: the
    RA.Aid triple-quote repair, and the call on its own line after leading prose."""
    if not isinstance(text, str):
        raise CallRejected(f"Expected text, got {type(text).__name__}. {EXPECTED_SHAPE}", "type")
    _check_length(text)  # the whole reply, before any regex or the parser sees it
    cleaned = strip_markup(text)
    try:
        module = _parse_module(cleaned)
    except CallRejected as e:
        if e.code != "syntax":
            raise
        for candidate in _fallbacks(cleaned):
            try:
                module = _parse_module(candidate)
            except CallRejected:
                continue
            if module.body:
                cleaned = candidate
                break
        else:
            raise
    if not module.body:
        raise CallRejected(
            f"Your reply holds no call (only comments or whitespace). {EXPECTED_SHAPE}", "empty"
        )
    return module.body, cleaned.split("\n"), cleaned


def _fallbacks(cleaned: str) -> list[str]:
    after_prose = _after_prose(cleaned)
    candidates = [_repair_triple_quotes(cleaned), *after_prose, *(_repair_triple_quotes(c) for c in after_prose)]
    return [strip_markup(c) for c in candidates if c]


def parse_call(text: str, tools: Mapping[str, ToolSpec] | None = None) -> Call:
    """Parse exactly one call. With ``tools``, the tool must exist and the arguments must bind."""
    body, lines, _ = _statements(text)
    if len(body) > 1:
        raise _reject(
            f"Your reply holds {len(body)} statements; send exactly one call per reply.", "multiple"
        )
    call = _call_from_statement(body[0], lines)
    if tools is not None:
        _check_against_tools(call, tools)
    return call


def parse_calls(text: str, tools: Mapping[str, ToolSpec] | None = None) -> list[Call]:
    """Parse one call, or a bundle of several (one per line or ``;``-separated), in order.

    A bundle is accepted only when every call in it is valid and its tool is flagged ``bundleable``;
    otherwise the whole text is rejected, naming the offending call."""
    return parse_reply(text, tools)[0]


def parse_reply(text: str, tools: Mapping[str, ToolSpec] | None = None) -> tuple[list[Call], str]:
    """``parse_calls``, also returning the call text that was parsed (markup, leading prose and
    wrappers removed, triple quotes repaired): what the conversation should show as the reply."""
    body, lines, cleaned = _statements(text)
    if len(body) == 1:
        call = _call_from_statement(body[0], lines)
        if tools is not None:
            _check_against_tools(call, tools)
        return [call], cleaned
    if len(body) > MAX_CALLS:
        raise _reject(f"Your reply holds {len(body)} calls; a bundle may hold at most {MAX_CALLS}.", "bundle")
    calls: list[Call] = []
    for i, stmt in enumerate(body, start=1):
        try:
            call = _call_from_statement(stmt, lines)
            if tools is None:
                raise CallRejected(
                    "Several calls were sent but no tool list is known to check them.", "bundle"
                )
            spec = _check_against_tools(call, tools)
        except CallRejected as e:
            raise CallRejected(f"Call {i} of your reply was rejected: {e}", e.code) from None
        if not spec.bundleable:
            allowed = ", ".join(sorted(n for n, s in tools.items() if s.bundleable)) or "(none)"
            raise CallRejected(
                f"Call {i} of your reply ({call.tool}) cannot be bundled with other calls; send it alone. "
                f"Only these tools may be sent several per reply: {allowed}.",
                "bundle",
            )
        calls.append(call)
    return calls, cleaned
