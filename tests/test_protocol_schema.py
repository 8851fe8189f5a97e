"""``protocol/schema.json`` and the SPEC's field tables are generated from the models and current; the
SPEC's prose states the same constants the code uses."""

from __future__ import annotations

import json
import re

from controller import client
from protocol import ERROR_KINDS
from protocol.codec import MAX_FRAME_BYTES, PEEK_BYTES, SOCKET_MAX_FRAME_BYTES
from protocol.messages import BY_KIND, MAX_TIMEOUT_S
from protocol.schema import BEGIN, END, SCHEMA_PATH, SPEC_PATH, json_schema, main, schema_text, tables_markdown
from protocol.values import CONTAINER_COST, MAX_DEPTH, MAX_ELEMENTS

SPEC = SPEC_PATH.read_text()


def test_schema_json_and_the_spec_tables_are_current() -> None:
    assert SCHEMA_PATH.read_text() == schema_text(), "run: python -m protocol.schema"
    assert SPEC[SPEC.index(BEGIN) + len(BEGIN) : SPEC.index(END)].strip() == tables_markdown().strip()
    assert main(["--check"]) == 0


def test_every_message_kind_has_a_schema_and_a_table() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert set(schema["messages"]) == set(BY_KIND)
    for kind, model in BY_KIND.items():
        assert schema["$defs"][model.__name__]["x-kind"] == kind
        assert f"#### `{kind}` ({model.__name__})" in SPEC


def test_every_field_of_every_type_has_a_meaning_and_a_row() -> None:
    spec_rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", SPEC, re.M)}
    for name, definition in json_schema()["$defs"].items():
        for field, prop in definition.get("properties", {}).items():
            assert prop.get("description"), f"{name}.{field} has no meaning"
            assert field in spec_rows


def test_the_spec_table_rows_agree_with_the_schema() -> None:
    """Read the tables back: each row's default and requiredness is the schema's."""
    defs = json_schema()["$defs"]
    section = ""
    for line in SPEC[SPEC.index(BEGIN) : SPEC.index(END)].splitlines():
        if line.startswith("#### "):
            section = re.sub(r"^#### (`\w+` \()?(\w+)\)?$", r"\2", line)
            continue
        row = re.match(r"^\| `(\w+)` \| (.*?) \| (.*?) \|", line)
        if not row:
            continue
        prop = defs[section]["properties"][row.group(1)]
        default = row.group(3)
        if row.group(1) in defs[section].get("required", []):
            assert default == "required", (section, row.group(1))
        else:
            assert json.loads(default.strip("`")) == prop["default"], (section, row.group(1))


def test_the_spec_states_the_constants_the_code_uses() -> None:
    schema = json_schema()["x-ciayn"]
    assert schema["max_elements"] == MAX_ELEMENTS == 262_144 and "262,144" in SPEC
    assert schema["container_cost"] == CONTAINER_COST and f"`CONTAINER_COST` = {CONTAINER_COST}" in SPEC
    assert MAX_FRAME_BYTES == 64 * 1024 * 1024 and "67,108,864" in SPEC
    assert SOCKET_MAX_FRAME_BYTES == 128 * 1024 * 1024 and "= 128 MiB" in SPEC
    assert PEEK_BYTES == 64 * 1024 and "`PEEK_BYTES` = 64 KiB" in SPEC
    assert MAX_DEPTH == 64 and "`MAX_DEPTH` = 64" in SPEC
    assert MAX_TIMEOUT_S == 86_400 and "86,400" in SPEC
    assert f"`DEADLINE_GRACE` = {client.DEADLINE_GRACE:g} s" in SPEC
    assert f"`HEARTBEAT_INTERVAL` = {client.HEARTBEAT_INTERVAL:g} s" in SPEC
    assert f"`SILENCE_BEFORE_RECONNECT` = {client.SILENCE_BEFORE_RECONNECT:g} s" in SPEC
    assert f"`UNAVAILABLE_AFTER` = {client.UNAVAILABLE_AFTER:g} s" in SPEC
    assert f"`FIRST_CONTACT_WAIT` = {client.FIRST_CONTACT_WAIT:g} s" in SPEC
    from executor.keeper import TEMPLATE_START_TIMEOUT  # an executor still loading its tools is waited for

    assert client.FIRST_CONTACT_WAIT > TEMPLATE_START_TIMEOUT and f"up to {TEMPLATE_START_TIMEOUT:g} s" in SPEC


def test_the_spec_lists_every_error_kind() -> None:
    table = SPEC[SPEC.index("### Error kinds") :]
    for kind in ERROR_KINDS:
        assert f"| `{kind}` |" in table


def test_the_executor_options_the_spec_names_exist() -> None:
    from executor.cli import build_parser

    serve = build_parser().parse_args(["serve", "--tools", "x", "--bind", "ipc:///x"])
    for option in ("--max-queue", "--max-queue-mb", "--max-queue-wait", "--insecure", "--curve-secret",
                   "--curve-clients"):
        assert f"`{option}`" in SPEC
        assert hasattr(serve, option.lstrip("-").replace("-", "_"))
