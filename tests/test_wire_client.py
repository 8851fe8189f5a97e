"""``ExecutorClient`` against a hostile server on a real socket (issue 10, point 7): the client's
deadline is a bound whatever the server says, a NaN or absurd tool timeout counts as none, and a body
built to cost work is refused quickly without stalling the client's I/O thread. The "server" here is a
ROUTER socket in a thread that speaks just enough ``ciayn/1`` to be believed."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from controller import ExecutorClient, ExecutorUnavailable
from controller.client import DEADLINE_GRACE
from protocol import VERSION, Call, Limits, Result, ToolSpec, Welcome, encode
from tests.support.hostile import HostileServer
from tests.support.hostile import tool_entry as _tool

SLACK = 3.0


@pytest.fixture
def hostile() -> Iterator[Callable[..., ExecutorClient]]:
    """``hostile(tools=[...], limits={...}, on_call=...)``: a hostile server and a client of it."""
    made: list[tuple[HostileServer, ExecutorClient]] = []
    directory = Path(f"/tmp/ciayn-hostile-{uuid.uuid4().hex[:8]}")
    directory.mkdir(mode=0o700)

    def make(tools: list[dict[str, Any]] | None = None, limits: dict[str, Any] | None = None,
             on_call: Callable[[Call], list[list[bytes]]] = lambda call: []) -> ExecutorClient:
        endpoint = f"ipc://{directory}/evil-{len(made)}.sock"
        server = HostileServer(endpoint, tools if tools is not None else [_tool()], limits or {}, on_call)
        client = ExecutorClient(endpoint, connect_timeout=3)  # the server is up before the client
        made.append((server, client))
        client.tools()
        return client

    yield make
    for server, client in made:
        client.close()
        server.close()
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()


def _timed(client: ExecutorClient, call: Call, timeout: float | None = None) -> tuple[Result, float]:
    started = time.monotonic()
    result = client.call(call, timeout)
    return result, time.monotonic() - started


def test_a_server_that_always_reports_a_queue_cannot_keep_a_call_pending(
    hostile: Callable[..., ExecutorClient],
) -> None:
    """Before: each pong with ``queued`` pushed the deadline back: ``timeout=1`` never came back."""
    client = hostile()
    result, took = _timed(client, Call(tool="t"), timeout=1.0)
    assert result.error is not None and result.error.kind == "timeout", result
    assert 1.0 + DEADLINE_GRACE - 0.2 < took < 1.0 + DEADLINE_GRACE + SLACK


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e300, -5.0, 0.0], ids=["nan", "inf", "1e300", "negative", "zero"])
def test_a_welcomes_absurd_tool_timeout_counts_as_none(hostile: Callable[..., ExecutorClient], bad: float) -> None:
    """Before: a NaN tool timeout made the client's deadline NaN, which never comes."""
    client = hostile(tools=[_tool(timeout=bad)], limits={"timeout_s": 1.0})
    result, took = _timed(client, Call(tool="t"))
    assert result.error is not None and result.error.kind == "timeout", result
    assert took < 1.0 + DEADLINE_GRACE + SLACK


def test_a_result_built_to_cost_work_is_refused_quickly_and_the_client_goes_on(
    hostile: Callable[..., ExecutorClient],
) -> None:
    """Before: 16 MB of empty arrays took the client's I/O thread 8-37 s and GBs to decode."""
    def answer(call: Call) -> list[list[bytes]]:
        if call.args == ["fine"]:
            return [encode(Result(id=call.id or "", ok=True, value="fine"))]
        bomb = b"\xdc" + (1000).to_bytes(2, "big") + (b"\xdc" + (16_000).to_bytes(2, "big") + b"\x90" * 16_000) * 1000
        return [[VERSION, b"result", b"\x83\xa2id" + msgpack.packb(call.id) + b"\xa2ok\xc3\xa5value" + bomb]]

    client = hostile(on_call=answer)
    result, took = _timed(client, Call(tool="t"), timeout=20)
    assert result.error is not None and result.error.kind == "protocol", result
    assert "could not be read" in result.error.message and took < 2.0
    fine, took = _timed(client, Call(tool="t", args=["fine"]), timeout=20)
    assert fine.ok and fine.value == "fine" and took < 2.0


def test_error_and_signal_texts_from_a_server_arrive_cut_with_a_note(hostile: Callable[..., ExecutorClient]) -> None:
    """A result whose error message, traceback and signal text are a megabyte each (all of them go
    into the model's context) is read, cut to its bounds with a note saying how much was cut."""
    def answer(call: Call) -> list[list[bytes]]:
        body = {"id": call.id, "ok": False, "signals": [{"kind": "note", "message": "s" * 1_000_000}],
                "error": {"kind": "tool_error", "message": "m" * 1_000_000, "type": "T" * 1_000_000,
                          "traceback": "t" * 1_000_000}}
        return [[VERSION, b"result", msgpack.packb(body)]]

    client = hostile(on_call=answer)
    result = client.call(Call(tool="t"), timeout=20)
    assert result.error is not None and result.error.kind == "tool_error", result.error
    error, note = result.error, r"\[\.\.\. \d+ more characters cut\]$"
    assert len(error.message) <= 16384 and re.search(note, error.message), error.message[-80:]
    assert error.traceback is not None and len(error.traceback) <= 65536 and re.search(note, error.traceback)
    assert error.type is not None and len(error.type) <= 256 and re.search(note, error.type)
    assert len(result.signals[0].message) <= 16384 and re.search(note, result.signals[0].message)
    assert error.message.startswith("m" * 16000)


def test_a_welcome_with_invalid_limits_is_not_believed(hostile: Callable[..., ExecutorClient]) -> None:
    with pytest.raises(ExecutorUnavailable, match=r"a welcome this client cannot use: invalid welcome message: "
                       r"limits\.timeout_s"):
        hostile(limits={"timeout_s": math.nan})


def test_a_welcome_naming_a_tool_no_call_could_name_is_not_believed(hostile: Callable[..., ExecutorClient]) -> None:
    """A call's tool is 1 to 256 characters; a 100,000-character tool name (which would go into every
    prompt) is refused with the welcome, not carried on."""
    with pytest.raises(ExecutorUnavailable, match=r"a welcome this client cannot use: invalid welcome message: "
                       r"tools\.0\.name"):
        hostile(tools=[{**_tool(), "name": "t" * 100_000}])


def test_a_welcome_listing_more_tools_than_a_prompt_can_hold_is_not_believed(
    hostile: Callable[..., ExecutorClient],
) -> None:
    with pytest.raises(ExecutorUnavailable, match=r"a welcome this client cannot use: invalid welcome message: tools"):
        hostile(tools=[_tool(name=f"t{i}") for i in range(1025)])


def test_the_hostile_server_speaks_valid_ciayn(hostile: Callable[..., ExecutorClient]) -> None:
    """The fixture itself: a plain welcome is understood, so the findings above are the client's."""
    client = hostile(tools=[_tool(timeout=2.0)], limits={"timeout_s": 3.0})
    assert client.welcome == Welcome(executor="evil", incarnation=1, tools=[ToolSpec(name="t", signature="()",
                                                                                     timeout=2.0)],
                                     limits=Limits(timeout_s=3.0))


def test_a_flood_of_costly_messages_cannot_hold_up_the_clients_deadlines(
    hostile: Callable[..., ExecutorClient],
) -> None:
    """The server answers one call with 1,000 bodies that each cost the decoder milliseconds (seconds
    in all): the client takes messages for at most RECV_BUDGET_S per turn, so another call's deadline
    still fires on time."""
    costly = [VERSION, b"result", b"\x83\xa2id\xa3x-1\xa2ok\xc3\xa5value\xdd" + (65_000).to_bytes(4, "big")
              + b"\x90" * 65_000]

    def answer(call: Call) -> list[list[bytes]]:
        return [costly] * 1000 if call.args == ["flood"] else []

    client = hostile(on_call=answer)
    client.submit(Call(tool="t", args=["flood"]), timeout=60)
    result, took = _timed(client, Call(tool="t"), timeout=1.0)
    assert result.error is not None and result.error.kind == "timeout", result
    assert took < 1.0 + DEADLINE_GRACE + SLACK
