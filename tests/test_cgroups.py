"""Per-worker control groups (as root, where cgroups are mounted): memory over the whole process
tree, a process count that binds root, and whole-group kill; removed when workers go."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from controller import ExecutorClient
from executor.workers.cgroups import CgroupSupport
from protocol import Call
from tests.conftest import TESTS

SUPPORT = CgroupSupport.detect()
pytestmark = pytest.mark.skipif(SUPPORT is None, reason="needs root and mounted cgroup hierarchies (memory/pids)")


def _groups_of(executor_id: str) -> list[Path]:
    assert SUPPORT is not None
    parents = {SUPPORT.memory_parent, SUPPORT.pids_parent, SUPPORT.kill_parent} - {None}
    return [g for parent in parents if parent is not None for g in parent.glob(f"ciayn-{executor_id}-*")]


def test_shared_memory_that_rlimits_miss_is_stopped_by_the_memory_group(
    make_client: Callable[..., ExecutorClient],
) -> None:
    if SUPPORT is None or SUPPORT.memory_parent is None:
        pytest.skip("no memory cgroup here")
    client = make_client(memory_mb=128, timeout=20)
    result = client.call(Call(tool="allocate_shared", args=[512]))
    assert result.error is not None and result.error.kind == "memory", result
    assert result.worker is not None and result.worker.restarted
    after = client.call(Call(tool="counter"))
    assert after.ok and after.value == 1  # a fresh worker


def test_without_cgroups_the_same_shared_memory_is_not_stopped(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(memory_mb=128, timeout=20, no_cgroups=True)
    result = client.call(Call(tool="allocate_shared", args=[256]))
    assert result.ok and result.value == 256 * 1024 * 1024  # what the cgroup layer adds


def test_a_fork_bomb_is_bounded_by_the_pids_group_even_as_root(make_client: Callable[..., ExecutorClient]) -> None:
    if SUPPORT is None or SUPPORT.pids_parent is None:
        pytest.skip("no pids cgroup here")
    client = make_client(max_processes=40, timeout=20)
    result = client.call(Call(tool="fork_bomb", args=[1000]))
    assert result.ok and 0 < result.value < 40, result  # the worker itself counts too
    assert client.call(Call(tool="noop")).ok


def test_each_worker_has_its_groups_and_they_are_removed_with_the_executor(
    make_client: Callable[..., ExecutorClient],
) -> None:
    client = make_client(workers=2)
    local = client.local  # type: ignore[attr-defined]
    welcome = client.welcome
    assert welcome is not None
    for _ in range(3):
        assert client.call(Call(tool="noop")).ok
        crashed = client.call(Call(tool="segfault"))
        assert crashed.error is not None and crashed.error.kind == "crashed"
    # Exactly one set of groups per live worker: none left by the workers that ran or crashed.
    deadline = time.monotonic() + 5
    while True:
        workers = [p for p in psutil.Process(local.proc.pid).children(recursive=True)
                   if p.ppid() != local.proc.pid]
        names = {g.name for g in _groups_of(welcome.executor)}
        if len(names) == len(workers) == 2:
            break
        assert time.monotonic() < deadline, (names, workers)
        time.sleep(0.02)
    client.local.stop()  # type: ignore[attr-defined]
    assert _groups_of(welcome.executor) == []


# ---------------------------------------------------------------- a dead worker's groups, reused

REUSE = str(TESTS / "tools" / "cgroup_reuse.py")
REUSE_CALLS = 12  # fresh workers on one slot: each group comes back within a few calls


def _reusing(make_client: Callable[..., ExecutorClient]) -> ExecutorClient:
    if SUPPORT is None or SUPPORT.memory_parent is None or SUPPORT.pids_parent is None:
        pytest.skip("needs memory and pids groups")
    return make_client(tools=[REUSE], workers=1, memory_mb=128, max_processes=40, timeout=20)


def _value(client: ExecutorClient, tool: str, **kwargs: object) -> object:
    result = client.call(Call(tool=tool, kwargs=kwargs))
    assert result.ok, result
    return result.value


def test_a_dead_workers_clean_groups_are_a_later_workers(make_client: Callable[..., ExecutorClient]) -> None:
    client = _reusing(make_client)
    names = [_value(client, "groups") for _ in range(REUSE_CALLS)]
    assert len(set(names)) < len(names), names  # making and removing groups costs more than a fork


def test_groups_a_call_left_memory_charged_to_are_never_a_later_workers(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = _reusing(make_client)
    try:
        left = _value(client, "leave_shared", mb=4)
        later = [_value(client, "groups") for _ in range(REUSE_CALLS)]
    finally:
        for path in Path("/dev/shm").glob("ciayn-test-left-*"):
            path.unlink()
    assert left not in later, (left, later)
    assert len(set(later)) < len(later), later  # the others were reused: the check above could fail


def test_limits_a_root_tool_lifted_bind_the_next_worker_in_its_groups_again(
        make_client: Callable[..., ExecutorClient]) -> None:
    client = _reusing(make_client)
    first = _value(client, "limits")
    assert isinstance(first, dict)
    first.pop("name")
    lifted = _value(client, "lift_limits")
    seen = []
    for _ in range(REUSE_CALLS):
        said = _value(client, "limits")
        assert isinstance(said, dict)
        seen.append(said.pop("name"))
        assert said == first, (seen[-1], said)
        if seen[-1] == lifted:
            break
    assert lifted in seen, (lifted, seen)  # the lifted groups came back, set again


def test_groups_a_root_tool_made_inside_its_own_are_removed_with_them(
        make_client: Callable[..., ExecutorClient]) -> None:
    """Before, such a group kept its parent from ever being removed, and every later try cost the
    template a wait: after about fifteen such calls the executor stopped answering."""
    client = _reusing(make_client)
    local = client.local  # type: ignore[attr-defined]
    assert client.welcome is not None
    try:
        for _ in range(20):  # each leaves /dev/shm charged too, so that its groups are not kept but removed
            assert client.call(Call(tool="nest", kwargs={"leave_shared_mb": 1}), timeout=5).ok
    finally:
        for path in Path("/dev/shm").glob("ciayn-test-left-*"):
            path.unlink()
    deadline = time.monotonic() + 5
    while True:
        try:
            workers = [p for p in psutil.Process(local.proc.pid).children(recursive=True)
                       if p.ppid() != local.proc.pid]
        except psutil.NoSuchProcess:  # a process exited between the listing and the look at it: look again
            workers = []
        names = {g.name for g in _groups_of(client.welcome.executor)}
        if len(names) == len(workers) == 1:
            break
        assert time.monotonic() < deadline, (sorted(names), workers)
        time.sleep(0.02)
