"""The conformance vectors in ``protocol/vectors/`` (SPEC.md section 11): each case's frames decode to
the expected message or fail with the expected reply, in the codec and, for what a client sends, in a
real executor answering over a real socket; and each resend case (``resend.json``, SPEC.md section 8)
has the canonical keys it gives, and is answered from the first call's result or refused as another
call, as it says."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from controller import ExecutorClient
from protocol import Call, Pong, ProtocolError, Result, decode, resend_key
from protocol.codec import valid_id
from tests.support.pool import Pool

VECTORS = Path(__file__).parent.parent / "protocol" / "vectors"
CASES: list[dict[str, Any]] = [c for f in sorted(VECTORS.glob("*.json"))
                               for c in json.loads(f.read_text()).get("cases", [])]
RESENDS: list[dict[str, Any]] = json.loads((VECTORS / "resend.json").read_text())["resends"]
RESEND_ECHO = str(Path(__file__).parent / "tools" / "resend_echo.py")  # echo(*args, **kwargs): a token per run
SENT_BY_CLIENTS = {"call", "ping", "cancel", "hello", "status"}


def _frames(case: dict[str, Any], which: str = "frames") -> list[bytes]:
    return [base64.b64decode(f) for f in case[which]]


def _plain(value: Any) -> Any:
    """A decoded field as the vector writes it: bytes as {"$base64": ...}."""
    if isinstance(value, bytes):
        return {"$base64": base64.b64encode(value).decode()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_there_are_vectors_for_every_outcome() -> None:
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names)) >= 50
    outcomes = {(c["expect"]["outcome"], c["expect"].get("reply"), c["expect"].get("kind")) for c in CASES}
    assert {("message", None, None), ("error", "result", "protocol"), ("error", "result", "bad_arguments"),
            ("error", "pong", "protocol")} <= outcomes


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"]) for c in CASES])
def test_the_codec_meets_the_vector(case: dict[str, Any]) -> None:
    expect = case["expect"]
    if expect["outcome"] == "message":
        msg = decode(_frames(case))
        assert expect["kind_of_message"] == msg.KIND
        assert _plain(msg.model_dump(mode="python")) == expect["fields"]
        return
    with pytest.raises(ProtocolError) as caught:
        decode(_frames(case))
    reply = caught.value.reply()
    assert expect["reply"] == reply.KIND
    assert caught.value.error.kind == expect["kind"]
    if isinstance(reply, Pong):
        assert reply.nonce == expect["nonce"] and reply.error is not None
    else:
        assert isinstance(reply, Result) and reply.id == expect["id"] and not reply.ok


@pytest.fixture
def wire(make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    """A raw DEALER connected to a real executor, as a client in another language would be."""
    sock: zmq.Socket[bytes] = dealer(make_client().endpoint)
    return sock


def _answer(sock: zmq.Socket[bytes], frames: list[bytes]) -> Any:
    sock.send_multipart(frames)
    return decode(sock.recv_multipart())


def test_a_real_executor_answers_every_client_vector_as_the_vector_says(wire: zmq.Socket[bytes]) -> None:
    """One executor, every case a client could send it, in turn: each gets the expected reply, the
    executor keeps answering, and no reply is lost or mismatched."""
    checked = 0
    for case in CASES:
        frames, expect = _frames(case), case["expect"]
        kind = frames[1].decode(errors="replace") if len(frames) > 1 else ""
        if expect["outcome"] == "message":
            if kind == "call":
                reply = _answer(wire, frames)  # the tool "f" does not exist: answered, with the id
                assert isinstance(reply, Result) and reply.id == expect["fields"]["id"], case["name"]
            elif kind == "ping":
                reply = _answer(wire, frames)
                assert isinstance(reply, Pong) and reply.nonce == expect["fields"]["nonce"] and reply.error is None
            else:
                continue
        elif kind in SENT_BY_CLIENTS or kind not in {"result", "welcome", "pong", "report"}:
            reply = _answer(wire, frames)
            assert expect["reply"] == reply.KIND, (case["name"], reply)
            assert reply.error is not None and reply.error.kind == expect["kind"], (case["name"], reply)
            if isinstance(reply, Pong):
                assert reply.nonce == expect["nonce"], case["name"]
            else:
                assert reply.id == expect["id"], (case["name"], reply)
        else:
            continue
        checked += 1
    assert checked >= 40
    pong = _answer(wire, [b"ciayn/1", b"ping", b"\x81\xa5nonce\x2a"])
    assert isinstance(pong, Pong) and pong.nonce == 42 and pong.error is None


def test_vector_ids_are_valid_or_empty() -> None:
    for case in CASES:
        echoed = case["expect"].get("id")
        assert echoed is None or echoed == "" or valid_id(echoed) == echoed
        nonce = case["expect"].get("nonce")
        assert nonce is None or (isinstance(nonce, int) and not math.isnan(nonce))


def test_there_are_resend_vectors_both_ways() -> None:
    names = [c["name"] for c in RESENDS]
    assert len(names) == len(set(names)) >= 20
    assert {c["same"] for c in RESENDS} == {True, False}
    assert {"kwargs-in-another-order", "int-and-float", "a-changed-value"} <= set(names)


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"]) for c in RESENDS])
def test_the_canonical_key_meets_the_resend_vector(case: dict[str, Any]) -> None:
    first, resend = decode(_frames(case, "first")), decode(_frames(case, "resend"))
    assert isinstance(first, Call) and isinstance(resend, Call) and first.id == resend.id
    assert base64.b64encode(resend_key(first)).decode() == case["key"]
    assert base64.b64encode(resend_key(resend)).decode() == case["resend_key"]
    assert (resend_key(first) == resend_key(resend)) is case["same"]


def test_a_real_executor_answers_each_resend_as_the_vector_says(
        make_client: Callable[..., ExecutorClient], dealer: Callable[..., zmq.Socket[bytes]]) -> None:
    """The same call (reordered keyword arguments, another int width, a float 32, ...) is answered
    with the first run's result, never run again; another call under the id (1.0 for 1, another
    value, ...) is refused, and the first call's answer is not given away."""
    _resend_every_vector(dealer(make_client(tools=[RESEND_ECHO]).endpoint))


def test_a_broker_answers_each_resend_as_the_vector_says(
        tmp_path: Path, dealer: Callable[..., zmq.Socket[bytes]]) -> None:
    """The broker keeps the same rule with its own memory of the ids (SPEC.md section 12)."""
    pool = Pool(tmp_path)
    try:
        pool.start_broker()
        pool.add_executor([RESEND_ECHO], 1)
        pool.wait_for_executors(1)
        _resend_every_vector(dealer(pool.frontend))
    finally:
        pool.stop()


def _resend_every_vector(wire: zmq.Socket[bytes]) -> None:
    for case in RESENDS:
        first = _answer(wire, _frames(case, "first"))
        assert isinstance(first, Result) and first.ok, (case["name"], first)
        again = _answer(wire, _frames(case, "resend"))
        assert isinstance(again, Result) and again.id == first.id, (case["name"], again)
        if case["same"]:
            assert again.ok and again.value == first.value, (case["name"], again)
        else:
            assert not again.ok and again.error is not None and again.error.kind == "protocol", (case["name"], again)
            assert "different call" in again.error.message and again.value is None, (case["name"], again)
