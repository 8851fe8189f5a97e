"""The call grammar on valid input: each accepted form parses to exactly this ``Call``.

Also the markup weak models wrap calls in, bundles, checking against tool specs, ``ToolSpec``
reflection and call fingerprints.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from protocol import CallRejected, ToolSpec, fingerprint, parse_call, parse_calls, strip_markup
from protocol.grammar import EXPECTED_SHAPE, MAX_CALLS, parse_reply
from protocol.spec import NO_DOC, BindError, ToolDefinitionError

# -- Valid forms --------------------------------------------------------------------------------------

VALID: list[tuple[str, str, str, list[Any], dict[str, Any]]] = [
    ("no-arguments", "list_dir()", "list_dir", [], {}),
    ("positional", 'read_file("a.txt")', "read_file", ["a.txt"], {}),
    ("single-quotes", "read_file('a.txt')", "read_file", ["a.txt"], {}),
    ("keyword", 'read_file(path="a.txt")', "read_file", [], {"path": "a.txt"}),
    ("mixed", 'read_file("a.txt", start=3, lines=10)', "read_file", ["a.txt"], {"start": 3, "lines": 10}),
    ("trailing-comma", "read_file('a', )", "read_file", ["a"], {}),
    ("spaces-everywhere", "  read_file ( 'a' , start = 1 )  ", "read_file", ["a"], {"start": 1}),
    ("negative-int", "seek(-5)", "seek", [-5], {}),
    ("negative-float", "scale(-0.5)", "scale", [-0.5], {}),
    ("int-64-bit-min", "f(-9223372036854775808)", "f", [-(2**63)], {}),
    ("int-64-bit-unsigned-max", "f(18446744073709551615)", "f", [2**64 - 1], {}),
    ("hex-int", "f(0xff)", "f", [255], {}),
    ("underscore-int", "f(1_000)", "f", [1000], {}),
    ("float", "f(3.25)", "f", [3.25], {}),
    ("exponent-float", "f(1e-3)", "f", [0.001], {}),
    ("bools", "f(True, flag=False)", "f", [True], {"flag": False}),
    ("none", "f(None, default=None)", "f", [None], {"default": None}),
    ("bytes", "f(b'\\x00\\xff')", "f", [b"\x00\xff"], {}),
    ("escapes", r"f('tab\there\nnl \\ \'q\' \u00e9')", "f", ["tab\there\nnl \\ 'q' \u00e9"], {}),
    ("raw-string", r"f(r'C:\path\n')", "f", ["C:\\path\\n"], {}),
    ("non-ascii-string", "f('héllo wörld ✓')", "f", ["héllo wörld ✓"], {}),
    ("empty-containers", "f([], {}, ())", "f", [[], {}, []], {}),
    ("nested-list", "f([1, [2, [3, []]]])", "f", [[1, [2, [3, []]]]], {}),
    ("tuple-becomes-list", "f((1, 'a', (2,)))", "f", [[1, "a", [2]]], {}),
    (
        "nested-dict",
        "configure(options={'a': [1, {'b': None}], 'c': {'d': -1.5}})",
        "configure",
        [],
        {"options": {"a": [1, {"b": None}], "c": {"d": -1.5}}},
    ),
    ("negative-in-list", "f([-1, -2.5])", "f", [[-1, -2.5]], {}),
    ("implicit-concatenation", "f('a' 'b' \"c\")", "f", ["abc"], {}),
    ("bytes-concatenation", "f(b'a' b'b')", "f", [b"ab"], {}),
    ("fstring-without-fields", "f(f'plain')", "f", ["plain"], {}),
    ("fstring-concatenated", "f('a' f'b' 'c')", "f", ["abc"], {}),
    ("fstring-escaped-braces", "f(f'{{x}}')", "f", ["{x}"], {}),
    ("parenthesised-callee", "(f)(1)", "f", [1], {}),
    ("parenthesised-argument", "f((1))", "f", [1], {}),
    ("minus-parenthesised-number", "f(-(1))", "f", [-1], {}),
    ("multi-line-call", "write_file(\n    path='a.txt',\n    content='x',\n)", "write_file", [], {
        "path": "a.txt", "content": "x"}),
    ("triple-quoted", 'write_file("a", """line 1\nline "2"\n""")', "write_file", ["a", 'line 1\nline "2"\n'], {}),
    ("trailing-comment", "read_file('a')  # the config", "read_file", ["a"], {}),
    ("leading-comment", "# first the config\nread_file('a')", "read_file", ["a"], {}),
    ("hash-in-string", "f('# not a comment')", "f", ["# not a comment"], {}),
    ("trailing-semicolon", "f(1);", "f", [1], {}),
    ("tab-indent", "\tf(1)", "f", [1], {}),
    ("underscore-names", "_private_tool(_arg=1)", "_private_tool", [], {"_arg": 1}),
    ("think-tag-in-string", "f('<think>x</think>')", "f", ["<think>x</think>"], {}),
    ("fence-in-string", "f('```python')", "f", ["```python"], {}),
    ("brackets-in-string", "f('((((((((((((((((((((((((((((((((((((')", "f", ["(" * 36], {}),
]


@pytest.mark.parametrize(("text", "tool", "args", "kwargs"), [pytest.param(*row[1:], id=row[0]) for row in VALID])
def test_valid_call_parses_exactly(text: str, tool: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    call = parse_call(text)
    assert (call.tool, call.args, call.kwargs) == (tool, args, kwargs)
    assert call.id is None and call.timeout is None
    assert parse_calls(text) == [call]


def test_values_keep_their_types() -> None:
    call = parse_call("f(1, 1.0, True, '1', b'1', None)")
    assert [type(v) for v in call.args] == [int, float, bool, str, bytes, type(None)]


def _file_content() -> str:
    """About 20 KB of awkward file text: quotes of every kind, backslashes, fence lines."""
    chunk = (
        "# Notes\n"
        "He said \"hi\" and 'bye'; a ''' triple, a \\ backslash, a \\n that is not a newline.\n"
        "```python\n"
        "print('fenced')\n"
        "```\n"
        "~~~\n"
        "<think>not a think block</think> `backticks` {braces} [brackets] (parens) # hash\n"
        "\ttabbed line with trailing spaces   \n"
    )
    return (chunk * (20_000 // len(chunk) + 1))[:20_000]


def _triple_quoted(content: str) -> str:
    return '"""' + content.replace("\\", "\\\\").replace('"', '\\"') + '"""'


def test_a_20kb_file_argument_survives_exactly() -> None:
    content = _file_content()
    call = parse_call(f"write_file(path='notes.md', content={_triple_quoted(content)})")
    assert call.tool == "write_file"
    assert call.kwargs == {"path": "notes.md", "content": content}
    assert len(content) == 20_000


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param("```python\n{}\n```", id="python-fence"),
        pytest.param("```\n{}\n```", id="bare-fence"),
        pytest.param("Here is the file:\n```python\n{}\n```\nDone.", id="prose-around-fence"),
        pytest.param("<think>write it</think>\n{}", id="think-before"),
    ],
)
def test_a_20kb_file_with_fence_lines_survives_markup(wrap: str) -> None:
    content = _file_content()
    call = parse_call(wrap.format(f"write_file('notes.md', {_triple_quoted(content)})"))
    assert call.args == ["notes.md", content]


# -- Markup around a call --------------------------------------------------------------------------

READ_A: tuple[str, list[Any], dict[str, Any]] = ("read_file", ["a.txt"], {})

MARKUP: list[tuple[str, str]] = [
    ("python-fence", "```python\nread_file('a.txt')\n```"),
    ("python3-fence", "```python3\nread_file('a.txt')\n```"),
    ("bare-fence", "```\nread_file('a.txt')\n```"),
    ("language-word-fence", "```tool_code\nread_file('a.txt')\n```"),
    ("tilde-fence", "~~~\nread_file('a.txt')\n~~~"),
    ("tilde-python-fence", "~~~python\nread_file('a.txt')\n~~~"),
    ("four-backtick-fence", "````python\nread_file('a.txt')\n````"),
    ("indented-fence", "  ```python\n  read_file('a.txt')\n  ```"),
    ("single-backticks", "`read_file('a.txt')`"),
    ("single-backtick-unclosed", "`read_file('a.txt')"),
    ("missing-closing-fence", "```python\nread_file('a.txt')"),
    ("crlf-fence", "```python\r\nread_file('a.txt')\r\n```\r\n"),
    ("cr-only-line-ends", "```python\rread_file('a.txt')\r```"),
    ("prose-before-fence", "I will read the file.\n```python\nread_file('a.txt')\n```"),
    ("prose-after-fence", "```python\nread_file('a.txt')\n```\nThis shows the file."),
    ("prose-around-fence", "Let me look.\n\n```python\nread_file('a.txt')\n```\n\nThen I will decide."),
    ("prose-after-fence-is-never-code", "```python\nread_file('a.txt')\n```\nimport os"),
    ("one-line-fence", "```read_file('a.txt')```"),
    ("one-line-fence-with-language", "```python read_file('a.txt')```"),
    ("one-line-fence-py", "```py read_file('a.txt')```"),
    ("one-line-fence-unclosed", "```python read_file('a.txt')"),
    ("think-before", "<think>The user wants a.txt.</think>\nread_file('a.txt')"),
    ("think-uppercase", "<THINK>hm</Think>read_file('a.txt')"),
    ("think-multi-line", "<think>\nstep 1\nstep 2\n</think>\n\nread_file('a.txt')"),
    ("empty-think", "<think></think>read_file('a.txt')"),
    ("two-think-blocks-before", "<think>a</think>\n<think>b</think>\nread_file('a.txt')"),
    ("between-two-think-blocks", "<think>first</think>\nread_file('a.txt')\n<think>second</think>"),
    ("think-then-fence", "<think>ok</think>\n```python\nread_file('a.txt')\n```"),
    ("think-then-prose-then-fence", "<think>ok</think>Sure.\n```python\nread_file('a.txt')\n```"),
    ("think-then-backticks", "<think>ok</think> `read_file('a.txt')`"),
    ("think-with-fake-call-inside", "<think>maybe delete_all()?</think>\nread_file('a.txt')"),
    ("surrounding-whitespace", "\n\n   read_file('a.txt')   \n\n"),
]


@pytest.mark.parametrize("text", [pytest.param(t, id=i) for i, t in MARKUP])
def test_markup_around_a_call_is_removed(text: str) -> None:
    call = parse_call(text)
    assert (call.tool, call.args, call.kwargs) == READ_A


def test_think_blocks_end_at_their_first_close_tag() -> None:
    """Non-greedy: the call between two blocks is kept, not swallowed by one big block."""
    assert strip_markup("<think>a</think>\nf()\n<think>b</think>") == "f()"
    assert strip_markup("<think>a</think><think>b</think>f()") == "f()"


def test_unclosed_think_means_nothing_to_run() -> None:
    for text in ("<think>I will call read_file('a.txt')", "<think>a</think>\n<think>still going"):
        with pytest.raises(CallRejected) as caught:
            parse_call(text)
        assert caught.value.code == "empty"
        assert EXPECTED_SHAPE in str(caught.value)


def test_think_tags_inside_arguments_are_data() -> None:
    call = parse_call("<think>x</think>write_file('t.html', '<think>keep</think>')")
    assert call.args == ["t.html", "<think>keep</think>"]


def test_strip_markup_normalises_line_ends() -> None:
    assert strip_markup("```python\r\nf(\r\n1)\r\n```") == "f(\n1)"


# -- Bundles ------------------------------------------------------------------------------------------


def read_file(path: str, start: int = 0, lines: int | None = None) -> str:
    """Read a UTF-8 text file.

    Lines are counted from 0:
        start=0 is the first line.
    """
    return path


def list_dir(path: str = ".") -> list[str]:
    return []


def write_file(path: str, content: str) -> None:
    """Write a file."""


def run(cmd: str, *args: str, **env: str) -> str:
    """Run a command."""
    return cmd


def tag(a: int, /, b: int, *, c: int = 0) -> None:
    """Positional-only, normal and keyword-only parameters."""


TOOLS = {
    s.name: s
    for s in (
        ToolSpec.from_function(read_file, bundleable=True, idempotent=True),
        ToolSpec.from_function(list_dir, bundleable=True),
        ToolSpec.from_function(write_file, no_repeat=True),
        ToolSpec.from_function(run),
        ToolSpec.from_function(tag),
    )
}


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("read_file('a')\nlist_dir('.')\nread_file('b')", id="newlines"),
        pytest.param("read_file('a'); list_dir('.'); read_file('b')", id="semicolons"),
        pytest.param("read_file('a')\n\nlist_dir('.');read_file('b');", id="blank-lines-and-semicolons"),
        pytest.param("```python\nread_file('a')\nlist_dir('.')\nread_file('b')\n```", id="fenced"),
        pytest.param("<think>three reads</think>\nread_file('a')\nlist_dir('.')\nread_file('b')", id="after-think"),
    ],
)
def test_bundle_of_bundleable_tools_keeps_order(text: str) -> None:
    calls = parse_calls(text, TOOLS)
    assert [(c.tool, c.args) for c in calls] == [("read_file", ["a"]), ("list_dir", ["."]), ("read_file", ["b"])]


@pytest.mark.parametrize(
    ("text", "code", "number", "mention"),
    [
        pytest.param("read_file('a')\nwrite_file('b', 'x')", "bundle", 2, "write_file", id="not-bundleable"),
        pytest.param("read_file('a'); nope()", "unknown_tool", 2, "nope", id="unknown-tool"),
        pytest.param("read_file(x)\nread_file('b')", "argument", 1, "Positional argument 1", id="invalid-call"),
        pytest.param("read_file('a')\nread_file()", "bad_arguments", 2, "'path'", id="missing-argument"),
        pytest.param("read_file('a')\nimport os", "not_a_call", 2, "import", id="statement"),
        pytest.param("list_dir()\nlist_dir()\nos.system('x')", "callee", 3, "bare name", id="attribute-callee"),
    ],
)
def test_bundle_is_rejected_as_a_whole_naming_the_call(text: str, code: str, number: int, mention: str) -> None:
    with pytest.raises(CallRejected) as caught:
        parse_calls(text, TOOLS)
    assert caught.value.code == code
    message = str(caught.value)
    assert f"Call {number} of your reply" in message
    assert mention in message


def test_non_bundleable_bundle_lists_the_bundleable_tools() -> None:
    with pytest.raises(CallRejected) as caught:
        parse_calls("write_file('a', 'x')\nread_file('a')", TOOLS)
    assert "list_dir, read_file" in str(caught.value)


def test_a_non_bundleable_tool_alone_is_fine() -> None:
    assert parse_calls("write_file('a', 'x')", TOOLS) == [parse_call("write_file('a', 'x')")]


def test_bundle_without_a_tool_list_is_rejected() -> None:
    with pytest.raises(CallRejected) as caught:
        parse_calls("f()\ng()")
    assert caught.value.code == "bundle"


def test_bundle_size_is_bounded() -> None:
    assert len(parse_calls("list_dir()\n" * MAX_CALLS, TOOLS)) == MAX_CALLS
    with pytest.raises(CallRejected) as caught:
        parse_calls("list_dir()\n" * (MAX_CALLS + 1), TOOLS)
    assert caught.value.code == "bundle"
    assert str(MAX_CALLS) in str(caught.value)


def test_parse_call_rejects_a_bundle() -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call("read_file('a'); read_file('b')", TOOLS)
    assert caught.value.code == "multiple"
    assert "2 statements" in str(caught.value)


# -- Checking against tool specs ----------------------------------------------------------------------


def test_known_tool_with_binding_arguments_passes() -> None:
    call = parse_call("read_file('a', lines=3)", TOOLS)
    assert (call.tool, call.args, call.kwargs) == ("read_file", ["a"], {"lines": 3})


def test_unknown_tool_lists_the_available_names() -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call("delete_everything('/')", TOOLS)
    assert caught.value.code == "unknown_tool"
    message = str(caught.value)
    assert "'delete_everything'" in message
    assert "list_dir, read_file, run, tag, write_file" in message
    assert EXPECTED_SHAPE in message


def test_unknown_tool_with_an_empty_tool_list() -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call("read_file('a')", {})
    assert "(none)" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "mentions"),
    [
        pytest.param("write_file('a')", ["missing", "'content'"], id="missing-one"),
        pytest.param("write_file()", ["missing", "'path', 'content'"], id="missing-two"),
        pytest.param("read_file('a', mode='r')", ["unexpected argument 'mode'", "path, start, lines"], id="unexpected"),
        pytest.param("read_file('a', path='b')", ["multiple values for argument 'path'"], id="duplicate"),
        pytest.param("read_file('a', 1, 2, 3)", ["takes 3 positional arguments but 4 were given"], id="too-many"),
        pytest.param("list_dir(1, 2)", ["takes 1 positional argument but 2 were given"], id="too-many-one"),
        pytest.param("tag(a=1, b=2)", ["unexpected argument 'a'"], id="positional-only-by-name"),
        pytest.param("tag(1, 2, 3)", ["takes 2 positional arguments but 3 were given"], id="keyword-only-by-position"),
        pytest.param("run(args='x')", ["missing", "'cmd'"], id="var-positional-name-is-not-a-keyword"),
    ],
)
def test_arguments_that_do_not_bind_name_the_parameter(text: str, mentions: list[str]) -> None:
    with pytest.raises(CallRejected) as caught:
        parse_call(text, TOOLS)
    assert caught.value.code == "bad_arguments"
    message = str(caught.value)
    for mention in mentions:
        assert mention in message, message
    tool = text.split("(")[0]
    assert f"{tool}{TOOLS[tool].signature}" in message  # the model is shown the signature
    assert EXPECTED_SHAPE in message


def test_var_args_and_var_kwargs_bind() -> None:
    call = parse_call("run('ls', '-l', '/tmp', LANG='C', HOME='/h')", TOOLS)
    assert TOOLS["run"].bind(call.args, call.kwargs) == {
        "cmd": "ls",
        "args": ["-l", "/tmp"],
        "env": {"LANG": "C", "HOME": "/h"},
    }
    assert TOOLS["run"].bind(["ls"], {}) == {"cmd": "ls"}


def test_keyword_only_and_positional_only_bind() -> None:
    call = parse_call("tag(1, b=2, c=3)", TOOLS)
    assert TOOLS["tag"].bind(call.args, call.kwargs) == {"a": 1, "b": 2, "c": 3}


# -- ToolSpec.from_function ---------------------------------------------------------------------------


def test_spec_from_function_reflects_name_signature_and_doc() -> None:
    spec = TOOLS["read_file"]
    assert spec.name == "read_file"
    rendered = str(inspect.signature(read_file, eval_str=True))
    assert spec.signature == rendered == "(path: str, start: int = 0, lines: int | None = None) -> str"
    assert spec.doc == "Read a UTF-8 text file.\n\nLines are counted from 0:\n    start=0 is the first line."
    assert (spec.bundleable, spec.no_repeat, spec.idempotent, spec.timeout) == (True, False, True, None)
    assert [(p.name, p.kind, p.required) for p in spec.params] == [
        ("path", "positional_or_keyword", True),
        ("start", "positional_or_keyword", False),
        ("lines", "positional_or_keyword", False),
    ]


def test_spec_json_schema_has_types_and_required() -> None:
    schema = TOOLS["read_file"].parameters
    assert schema["type"] == "object"
    assert schema["required"] == ["path"]
    assert schema["properties"]["path"]["type"] == "string"
    assert schema["properties"]["start"]["type"] == "integer"
    assert schema["properties"]["start"]["default"] == 0
    assert {"type": "null"} in schema["properties"]["lines"]["anyOf"]
    assert "title" not in schema


def test_spec_schema_of_var_kwargs_allows_extra_properties() -> None:
    schema = TOOLS["run"].parameters
    assert schema["required"] == ["cmd"]
    assert set(schema["properties"]) == {"cmd"}
    assert schema["additionalProperties"] is True


def test_spec_without_docstring() -> None:
    spec = TOOLS["list_dir"]
    assert spec.doc == NO_DOC == ""  # the registry warns; the prompt shows the signature alone
    assert spec.prompt_block() == "list_dir(path: str = '.') -> list[str]"


def test_prompt_block_is_name_signature_and_docstring() -> None:
    spec = TOOLS["write_file"]
    assert spec.prompt_block() == 'write_file(path: str, content: str) -> None\n"""\nWrite a file.\n"""'


def test_spec_flags_and_name_override() -> None:
    spec = ToolSpec.from_function(write_file, name="save", no_repeat=True, timeout=5.0)
    assert spec.name == "save"
    assert (spec.bundleable, spec.no_repeat, spec.idempotent, spec.timeout) == (False, True, False, 5.0)
    assert spec.prompt_block().startswith("save(path: str, content: str)")


def test_spec_of_unannotated_function_is_untyped() -> None:
    def legacy(a, b=1):  # type: ignore[no-untyped-def]
        return a

    spec = ToolSpec.from_function(legacy)
    assert spec.signature == "(a, b=1)"
    assert spec.parameters["required"] == ["a"]
    assert "type" not in spec.parameters["properties"]["a"]


def test_spec_resolves_postponed_annotations() -> None:
    """This module uses ``from __future__ import annotations``, as tool modules often do: the
    signature must read ``path: str``, not ``path: 'str'``, and the schema must keep the types."""
    assert isinstance(read_file.__annotations__["path"], str)
    spec = TOOLS["read_file"]
    assert "'str'" not in spec.signature
    assert spec.parameters["properties"]["path"]["type"] == "string"


def test_spec_with_an_unresolvable_annotation_is_refused_naming_tool_and_parameter() -> None:
    def odd(a: int, b: itn) -> None:  # type: ignore[name-defined]  # noqa: F821
        """Odd."""

    refused = r"tool odd: the annotation of parameter 'b' \('itn'\) does not resolve"
    with pytest.raises(ToolDefinitionError, match=refused):
        ToolSpec.from_function(odd)


def test_arguments_are_checked_against_annotations_naming_the_parameter() -> None:
    def read_notes(path: str, limit: int = 10, pair: tuple[int, int] = (0, 0)) -> str:
        """Read notes."""
        return path

    spec = ToolSpec.from_function(read_notes)
    with pytest.raises(BindError, match=r"read_notes\(\) argument 'path': Input should be a valid string, got 5"):
        spec.bind([5], {})
    with pytest.raises(BindError, match=r"argument 'limit': .*valid integer, got '10'"):
        spec.bind(["a"], {"limit": "10"})
    assert spec.bind(["a"], {"limit": 3, "pair": [1, 2]}) == {"path": "a", "limit": 3, "pair": [1, 2]}
    wire = ToolSpec.model_validate(spec.model_dump())  # what the controller gets: binds by name only
    assert wire.bind([5], {}) == {"path": 5}


def test_fingerprints_apply_defaults() -> None:
    def deploy(target: str, count: int = 1) -> str:
        """Deploy."""
        return target

    spec = ToolSpec.model_validate(ToolSpec.from_function(deploy).model_dump())
    short = parse_call('deploy("prod")')
    long = parse_call('deploy(target="prod", count=1)')
    assert fingerprint(short, spec) == fingerprint(long, spec)
    assert fingerprint(short, spec) != fingerprint(parse_call('deploy("prod", 2)'), spec)


@pytest.mark.parametrize(
    ("text", "call"),
    [
        ('f("a")\n```', 'f("a")'),  # a stray closing fence after the call
        ('f("a")`', 'f("a")'),  # a trailing backtick
        ('```json f(1)```', "f(1)"),  # one-line fences with any language tag
        ("```javascript f(1)```", "f(1)"),
        ("```bash f(1)```", "f(1)"),
        ("```sql f(1)```", "f(1)"),
        ("<tool_call>f(1)</tool_call>", "f(1)"),
        ("f(1)<|im_end|>", "f(1)"),
        ("<|im_start|>assistant\nf(1)<|im_end|>", "f(1)"),
    ],
)
def test_raaid_parity_markup_forms(text: str, call: str) -> None:
    assert parse_call(text) == parse_call(call)


def test_a_call_after_leading_prose_is_found_on_its_own_line() -> None:
    assert parse_call('Sure!\ndone(summary="x")') == parse_call('done(summary="x")')
    assert parse_reply("Here you go:\nf(1)")[1] == "f(1)"
    with pytest.raises(CallRejected):
        parse_call("Sure! I will not call anything.")
    with pytest.raises(CallRejected, match="nested function call"):  # the allowlist still applies
        parse_call("Sure!\nf(g(1))")


def test_unescaped_inner_triple_quotes_are_repaired_then_checked() -> None:
    text = 'write_file("a.py", """\ndef f():\n    """doc"""\n""")'
    call = parse_call(text)
    assert call.args == ["a.py", '\ndef f():\n    """doc"""\n']
    hostile = 'write_file("a.py", """\nx\n""" + __import__("os").system("id") + """\n""")'
    with pytest.raises(CallRejected):
        parse_call(hostile)


def test_spec_of_a_pydantic_hostile_parameter_name_falls_back() -> None:
    def hostile(_private: int, model_config: str = "x") -> None:
        """Names pydantic will not take as fields."""

    spec = ToolSpec.from_function(hostile)
    assert spec.parameters["required"] == ["_private"]
    assert set(spec.parameters["properties"]) == {"_private", "model_config"}


# -- Fingerprints -------------------------------------------------------------------------------------


def _fp(text: str, spec: ToolSpec | None = None) -> str:
    return fingerprint(parse_call(text), spec)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param("f(a=1, b=2)", "f(b=2, a=1)", id="keyword-order"),
        pytest.param("f('x')", 'f("x")', id="quote-style"),
        pytest.param("f('''x''')", "f('x')", id="triple-quotes"),
        pytest.param("f(opts={'a': 1, 'b': 2})", "f(opts={'b': 2, 'a': 1})", id="dict-key-order"),
        pytest.param("f((1, 2))", "f([1, 2])", id="tuple-is-list"),
        pytest.param("f( 1 ,2 )", "f(1, 2)", id="spacing"),
        pytest.param("```python\nf(1)\n```", "f(1)", id="markup"),
    ],
)
def test_same_call_same_fingerprint(a: str, b: str) -> None:
    assert _fp(a) == _fp(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param("f('1')", "f(1)", id="str-vs-int"),
        pytest.param("f('True')", "f(True)", id="str-vs-bool"),
        pytest.param("f('None')", "f(None)", id="str-vs-none"),
        pytest.param("f(1)", "f(1.0)", id="int-vs-float"),
        pytest.param("f(1)", "f(True)", id="int-vs-bool"),
        pytest.param("f('a')", "f(b'a')", id="str-vs-bytes"),
        pytest.param("f({'a': 1})", "f([['a', 1]])", id="dict-vs-list-of-pairs"),
        pytest.param("f([1, 2])", "f([2, 1])", id="list-order"),
        pytest.param("f(1)", "g(1)", id="tool"),
        pytest.param("f(a=1)", "f(1)", id="keyword-vs-positional-without-spec"),
        pytest.param("f(1, 2)", "f([1, 2])", id="args-vs-one-list"),
    ],
)
def test_different_call_different_fingerprint(a: str, b: str) -> None:
    assert _fp(a) != _fp(b)


def test_with_a_spec_positional_and_keyword_forms_match() -> None:
    spec = TOOLS["read_file"]
    forms = [
        "read_file('a', 5)",
        "read_file(path='a', start=5)",
        "read_file(start=5, path='a')",
        "read_file('a', start=5)",
    ]
    assert len({_fp(form, spec) for form in forms}) == 1
    assert _fp("read_file('a', 5)", spec) != _fp("read_file('a', 6)", spec)
    assert _fp("read_file('a', 5)", spec) != _fp("read_file('a', '5')", spec)


def test_with_a_spec_unbindable_calls_still_get_a_fingerprint() -> None:
    spec = TOOLS["read_file"]
    assert _fp("read_file(nope=1)", spec) == _fp("read_file(nope=1)", spec)
    assert _fp("read_file(nope=1)", spec) != _fp("read_file(nope=2)", spec)


def test_fingerprint_is_a_stable_hex_digest() -> None:
    digest = _fp("f(1, a=[1, {'b': None}])")
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert digest == _fp("f(1, a=[1, {'b': None}])")
