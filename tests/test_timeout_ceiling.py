"""``--max-timeout``: the operator's ceiling on how long any call runs (issue 24). ``--timeout`` is a
default that a tool's own ``@tool(timeout=...)`` and a call's own timeout override, longer or
shorter; the ceiling holds whichever of the three asks for more, on a single executor and through a
broker (which also cuts what an executor announces as its default). Real executors, a real broker,
real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller import ExecutorClient
from executor.cli import main
from executor.status import fetch
from protocol import Call, Result
from tests.support.pool import Pool
from tests.support.waiting import wait_until

CEILING_TOOLS = str(Path(__file__).parent / "tools" / "ceiling.py")  # patient: @tool(timeout=60); plain: none
EXECUTOR = [sys.executable, "-m", "executor.cli"]
CUT_WITHIN = 10.0  # a call cut at 1 s is answered well within this on a loaded machine; uncut it sleeps 30 s


def _timed(client: ExecutorClient, call: Call) -> tuple[Result, float]:
    started = time.monotonic()
    result = client.call(call)
    return result, time.monotonic() - started


def _ran_under_one_second(result: Result) -> bool:
    """Its limits say 1 s (less what it waited in the executor's queue, a few milliseconds)."""
    return result.limits is not None and 0.9 < result.limits.timeout_s <= 1.0


def _assert_cut_at_one_second(result: Result, took: float, asked: str) -> None:
    assert not result.ok and result.error is not None and result.error.kind == "timeout", result
    assert _ran_under_one_second(result), result.limits
    assert took < CUT_WITHIN, f"the call ran {took:.1f} s under a 1 s ceiling"
    assert asked in result.error.message and "--max-timeout" in result.error.message, result.error.message


# ---------------------------------------------------------------- one executor


def test_the_ceiling_cuts_a_tools_own_timeout_and_a_calls_own_timeout(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[CEILING_TOOLS], max_timeout=1)
    result, took = _timed(client, Call(tool="patient"))
    _assert_cut_at_one_second(result, took, "its tool's timeout was 60 s")
    result, took = _timed(client, Call(tool="plain", timeout=20.0))
    _assert_cut_at_one_second(result, took, "its own timeout was 20 s")
    quick = client.call(Call(tool="plain", kwargs={"seconds": 0.0}, timeout=0.5))
    assert quick.ok and quick.limits is not None and 0.4 < quick.limits.timeout_s <= 0.5  # a shorter one stands


def test_the_default_timeout_is_at_most_the_ceiling_and_a_default_over_it_is_refused(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[CEILING_TOOLS], max_timeout=1)
    assert client.welcome is not None and client.welcome.limits.timeout_s == 1.0
    result, took = _timed(client, Call(tool="plain"))
    assert not result.ok and result.error is not None and result.error.kind == "timeout", result
    assert _ran_under_one_second(result) and took < CUT_WITHIN, (result.limits, took)

    out = subprocess.run([*EXECUTOR, "serve", "--tools", CEILING_TOOLS, "--bind", "ipc:///tmp/never/x.sock",
                          "--timeout", "60", "--max-timeout", "10"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out
    assert "--timeout 60 is over --max-timeout 10" in out.stderr, out.stderr


def test_the_ceiling_is_reported_in_the_welcome_and_in_status(
        make_client: Callable[..., ExecutorClient], capsys: pytest.CaptureFixture[str]) -> None:
    client = make_client(tools=[CEILING_TOOLS], max_timeout=2.5)
    assert client.welcome is not None and client.welcome.max_timeout_s == 2.5
    endpoint = client.local.endpoint  # type: ignore[attr-defined]
    report = fetch(endpoint)
    assert report.max_timeout_s == 2.5 and report.executors[0].max_timeout_s == 2.5
    assert main(["status", endpoint]) == 0
    assert "max timeout 2.5s" in capsys.readouterr().out
    unbounded = make_client(tools=[CEILING_TOOLS])
    assert unbounded.welcome is not None and unbounded.welcome.max_timeout_s == 86400.0


def test_help_says_what_wins_over_what() -> None:
    serve = subprocess.run([*EXECUTOR, "serve", "--help"], capture_output=True, text=True, timeout=30).stdout
    flat = " ".join(serve.split())
    assert "a call's own timeout wins over its tool's @tool(timeout=...), which wins over this one" in flat
    assert "--max-timeout S" in flat and "a ceiling on every timeout, whether the call, its tool or --timeout" in flat
    broker = " ".join(subprocess.run([*EXECUTOR, "broker", "--help"], capture_output=True, text=True,
                                     timeout=30).stdout.split())
    assert "--max-timeout S" in broker and "an executor's announced default is trusted only up to it" in broker


@pytest.mark.parametrize("flag", ["--timeout", "--max-timeout"])
def test_a_timeout_over_a_day_is_refused(flag: str) -> None:
    out = subprocess.run([*EXECUTOR, "serve", "--tools", CEILING_TOOLS, "--bind", "ipc:///tmp/never/x.sock",
                          flag, "100000"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and f"{flag} must be at most 86400 seconds" in out.stderr, out


# ---------------------------------------------------------------- a broker


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path)
    yield p
    p.stop()


def test_a_brokers_ceiling_holds_for_every_source_of_a_timeout(pool: Pool) -> None:
    """The executor has no ceiling of its own and a default of 60 s: the broker cuts the tool's 60 s,
    the call's 20 s and the executor's default 60 s to its 1 s, and the executor itself stops the call
    there (its own timeout answer, not the broker giving up on it)."""
    pool.start_broker("--max-timeout", "1")
    pool.add_executor([CEILING_TOOLS], 1, "--timeout", "60")
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend) as client:
        client.tools()
        welcome = client.welcome
        assert welcome is not None and welcome.max_timeout_s == 1.0 and welcome.limits.timeout_s == 1.0
        for call in (Call(tool="patient"), Call(tool="plain", timeout=20.0), Call(tool="plain")):
            result, took = _timed(client, call)
            assert not result.ok and result.error is not None and result.error.kind == "timeout", (call, result)
            assert "ran past its 1 s time limit" in result.error.message, result.error.message
            assert _ran_under_one_second(result) and took < CUT_WITHIN, (result.limits, took)
    report = fetch(pool.frontend)
    assert report.max_timeout_s == 1.0 and [e.max_timeout_s for e in report.executors] == [1.0]
    assert json.loads(report.model_dump_json())["max_timeout_s"] == 1.0


def test_a_call_in_flight_keeps_its_answer_across_a_broker_restarted_with_another_ceiling(pool: Pool) -> None:
    """The broker sends its ceiling as the call's max_timeout, which is not part of the call's
    identity: the client's resend through a broker restarted with another ceiling joins the running
    call. Before (the ceiling written into the call's timeout) the executor refused the resend as
    another call under the id, and that refusal was the call's answer."""
    pool.start_broker("--max-timeout", "5")
    pool.add_executor([CEILING_TOOLS], 1)
    pool.wait_for_executors(1)
    with ExecutorClient(pool.frontend, timeout=30) as client:
        client.tools()
        future = client.submit(Call(tool="patient", kwargs={"seconds": 2.0}))
        wait_until("the call to run", lambda: (r := pool.status(0.5)) is not None and r.busy == 1)
        assert pool.broker is not None
        pool.kill(pool.broker)
        pool.start_broker("--max-timeout", "10", recovery_s=3.0)  # the executors re-announce what they hold
        result = future.result(timeout=60)
    assert result.ok and result.value == "woke", result
    assert result.limits is not None and 4.5 < result.limits.timeout_s <= 5.0  # it ran under the first ceiling
