"""The parent-directory swap race, run for real: while a process exchanges a workspace directory with
a symlink to a directory outside (``renameat2(RENAME_EXCHANGE)`` in a tight loop), the built-in file
tools read, list, write and create parents through that directory, and nothing outside is ever read
or written.

The tools run in a real executor (``--workspace``) and, for many more attempts per second, in this
process. A run lasts until enough calls have both won (saw the directory) and been refused (saw the
symlink), which proves the swap really raced them, or until its time bound. The last test runs the
same race against the realpath fallback (no openat2) and expects it to lose: it shows the race here
has teeth, so the passing tests mean something."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import BUILTIN, TESTS

from controller import ExecutorClient
from executor.toolkits import builtin, paths

WITHOUT_OPENAT2 = str(TESTS / "tools" / "without_openat2.py")
RACE_MAX_S = 20.0  # the bound on one race; it usually ends far sooner (see Race.done)
SWAPPER_MAX_S = 3 * RACE_MAX_S  # the swapper's own bound, in case the test dies before killing it
MIN_WON = MIN_REFUSED = 20
SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
a, b, until = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2]), time.monotonic() + float(sys.argv[3])
print("swapping", flush=True)
while time.monotonic() < until:
    for _ in range(1000):
        if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
            sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""
# Each call goes through the raced directory "d"; "s" is the symlink it is exchanged with.
CALLS: list[tuple[str, dict[str, object]]] = [
    ("read_file", {"path": "d/f.txt"}),
    ("read_file", {"path": "d/../d/f.txt"}),
    ("list_dir", {"path": "d"}),
    ("write_file", {"path": "d/written.txt", "content": "inside"}),
    ("write_file", {"path": "d/made/deeper/new.txt", "content": "inside"}),
]


@dataclass
class Race:
    """Outcomes of the calls made while the swapper ran."""

    won: int = 0  # the call worked (it must have worked inside)
    refused: int = 0  # the call was refused (it saw the symlink)
    escaped: list[str] = field(default_factory=list)  # evidence that something outside was reached

    def done(self) -> bool:
        return self.won >= MIN_WON and self.refused >= MIN_REFUSED


@dataclass
class Arena:
    ws: Path
    outside: Path

    def outside_state(self) -> dict[str, bytes | None]:
        found: dict[str, bytes | None] = {}
        for dirpath, dirnames, filenames in os.walk(self.outside):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                found[str(p.relative_to(self.outside))] = p.read_bytes() if p.is_file() else None
        return found


@pytest.fixture
def arena(tmp_path: Path) -> Arena:
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f.txt").write_text("inside")
    outside.mkdir()
    (outside / "f.txt").write_text("SECRET")
    (outside / "outside-marker").write_text("SECRET")
    (ws / "s").symlink_to(outside, target_is_directory=True)
    return Arena(ws, outside)


@pytest.fixture
def swapping(arena: Arena) -> Iterator[None]:
    """A process exchanging ``ws/d`` and ``ws/s`` as fast as it can until the test ends (killed then)."""
    args = [str(arena.ws / "d"), str(arena.ws / "s"), str(SWAPPER_MAX_S)]
    proc = subprocess.Popen([sys.executable, "-c", SWAPPER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"swapping\n"
    yield
    proc.kill()
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -9, f"the swapper stopped by itself: {err.decode(errors='replace')}"


def judge(race: Race, tool: str, ok: bool, result: object) -> None:
    """Count one outcome; a read that shows anything of outside is an escape."""
    if not ok:
        race.refused += 1
        return
    race.won += 1
    if "SECRET" in str(result) or "outside-marker" in str(result):
        race.escaped.append(f"{tool} returned {result!r}")


def run_race(call: Callable[[str, dict[str, object]], tuple[bool, object]], stop: Callable[[Race], bool],
             within: float = RACE_MAX_S) -> Race:
    """Make the calls in turn until ``stop`` says so or ``within`` seconds have passed."""
    race = Race()
    deadline = time.monotonic() + within
    while not stop(race) and time.monotonic() < deadline:
        for tool, kwargs in CALLS:
            ok, result = call(tool, kwargs)
            judge(race, tool, ok, result)
    return race


def done_or_escaped(race: Race) -> bool:
    return race.done() or bool(race.escaped)


def executor_call(client: ExecutorClient) -> Callable[[str, dict[str, object]], tuple[bool, object]]:
    def call(tool: str, kwargs: dict[str, object]) -> tuple[bool, object]:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        r = client.call_text(f"{tool}({args})")
        if not r.ok:
            assert r.error is not None and r.error.kind == "tool_error", r.error
            return False, f"{r.error.type}: {r.error.message}"
        return True, r.value

    return call


def in_process_call(tool: str, kwargs: dict[str, object]) -> tuple[bool, object]:
    try:
        return True, getattr(builtin, tool)(**kwargs)
    except OSError as e:
        return False, e


def assert_nothing_outside_was_touched(arena: Arena, race: Race, before: dict[str, bytes | None]) -> None:
    assert race.escaped == []
    assert arena.outside_state() == before, "something outside the workspace was written"


@pytest.fixture
def need_openat2() -> None:
    if paths.openat2_missing() is not None:
        pytest.skip(f"openat2 is not usable here: {paths.openat2_missing()}")


@pytest.mark.usefixtures("need_openat2")
def test_swap_race_through_a_real_executor_never_reaches_outside(
    arena: Arena, make_client: Callable[..., ExecutorClient], request: pytest.FixtureRequest
) -> None:
    client = make_client(tools=[BUILTIN], workspace=arena.ws, timeout=10, workers=2)
    before = arena.outside_state()
    request.getfixturevalue("swapping")
    race = run_race(executor_call(client), done_or_escaped)
    assert_nothing_outside_was_touched(arena, race, before)
    assert race.done(), f"the swap did not race the calls within the bound: {race}"


@pytest.mark.usefixtures("need_openat2", "swapping")
def test_swap_race_in_process_never_reaches_outside(arena: Arena, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CIAYN_WORKSPACE", str(arena.ws))
    before = arena.outside_state()
    race = run_race(in_process_call, lambda race: bool(race.escaped), within=5.0)  # thousands of calls
    assert_nothing_outside_was_touched(arena, race, before)
    assert race.done(), f"the swap did not race the calls within the bound: {race}"


def test_the_same_race_defeats_the_realpath_fallback(
    arena: Arena, make_client: Callable[..., ExecutorClient], request: pytest.FixtureRequest
) -> None:
    """Not a property we want but the proof that the race above is real: without openat2 (a seccomp
    filter hides it), the old check loses to the swap within the bound."""
    if platform.machine() != "x86_64":
        pytest.skip("the seccomp filter that hides openat2 is written for x86-64")
    client = make_client(tools=[WITHOUT_OPENAT2, BUILTIN], workspace=arena.ws, timeout=10, workers=2)
    before = arena.outside_state()
    request.getfixturevalue("swapping")
    race = run_race(executor_call(client), lambda race: bool(race.escaped) or arena.outside_state() != before)
    assert race.escaped or arena.outside_state() != before, f"the fallback was not beaten within the bound: {race}"
