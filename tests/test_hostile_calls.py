"""Hostile model output: every line here must be refused by ``parse_call`` with ``CallRejected``.

The grammar is an allowlist, so each family of escape (dunder chains, builtins, nested calls, operators,
statements, smuggled second statements, resource bombs, Unicode look-alikes, wrong input types) gets
rows in one table, each with the machine-readable ``code`` it must be refused with. Whatever the
input, nothing but ``CallRejected`` may come out, and its message must tell the model what to write.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import CallRejected, ToolSpec, parse_call, parse_calls
from protocol.grammar import EXPECTED_SHAPE, MAX_CALL_CHARS, MAX_NESTING

# (id, text, code). Read the id first: it says what the row attacks.
HOSTILE: list[tuple[str, Any, str]] = [
    # Dunder and attribute chains.
    ("subclasses-chain", "().__class__.__bases__[0].__subclasses__()", "callee"),
    ("list-subclasses-chain", "[].__class__.__base__.__subclasses__()", "callee"),
    ("globals-attribute", "x.__globals__", "not_a_call"),
    ("class-attribute-of-tuple", "().__class__", "not_a_call"),
    ("builtins-dict-eval", "__builtins__.__dict__['eval']('1')", "callee"),
    ("dunder-call-method", "read_file.__call__('a')", "callee"),
    ("dunder-tool-import", "__import__('os')", "dunder"),
    ("dunder-tool-builtins", "__builtins__()", "dunder"),
    ("leading-dunder-tool", "__secret('a')", "dunder"),
    ("trailing-dunder-tool", "secret__('a')", "dunder"),
    ("dunder-keyword-class", "read_file(__class__=1)", "dunder"),
    ("dunder-keyword-init", "read_file(path='a', __init__=1)", "dunder"),
    ("trailing-dunder-keyword", "read_file(path__='a')", "dunder"),
    ("attribute-argument-globals", "read_file(x.__globals__)", "argument"),
    ("attribute-argument-method", "read_file(''.join)", "argument"),
    # Callees that are not a bare name.
    ("call-of-call", "f()()", "callee"),
    ("getattr-then-call", "getattr(__builtins__, 'eval')('1')", "callee"),
    ("subscript-callee", "tools[0]('a')", "callee"),
    ("attribute-callee-os-system", "os.system('id')", "callee"),
    ("lambda-callee", "(lambda: 0)()", "callee"),
    ("spaced-attribute-callee", "f .x()", "callee"),
    # Nested calls as arguments.
    ("nested-call-positional", "f(g())", "argument"),
    ("nested-call-keyword", "write_file(path='a', content=open('/etc/passwd'))", "argument"),
    ("nested-call-in-list", "f([g()])", "argument"),
    ("nested-call-in-dict", "f({'k': g()})", "argument"),
    ("nested-os-system", "f(x=os.system('id'))", "argument"),
    # Lambdas and comprehensions.
    ("lambda-argument", "f(lambda: 0)", "argument"),
    ("lambda-keyword", "sort(key=lambda x: x)", "argument"),
    ("lambda-statement", "lambda: f()", "not_a_call"),
    ("list-comprehension", "f([x for x in range(9)])", "argument"),
    ("set-comprehension", "f({x for x in y})", "argument"),
    ("dict-comprehension", "f({k: 1 for k in y})", "argument"),
    ("generator-expression", "f(x for x in y)", "argument"),
    # Starred and double-starred arguments.
    ("star-name", "f(*a)", "argument"),
    ("star-literal", "f(*[1, 2])", "argument"),
    ("star-string", "f(*'ab')", "argument"),
    ("double-star-name", "f(**k)", "argument"),
    ("double-star-literal", "f(**{'a': 1})", "argument"),
    ("star-inside-list", "f([*a])", "argument"),
    ("double-star-inside-dict", "f({**a})", "argument"),
    # Walrus.
    ("walrus-positional", "f((x := 1))", "argument"),
    ("walrus-keyword", "f(a=(x := 1))", "argument"),
    ("walrus-statement", "(y := f())", "not_a_call"),
    # f-strings with fields.
    ("fstring-name", "f(f'{x}')", "argument"),
    ("fstring-import", "f(f'{__import__(\"os\").system(\"id\")}')", "argument"),
    ("fstring-nested-format-spec", "f(f'{1:>{9**9}}')", "argument"),
    ("fstring-conversion", "f(f'{x!r}')", "argument"),
    ("raw-fstring", "f(rf'{x}')", "argument"),
    # Operators and constant-folding bombs.
    ("power-tower", "f(9**9**9)", "argument"),
    ("string-times-huge", "f('a'*10**9)", "argument"),
    ("list-times-huge", "f([0] * 10**9)", "argument"),
    ("one-plus-one", "f(1+1)", "argument"),
    ("two-to-the-64", "f(2**64)", "argument"),
    ("left-shift", "f(1 << 100)", "argument"),
    ("percent-format", "f('%s' % 'a')", "argument"),
    ("bitwise-not", "f(~0)", "argument"),
    ("boolean-not", "f(not 0)", "argument"),
    ("unary-plus", "f(+1)", "argument"),
    ("double-minus", "f(--1)", "argument"),
    ("minus-parenthesised-minus", "f(-(-1))", "argument"),
    ("minus-bool", "f(-True)", "argument"),
    ("minus-string", "f(-'a')", "argument"),
    ("conditional-expression", "f(1 if x else 2)", "argument"),
    ("boolean-and", "f(1 and 2)", "argument"),
    ("comparison", "f(1 < 2)", "argument"),
    ("expression-statement-plus", "f() + 1", "not_a_call"),
    ("negated-call", "-f()", "not_a_call"),
    ("not-call", "not f()", "not_a_call"),
    # Numbers and containers outside the value set.
    ("complex", "f(1j)", "argument"),
    ("negative-complex", "f(-1j)", "argument"),
    ("complex-sum", "f(1+2j)", "argument"),
    ("int-over-64-bits", "f(18446744073709551616)", "argument"),
    ("int-under-64-bits", "f(-9223372036854775809)", "argument"),
    ("huge-int-in-list", "f([1, 10000000000000000000000000000])", "argument"),
    ("float-overflow-inf", "f(1e400)", "argument"),
    ("negative-float-overflow", "f(-1e400)", "argument"),
    ("ellipsis", "f(...)", "argument"),
    ("set-literal", "f({1, 2})", "argument"),
    ("set-of-one-string", "f({'a'})", "argument"),
    ("int-dict-key", "f({1: 'a'})", "argument"),
    ("bytes-dict-key", "f({b'k': 1})", "argument"),
    ("none-dict-key", "f({None: 1})", "argument"),
    ("tuple-dict-key", "f({(1,): 1})", "argument"),
    ("bool-dict-key", "f({True: 1})", "argument"),
    ("float-dict-key", "f({1.5: 1})", "argument"),
    ("duplicate-dict-key", "f({'a': 1, 'a': 2})", "argument"),
    # Duplicate keywords.
    ("duplicate-keyword", "f(a=1, a=2)", "duplicate_keyword"),
    ("duplicate-keyword-apart", "f(a=1, b=2, a=3)", "duplicate_keyword"),
    # Names, subscripts, slices as values.
    ("variable-argument", "f(x)", "argument"),
    ("variable-keyword", "f(a=x)", "argument"),
    ("module-argument", "f(os)", "argument"),
    ("builtins-argument", "f(__builtins__)", "argument"),
    ("subscript-argument", "f(a[0])", "argument"),
    ("string-index-argument", "f('abc'[0])", "argument"),
    ("slice-argument", "f(a[1:2])", "argument"),
    # Not a call at all.
    ("bare-name", "read_file", "not_a_call"),
    ("plain-prose", "'I will read the file now'", "not_a_call"),
    ("number", "42", "not_a_call"),
    ("list-of-calls", "[f(), g()]", "not_a_call"),
    ("tuple-of-calls", "f(), g()", "not_a_call"),
    ("subscript-of-call", "globals()['os']", "not_a_call"),
    ("conditional-of-calls", "f() if x else g()", "not_a_call"),
    # Statements.
    ("import", "import os", "not_a_call"),
    ("from-import", "from os import system", "not_a_call"),
    ("assignment", "x = f()", "not_a_call"),
    ("annotated-assignment", "x: int = f()", "not_a_call"),
    ("augmented-assignment", "x += f()", "not_a_call"),
    ("def", "def f(): pass", "not_a_call"),
    ("async-def", "async def f(): pass", "not_a_call"),
    ("decorated-def", "@f\ndef g(): pass", "not_a_call"),
    ("class", "class A: pass", "not_a_call"),
    ("for", "for x in y: f()", "not_a_call"),
    ("while", "while f(): pass", "not_a_call"),
    ("if", "if f(): pass", "not_a_call"),
    ("with", "with open('x') as h: f()", "not_a_call"),
    ("try", "try:\n    f()\nexcept Exception:\n    pass", "not_a_call"),
    ("match", "match x:\n    case 1:\n        f()", "not_a_call"),
    ("del", "del x", "not_a_call"),
    ("global", "global x", "not_a_call"),
    ("nonlocal", "nonlocal x", "not_a_call"),
    ("return", "return f()", "not_a_call"),
    ("raise", "raise f()", "not_a_call"),
    ("assert", "assert f()", "not_a_call"),
    ("pass", "pass", "not_a_call"),
    ("break", "break", "not_a_call"),
    # await and yield.
    ("await-statement", "await f()", "not_a_call"),
    ("yield-statement", "yield f()", "not_a_call"),
    ("yield-from-statement", "yield from f()", "not_a_call"),
    ("await-argument", "f(await x)", "argument"),
    ("yield-argument", "f((yield))", "argument"),
    # Multi-statement smuggling.
    ("semicolon-import", "f(); import os", "multiple"),
    ("newline-os-system", "f()\nos.system('x')", "multiple"),
    ("carriage-return-import", "f()\rimport os", "multiple"),
    ("crlf-import", "f()\r\nimport os", "multiple"),
    ("comment-then-import", "f()  # harmless\nimport os", "multiple"),
    ("continuation-then-import", "f(\n)\nimport os", "multiple"),
    ("fenced-second-statement", "```python\nf()\nimport os\n```", "multiple"),
    ("one-line-fence-with-newline", "```python f()\nimport os```", "multiple"),
    ("backticked-second-statement", "`f()\nimport os`", "multiple"),
    ("think-then-two-statements", "<think>ok</think>\nf()\nimport os", "multiple"),
    ("two-fences-second-imports", "```python\nf()\n```\n```python\nimport os\n```", "syntax"),
    ("two-backtick-spans", "`f()` and `import os`", "syntax"),
    ("line-separator-smuggle", "f()\u2028import os", "syntax"),
    ("form-feed-smuggle", "f()\x0cimport os", "syntax"),
    # Null bytes.
    ("null-in-string", "f('a\x00b')", "syntax"),
    ("null-after-call", "f()\x00import os", "syntax"),
    ("null-before-call", "\x00f()", "syntax"),
    # Deep nesting and bombs.
    ("parentheses-1000-deep", "f(" + "(" * 1000 + ")" * 1000 + ")", "too_deep"),
    ("lists-1000-deep", "f(" + "[" * 1000 + "]" * 1000 + ")", "too_deep"),
    ("dicts-1000-deep", "f(" + "{'a': " * 1000 + "1" + "}" * 1000 + ")", "too_deep"),
    ("lists-one-over-the-limit", "f(" + "[" * MAX_NESTING + "]" * MAX_NESTING + ")", "too_deep"),
    ("brackets-hidden-behind-comment-quote", "f(# '''\n" + "[" * 60 + "]" * 60 + "\n# '''\n)", "too_deep"),
    ("unclosed-brackets", "f(" + "[" * 1000, "too_deep"),
    ("minus-10000", "-" * 10000 + "1", "too_deep"),
    ("minus-10000-argument", "f(" + "-" * 10000 + "1)", "too_deep"),
    ("not-100000", "f(" + "not " * 100000 + "1)", "too_deep"),
    ("addition-chain-100000", "f(" + "1+" * 100000 + "1)", "too_deep"),
    ("attribute-chain-100000", "a" + ".a" * 100000 + "()", "too_deep"),
    ("call-chain-100000", "f" + "()" * 100000, "too_deep"),
    ("too-many-values", "f([" + "1," * 20001 + "])", "too_large"),
    ("too-many-statements", "f()\n" * (MAX_CALL_CHARS // 5), "too_large"),
    ("too-many-semicolons", "f();" * (MAX_CALL_CHARS // 5), "too_large"),
    ("too-many-commas-in-lists", "f(" + "[]," * (MAX_CALL_CHARS // 4) + ")", "too_large"),
    # Unicode look-alikes: Python folds these to ASCII names, the grammar refuses them.
    ("full-width-tool", "ｒｅａｄ_file('a')", "name"),
    ("full-width-keyword", "read_file(ｐａｔｈ='a')", "name"),
    ("full-width-exec", "ｅｘｅｃ('import os')", "name"),
    ("script-e-eval", "\u212fval('1')", "name"),
    ("math-bold-eval", "\U0001d41e\U0001d42f\U0001d41a\U0001d425('1')", "name"),
    ("ligature-file", "\ufb01le('a')", "name"),
    ("combining-accent-tool", "f\u0301()", "name"),
    ("full-width-low-line-dunder", "f(\uff3f\uff3fclass\uff3f\uff3f=1)", "syntax"),
    ("zero-width-space", "f\u200b()", "syntax"),
    ("byte-order-mark", "\ufefff()", "syntax"),
    ("no-break-space", "f(\u00a01)", "syntax"),
    ("lone-surrogate", "f('\ud800')", "syntax"),
    # Markup that leaves nothing to run.
    ("empty", "", "empty"),
    ("whitespace", "  \n\t ", "empty"),
    ("comment-only", "# read_file('a')", "empty"),
    ("unclosed-think", "<think>read_file('a')", "empty"),
    ("think-only", "<think>I am done</think>", "empty"),
    ("empty-fence", "```python\n```", "empty"),
    # Python 2 and other syntax.
    ("python2-print", "print 'x'", "syntax"),
    ("starred-keyword-syntax", "f(a=*b)", "syntax"),
    ("unbalanced", "f(", "syntax"),
    # Wrong input types and size.
    ("none-input", None, "type"),
    ("bytes-input", b"read_file('a')", "type"),
    ("int-input", 1, "type"),
    ("list-input", ["read_file('a')"], "type"),
    ("bytearray-input", bytearray(b"f()"), "type"),
    ("oversized-string", "f('" + "a" * MAX_CALL_CHARS + "')", "too_large"),
    ("oversized-whitespace-padding", "f()" + " " * MAX_CALL_CHARS, "too_large"),
    ("oversized-think-padding", "<think>" + "x" * MAX_CALL_CHARS + "</think>f()", "too_large"),
]


def _read_file(path: str) -> str:
    """Read a file."""
    return path


def _write_file(path: str, content: str) -> None:
    """Write a file."""


TOOLS = {
    "read_file": ToolSpec.from_function(_read_file, name="read_file", bundleable=True),
    "write_file": ToolSpec.from_function(_write_file, name="write_file"),
}

# With a tool list, a builtin's name is just an unknown tool: it never reaches the builtin.
BUILTIN_CALLS = [
    ("eval", "eval(\"__import__('os').system('id')\")"),
    ("exec", "exec('import os')"),
    ("open", "open('/etc/passwd')"),
    ("getattr", "getattr('a', 'upper')"),
    ("setattr", "setattr('a', 'b', 'c')"),
    ("globals", "globals()"),
    ("locals", "locals()"),
    ("vars", "vars()"),
    ("compile", "compile('1', 'x', 'exec')"),
    ("breakpoint", "breakpoint()"),
    ("input", "input()"),
    ("exit", "exit()"),
    ("print", "print('x')"),
    ("help", "help()"),
]


def _message_is_helpful(e: CallRejected) -> None:
    message = str(e)
    assert message.strip(), "the model must be told what was wrong"
    assert EXPECTED_SHAPE in message or "tool_name(" in message, message


@pytest.mark.parametrize(("text", "code"), [pytest.param(t, c, id=i) for i, t, c in HOSTILE])
def test_hostile_text_is_rejected_with_its_reason(text: Any, code: str) -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call(text)
    assert caught.value.code == code, str(caught.value)
    _message_is_helpful(caught.value)


@pytest.mark.parametrize("text", [pytest.param(t, id=i) for i, t, _ in HOSTILE])
def test_hostile_text_is_rejected_as_a_bundle_too(text: Any) -> None:
    with pytest.raises(CallRejected) as caught:
        parse_calls(text, TOOLS)
    _message_is_helpful(caught.value)


@pytest.mark.parametrize("text", [pytest.param(t, id=name) for name, t in BUILTIN_CALLS])
def test_builtin_names_are_unknown_tools(text: str) -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call(text, TOOLS)
    assert caught.value.code == "unknown_tool"
    assert "read_file, write_file" in str(caught.value)
    _message_is_helpful(caught.value)


@pytest.mark.parametrize("text", [pytest.param(t, id=name) for name, t in BUILTIN_CALLS])
def test_builtin_names_without_a_tool_list_are_only_descriptors(text: str) -> None:
    """Without tools nothing is looked up, let alone run: the result is inert data."""
    call = parse_call(text)
    assert call.tool == text.split("(")[0]
    assert call.id is None


def test_dunder_builtin_is_refused_before_the_tool_lookup() -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call("__import__('os')", TOOLS)
    assert caught.value.code == "dunder"


def test_the_nesting_limit_itself_is_accepted() -> None:
    depth = MAX_NESTING - 1  # the call's own parenthesis is one level
    call = parse_call("f(" + "[" * depth + "]" * depth + ")")
    value = call.args[0]
    for _ in range(depth - 1):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == []


@pytest.mark.parametrize("depth", [100, 500, 1000, 3000, 10_000, 100_000])
@pytest.mark.parametrize(
    ("prefix", "middle", "suffix"),
    [
        pytest.param("f(", "-", "1)", id="minus"),
        pytest.param("f(", "~", "1)", id="invert"),
        pytest.param("f(", "not ", "1)", id="not"),
        pytest.param("f(", "1**", "1)", id="power"),
        pytest.param("f(", "1+", "1)", id="plus"),
        pytest.param("f(", "lambda:", "1)", id="lambda"),
        pytest.param("f(", "1 if 1 else ", "1)", id="conditional"),
        pytest.param("a", ".a", "()", id="attribute"),
        pytest.param("f", "()", "", id="call"),
        pytest.param("f", "[0]", "()", id="subscript"),
        pytest.param("f(", "(", "1)", id="paren"),
    ],
)
def test_deep_expressions_never_crash_the_parser(prefix: str, middle: str, suffix: str, depth: int) -> None:
    text = prefix + middle * depth + suffix
    with pytest.raises(CallRejected) as caught:
        parse_call(text[: MAX_CALL_CHARS + 1])
    assert caught.value.code in {"too_deep", "too_large", "argument", "callee", "syntax"}


def test_many_think_tags_are_handled_in_linear_time() -> None:
    """A regex with a lazy ``.*?`` per ``<think>`` took minutes on this input."""
    bomb = "<think>" * (MAX_CALL_CHARS // len("<think>"))
    with pytest.raises(CallRejected) as caught:
        parse_call(bomb)
    assert caught.value.code == "empty"
    with pytest.raises(CallRejected):
        parse_call("f()" + "<think>" * 30_000 + "</think>" * 30_000)


_PIECES = st.sampled_from(
    [
        "f", "read_file", "(", ")", "[", "]", "{", "}", ",", ":", "=", "'", '"', "'''", "\\", "\n", "\r",
        ";", "#", "`", "```", "~~~", "<think>", "</think>", "__", ".", "*", "**", "-", "+", "1", "1e999",
        "j", "lambda", "import os", "x", " ", "f'{x}'", ":=", "await", "yield", "\x00", "ｆ", "\ud800",
    ]
)


# Model text may hold escapes Python warns about ('\-'); the warning is noise here, not a failure.
_QUIET = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::SyntaxWarning")


@_QUIET
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_PIECES, max_size=40).map("".join))
def test_any_text_gives_a_call_or_call_rejected(text: str) -> None:
    try:
        call = parse_call(text)
    except CallRejected as e:
        _message_is_helpful(e)
    else:
        assert call.tool.isidentifier() and call.tool.isascii()


@_QUIET
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_unicode_gives_a_call_or_call_rejected(text: str) -> None:
    try:
        parse_calls(text, TOOLS)
    except CallRejected as e:
        _message_is_helpful(e)
