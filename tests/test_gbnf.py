"""The call grammar admits only calls that ``parse_call`` accepts, and llama.cpp can parse it.

The grammar is built as rules (``controller.gbnf.Grammar``); the tests walk the very same rules: a
random derivation (hypothesis picks every choice) yields an admitted text, and a small recogniser
decides whether a given text is admitted. No llama.cpp is needed, except for the test that asks
llama.cpp itself to parse the rendered grammar.
"""

from __future__ import annotations

import ast
import keyword
from collections.abc import Callable
from typing import Any, Literal

import pytest
from gbnf_walk import admits, derive
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from controller import gbnf
from controller.gbnf import Alt, Expr, Ref, Repeat, Seq, call_grammar, call_rules
from protocol.grammar import CallRejected, parse_call
from protocol.spec import Param, ToolSpec

# --- Random tools ---------------------------------------------------------------------------------

SCALAR_SCHEMAS = [
    {},
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
]
ENUM_VALUES = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
)
SCHEMAS = st.recursive(
    st.one_of(
        st.sampled_from(SCALAR_SCHEMAS),
        st.lists(ENUM_VALUES, min_size=1, max_size=4).map(lambda vs: {"enum": vs}),
        ENUM_VALUES.map(lambda v: {"const": v}),
        st.lists(
            st.sampled_from(["string", "integer", "number", "boolean", "null"]), min_size=1, max_size=3, unique=True
        ).map(lambda ts: {"type": ts}),
        st.sampled_from([{"type": "array"}, {"type": "object"}]),
    ),
    lambda inner: st.one_of(
        inner.map(lambda s: {"type": "array", "items": s}),
        inner.map(lambda s: {"type": "object", "additionalProperties": s}),
        st.lists(inner, min_size=1, max_size=3).map(lambda ss: {"anyOf": ss}),
    ),
    max_leaves=6,
)
IDENTIFIERS = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n) and not n.endswith("__")
)
UNWRITABLE_NAMES = st.sampled_from(["class", "lambda", "__init__", "None", "naïve"])
KIND_ORDER = ["positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"]


@st.composite
def tool_specs(draw: Callable[[st.SearchStrategy[Any]], Any], name: str | None = None) -> ToolSpec:
    """A tool of random parameters (kinds in Python's order, any required flags, random schemas)."""
    params: list[Param] = []
    properties: dict[str, Any] = {}
    used: set[str] = set()
    for kind in KIND_ORDER:
        count = draw(st.integers(0, 1 if kind.startswith("var_") else 3))
        for _ in range(count):
            unwritable = kind != "positional_only" and draw(st.integers(0, 9)) == 0
            pname = draw(UNWRITABLE_NAMES if unwritable else IDENTIFIERS)
            if pname in used:
                continue
            used.add(pname)
            required = False if kind.startswith("var_") or unwritable else draw(st.booleans())
            params.append(Param(name=pname, kind=kind, required=required))
            if not kind.startswith("var_"):
                properties[pname] = draw(SCHEMAS)
    schema = {"type": "object", "properties": properties, "required": [p.name for p in params if p.required]}
    return ToolSpec(name=name or draw(IDENTIFIERS), signature="(...)", parameters=schema, params=params)


@st.composite
def tool_lists(draw: Callable[[st.SearchStrategy[Any]], Any]) -> list[ToolSpec]:
    names = draw(st.lists(IDENTIFIERS, min_size=1, max_size=3, unique=True))
    return [draw(tool_specs(name=n)) for n in names]


def parse_admitted(text: str, tools: list[ToolSpec]) -> Any:
    """``parse_call``'s verdict; a duplicate dict key (the documented gap) makes the example moot."""
    try:
        return parse_call(text, {t.name: t for t in tools})
    except CallRejected as e:
        assume(not (e.code == "argument" and "twice" in str(e)))
        raise


# --- Properties -----------------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@PROPERTY_SETTINGS
@given(tools=tool_lists(), data=st.data())
def test_every_call_the_grammar_admits_parses_for_random_tools(tools: list[ToolSpec], data: st.DataObject) -> None:
    grammar = call_rules(tools)
    text = derive(grammar, data.draw)
    call = parse_admitted(text, tools)
    assert call.tool in {t.name for t in tools}


@PROPERTY_SETTINGS
@given(tools=tool_lists(), data=st.data())
def test_values_the_grammar_admits_match_the_json_schema(tools: list[ToolSpec], data: st.DataObject) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    text = derive(call_rules(tools), data.draw)
    call = parse_admitted(text, tools)
    spec = next(t for t in tools if t.name == call.tool)
    for name, value in spec.bind(call.args, call.kwargs).items():
        jsonschema.validate(value, spec.parameters["properties"][name])


ONE_PARAM = [ToolSpec(name="f", signature="(x)", params=[Param(name="x")])]


@PROPERTY_SETTINGS
@given(schema=st.one_of(st.sampled_from(SCALAR_SCHEMAS), SCHEMAS), data=st.data())
def test_every_value_the_grammar_admits_parses_and_matches_its_schema(schema: Any, data: st.DataObject) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    text = derive(gbnf.value_rules(schema), data.draw)
    value = parse_admitted(f"f(x={text})", ONE_PARAM).kwargs["x"]
    jsonschema.validate(value, schema)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=tool_lists(), data=st.data())
def test_the_recogniser_admits_every_derived_text(tools: list[ToolSpec], data: st.DataObject) -> None:
    grammar = call_rules(tools)
    assert admits(grammar, derive(grammar, data.draw))


def read_file(path: str) -> str: ...


def write_file(path: str, content: str, mode: Literal["w", "a"] = "w", *, encoding: str | None = None) -> None: ...


def search(
    pattern: str, paths: list[str], /, limit: int = 10, options: dict[str, bool] | None = None, *rest: Any, **extra: Any
) -> list[dict[str, Any]]: ...


def configure(
    settings: dict[str, Any],
    matrix: list[list[list[list[int]]]] | None = None,
    ratio: float = 0.5,
    flag: bool = False,
    anything: Any = None,
) -> None: ...


def finish() -> None: ...


REAL_TOOLS = [ToolSpec.from_function(f) for f in (read_file, write_file, search, configure, finish)]


@PROPERTY_SETTINGS
@given(data=st.data())
def test_every_call_the_grammar_admits_parses_for_reflected_tools(data: st.DataObject) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    text = derive(call_rules(REAL_TOOLS), data.draw)
    call = parse_admitted(text, REAL_TOOLS)
    spec = next(t for t in REAL_TOOLS if t.name == call.tool)
    for name, value in spec.bind(call.args, call.kwargs).items():
        jsonschema.validate(value, spec.parameters["properties"][name])


# --- Exact output ---------------------------------------------------------------------------------

VALUE_RULES = f"""\
string ::= short-string | long-string
short-string ::= "\\"" str-char{{0,{gbnf.MAX_STRING_CHARS}}} "\\""
str-char ::= [^\\"\\\\\\x00-\\x1F] | escape
escape ::= "\\\\" ([\\"\\\\nt] | "u" ([0-9a-cA-Ce-fE-F] [0-9a-fA-F]{{3}} | [dD] [0-7] [0-9a-fA-F]{{2}}))
long-string ::= "\\"\\"\\"" text-item{{0,{gbnf.MAX_TEXT_CHARS}}} "\\"\\"\\""
text-item ::= text-char | escape | "\\"" text-tail | "\\"\\"" text-tail
text-tail ::= text-char | escape
text-char ::= [^\\"\\\\\\x00-\\x08\\x0B-\\x1F]
"""


def test_grammar_text_for_a_one_string_parameter_tool() -> None:
    assert call_grammar([ToolSpec.from_function(read_file)]) == (
        "root ::= call-read-file\n"
        'call-read-file ::= "read_file(" ws read-file-path ws ")"\n'
        'read-file-path ::= "path" ws "=" ws string\n'
        'ws ::= " "?\n' + VALUE_RULES
    )


def test_grammar_text_for_optional_and_typed_parameters() -> None:
    text = call_grammar([ToolSpec.from_function(write_file), ToolSpec.from_function(finish)])
    assert text.splitlines()[:8] == [
        "root ::= call-write-file | call-finish",
        'call-write-file ::= "write_file(" ws write-file-path ws "," ws write-file-content '
        '(ws "," ws write-file-mode)? (ws "," ws write-file-encoding)? ws ")"',
        'write-file-path ::= "path" ws "=" ws string',
        'write-file-content ::= "content" ws "=" ws string',
        'write-file-mode ::= "mode" ws "=" ws write-file-mode-value',
        'write-file-mode-value ::= "\\"w\\"" | "\\"a\\""',
        'write-file-encoding ::= "encoding" ws "=" ws write-file-encoding-value',
        'write-file-encoding-value ::= string | "None"',
    ]
    assert 'call-finish ::= "finish(" ws ")"' in text.splitlines()


def test_positional_only_parameters_are_written_positionally() -> None:
    line = call_grammar([ToolSpec.from_function(search)]).splitlines()[1]
    assert line == (
        'call-search ::= "search(" ws string ws "," ws search-paths (ws "," ws search-limit)? '
        '(ws "," ws search-options)? ws ")"'
    )


# --- What the grammar refuses ---------------------------------------------------------------------

TOOLS = [ToolSpec.from_function(f) for f in (read_file, write_file, finish)]
ADMITTED = [
    'read_file(path="a.py")',
    'read_file( path = "a.py" )',
    'read_file(path="""line 1\nline "2" ""3""")',
    'read_file(path="tab\\t quote\\" unicode \\u00e9 中")',
    'write_file(path="a", content="", mode="a", encoding=None)',
    'write_file(path="a",content="b",encoding="utf-8")',
    "finish()",
]
NOT_ADMITTED = [
    'read_file(path=open("x"))',  # a nested call
    'read_file(path="a", path="b")',  # a duplicate keyword
    "read_file()",  # a missing required argument
    'read_file("a.py")',  # positional for a keyword parameter: valid Python, outside this grammar
    'os.system("ls")',  # an attribute callee
    'read_file(path="a"); finish()',  # two statements
    "read_file(path=x)",  # a variable
    'read_file(path="a" + "b")',  # an operator
    'read_file(path=f"{x}")',  # an f-string
    "read_file(path='a')",  # single quotes (valid Python, outside this grammar)
    'read_file(path="a\nb")',  # a raw newline in a short string
    'read_file(path="\\ud800")',  # a lone surrogate escape
    'read_file(path="""a"""")',  # a quote right before the closing triple quote
    'read_file(path="a",)',  # a trailing comma
    'write_file(content="b", path="a")',  # keywords out of declaration order
    'write_file(path="a", content="b", mode="x")',  # outside the Literal
    'finish(answer="done")',  # an unknown parameter
    'delete_all(path="/")',  # an unknown tool
    '__import__(name="os")',
]


@pytest.mark.parametrize("text", ADMITTED)
def test_valid_calls_are_admitted_and_parse(text: str) -> None:
    assert admits(call_rules(TOOLS), text)
    parse_call(text, {t.name: t for t in TOOLS})


@pytest.mark.parametrize("text", NOT_ADMITTED)
def test_invalid_calls_are_not_admitted(text: str) -> None:
    assert not admits(call_rules(TOOLS), text)


VALUES_ADMITTED = [
    "-0",
    "0",
    "123",
    "-1.5e-3",
    "2.0E+10",
    "True",
    "None",
    '""',
    '""""a"""',
    "[]",
    "[[[1]]]",
    '{"a": [1, {"b": None}]}',
    '[1,2 , "x"]',
    "-999999999999999999",
]
VALUES_NOT_ADMITTED = [
    "01",
    "1e999",
    "1.5e100",
    "1_000",
    "0x10",
    "1.",
    ".5",
    "--1",
    "1j",
    "nan",
    "inf",
    "9999999999999999999",
    "[[[[1]]]]",
    "{1: 2}",
    "{'a': 1}",
    "(1, 2)",
    "{1, 2}",
    'b"x"',
    "true",
    "[1,]",
    "[" + ", ".join(["1"] * (gbnf.MAX_ITEMS + 1)) + "]",
]


@pytest.mark.parametrize("text", VALUES_ADMITTED)
def test_literal_values_are_admitted_and_parse(text: str) -> None:
    assert admits(gbnf.value_rules(), text)
    assert parse_call(f"f(x={text})").kwargs["x"] == ast.literal_eval(text)


@pytest.mark.parametrize("text", VALUES_NOT_ADMITTED)
def test_other_values_are_not_admitted(text: str) -> None:
    assert not admits(gbnf.value_rules(), text)


EXCLUDED = ["", ".", "a.txt", "a.txt.bak", "docs/", "naïve 中"]
NOT_SCHEMA = {"type": "string", "not": {"enum": EXCLUDED}}


@PROPERTY_SETTINGS
@given(data=st.data())
def test_a_string_kept_out_by_not_is_never_admitted_and_all_else_may_be(data: st.DataObject) -> None:
    grammar = gbnf.value_rules(NOT_SCHEMA)
    value = parse_admitted(f"f(x={derive(grammar, data.draw)})", ONE_PARAM).kwargs["x"]
    assert isinstance(value, str) and value not in EXCLUDED
    other = data.draw(st.text(max_size=12))
    if other not in EXCLUDED and all(c not in '"\\' and c >= " " for c in other):
        assert admits(grammar, f'"{other}"')


@pytest.mark.parametrize("value", EXCLUDED)
def test_no_spelling_of_a_kept_out_string_is_admitted(value: str) -> None:
    grammar = gbnf.value_rules(NOT_SCHEMA)
    escaped = "".join(f"\\u{ord(c):04x}" for c in value)  # the same value, spelled with escapes
    for text in (f'"{value}"', f'"{escaped}"', f'"""{value}"""'):
        assert not admits(grammar, text), text
    for near in (value[:-1], value + "x", "x" + value, value.upper()):
        if near not in EXCLUDED:
            assert admits(grammar, f'"{near}"'), near


LENGTH_SCHEMAS = st.fixed_dictionaries(
    {"type": st.just("string")},
    optional={
        "minLength": st.integers(0, 6),
        "maxLength": st.integers(0, 12),
        "not": st.fixed_dictionaries({"enum": st.lists(st.sampled_from([*EXCLUDED, "ab", "abc", "x"]), max_size=4)}),
    },
)


@PROPERTY_SETTINGS
@given(schema=LENGTH_SCHEMAS, data=st.data())
def test_a_string_bounded_in_length_and_kept_out_values_matches_its_schema(schema: Any, data: st.DataObject) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    assume(schema.get("minLength", 0) <= schema.get("maxLength", 256))
    assume(schema.get("maxLength") != 0 or "" not in schema.get("not", {}).get("enum", []))  # nothing is left
    grammar = gbnf.value_rules(schema)
    value = parse_admitted(f"f(x={derive(grammar, data.draw)})", ONE_PARAM).kwargs["x"]
    jsonschema.validate(value, schema)
    other = data.draw(st.text(alphabet="abcx.", max_size=14))
    try:
        jsonschema.validate(other, schema)
    except jsonschema.ValidationError:
        assert not admits(grammar, f'"{other}"'), other
    else:
        assert admits(grammar, f'"{other}"'), other


def test_a_kept_out_value_narrows_a_call_of_a_tool() -> None:
    spec = ToolSpec.from_function(read_file)
    narrowed = spec.model_copy(update={"parameters": {**spec.parameters, "properties": {"path": NOT_SCHEMA}}})
    grammar = call_rules([narrowed])
    assert not admits(grammar, 'read_file(path=".")') and admits(grammar, 'read_file(path="b.txt")')


def test_duplicate_dict_keys_are_the_one_gap_of_a_context_free_grammar() -> None:
    text = 'f(x={"a": 1, "a": 2})'
    assert admits(call_rules([ToolSpec(name="f", signature="(x)", params=[Param(name="x")])]), text)
    with pytest.raises(CallRejected, match="twice"):
        parse_call(text)


def test_rules_never_recurse_so_every_derivation_ends() -> None:
    grammar = call_rules(REAL_TOOLS)

    def refs(expr: Expr) -> set[str]:
        if isinstance(expr, Ref):
            return {expr.name}
        if isinstance(expr, Seq):
            return set().union(*(refs(i) for i in expr.items))
        if isinstance(expr, Alt):
            return set().union(*(refs(o) for o in expr.options))
        return refs(expr.item) if isinstance(expr, Repeat) else set()

    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"rule cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for r in refs(grammar.rules[name]):
                visit(r, (*path, name))
            done.add(name)

    visit(grammar.root, ())
    assert done == set(grammar.rules)  # and no rule is left unused


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([], "at least one tool"),
        ([ToolSpec(name="class", signature="()")], "cannot be called"),
        ([ToolSpec(name="__import__", signature="()")], "cannot be called"),
        ([ToolSpec(name="f", signature="()"), ToolSpec(name="f", signature="()")], "Two tools"),
        ([ToolSpec(name="f", signature="()", params=[Param(name="class", kind="keyword_only")])], "requires"),
    ],
)
def test_tools_that_cannot_be_called_are_refused(tools: list[ToolSpec], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call_grammar(tools)


# --- llama.cpp --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_vocab() -> Any:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup-model)")
    from controller.local_model import ModelNotInstalled, find_gguf

    try:
        gguf = find_gguf()
    except ModelNotInstalled as e:
        pytest.skip(str(e))
    model = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    yield llama_cpp, llama_cpp.llama_model_get_vocab(model.model)
    model.close()


def llama_parses(llama_vocab: Any, text: str) -> bool:
    llama_cpp, vocab = llama_vocab
    assert llama_cpp.LlamaGrammar.from_string(text, verbose=False)  # what the server does first
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def test_llama_cpp_parses_the_grammars(llama_vocab: Any) -> None:
    assert not llama_parses(llama_vocab, "root ::= undefined-rule")  # the check can fail
    assert llama_parses(llama_vocab, call_grammar(REAL_TOOLS))
    assert llama_parses(llama_vocab, gbnf.value_grammar())
    assert llama_parses(llama_vocab, gbnf.value_grammar(NOT_SCHEMA))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=tool_lists())
def test_llama_cpp_parses_the_grammar_of_random_tools(llama_vocab: Any, tools: list[ToolSpec]) -> None:
    assert llama_parses(llama_vocab, call_grammar(tools))
