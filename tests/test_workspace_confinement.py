"""Workspace confinement of the built-in toolkit through a real executor started with ``--workspace``:
paths that lead out (``..``, absolute, symlinks, hard links) are refused in the worker, nothing
outside changes, and ``read_file`` costs what the file holds, not ``max_bytes``.

Each test runs twice: on this kernel (openat2), and in an executor whose template and workers get
ENOSYS for openat2 from a seccomp filter (``tests/tools/without_openat2.py``), as on a kernel before
5.6, where the realpath fallback must still refuse every static escape (the rename race is
``test_workspace_race.py``)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import BUILTIN, TESTS

from controller import ExecutorClient
from executor.toolkits.paths import openat2_missing

WITHOUT_OPENAT2 = str(TESTS / "tools" / "without_openat2.py")
FALLBACK_WARNING = "workspace file tools: the kernel has no openat2"


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its content (None for a directory or symlink)."""
    found: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            found[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return found


def tool_modules(mode: str) -> list[str]:
    if mode == "fallback":
        if platform.machine() != "x86_64":
            pytest.skip("the seccomp filter that hides openat2 is written for x86-64")
        return [WITHOUT_OPENAT2, BUILTIN]  # the filter is in place before the toolkit probes
    if openat2_missing() is not None:
        pytest.skip(f"openat2 is not usable here: {openat2_missing()}")
    return [BUILTIN]


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace and, beside it, a directory ``outside`` holding a secret."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("top secret")
    return ws, outside


@pytest.fixture(params=["openat2", "fallback"])
def client(request: pytest.FixtureRequest, make_client: Callable[..., ExecutorClient],
           tree: tuple[Path, Path]) -> ExecutorClient:
    return make_client(tools=tool_modules(request.param), workspace=tree[0], timeout=10, memory_mb=256)


def refused(client: ExecutorClient, text: str) -> str:
    """The error message of a call that must fail in the tool (not crash, not time out)."""
    r = client.call_text(text)
    assert not r.ok and r.error is not None, f"{text} was not refused: {r.value!r}"
    assert r.error.kind == "tool_error", (text, r.error)
    return f"{r.error.type}: {r.error.message}"


def value(client: ExecutorClient, text: str) -> Any:
    r = client.call_text(text)
    assert r.ok, (text, r.error)
    return r.value


def test_dotdot_absolute_and_symlinked_paths_out_are_refused_and_nothing_outside_changes(
    client: ExecutorClient, tree: tuple[Path, Path]
) -> None:
    ws, outside = tree
    (ws / "sub").mkdir()
    (ws / "file-link.txt").symlink_to(outside / "secret.txt")
    (ws / "dir-link").symlink_to(outside, target_is_directory=True)
    (ws / "relative-link").symlink_to("../outside", target_is_directory=True)
    (ws / "dangling.txt").symlink_to(outside / "created.txt")
    before = snapshot(outside)
    attempts = [
        'read_file(path="../outside/secret.txt")',
        'read_file(path="sub/../../outside/secret.txt")',
        f'read_file(path="{outside}/secret.txt")',
        'read_file(path="file-link.txt")',
        'read_file(path="dir-link/secret.txt")',
        'read_file(path="relative-link/secret.txt")',
        'list_dir(path="..")',
        'list_dir(path="/")',
        'list_dir(path="dir-link")',
        'write_file(path="../outside/new.txt", content="x")',
        f'write_file(path="{outside}/new.txt", content="x")',
        'write_file(path="file-link.txt", content="overwritten")',
        'write_file(path="dir-link/new.txt", content="x")',
        'write_file(path="dir-link/made/deep.txt", content="x")',
        'write_file(path="relative-link/made/deep.txt", content="x")',
        'write_file(path="dangling.txt", content="x")',
    ]
    for text in attempts:
        message = refused(client, text)
        assert message.startswith("PermissionError: path") and "is outside the workspace" in message, (text, message)
    assert snapshot(outside) == before


def test_paths_that_stay_inside_work_through_symlinks_dotdot_and_absolute_paths(
    client: ExecutorClient, tree: tuple[Path, Path]
) -> None:
    ws, _ = tree
    (ws / "real").mkdir()
    (ws / "alias").symlink_to("real", target_is_directory=True)
    (ws / "absolute-alias").symlink_to(ws / "real", target_is_directory=True)
    assert value(client, 'write_file(path="alias/a/b.txt", content="one")') == "wrote 3 bytes to alias/a/b.txt"
    assert value(client, f'read_file(path="{ws}/real/a/b.txt")') == "one"
    assert value(client, 'read_file(path="absolute-alias/a/../a/b.txt")') == "one"
    assert value(client, 'list_dir(path="absolute-alias")') == ["a/"]
    assert (ws / "real" / "a" / "b.txt").read_text() == "one"


def test_a_hard_link_to_a_file_outside_is_never_written_through(
    client: ExecutorClient, tree: tuple[Path, Path]
) -> None:
    ws, outside = tree
    os.link(outside / "secret.txt", ws / "planted.txt")
    message = refused(client, 'write_file(path="planted.txt", content="overwritten")')
    assert message.startswith("PermissionError: 'planted.txt' has 2 hard links")
    assert (outside / "secret.txt").read_text() == "top secret"
    # Reading it is allowed, and documented: it reads what the link's maker could already read.
    assert value(client, 'read_file(path="planted.txt")') == "top secret"


def test_read_file_with_a_huge_max_bytes_costs_only_the_file(client: ExecutorClient, tree: tuple[Path, Path]) -> None:
    """The worker's memory limit is 256 MiB: allocating max_bytes up front would be a MemoryError."""
    ws, _ = tree
    (ws / "small.txt").write_text("small\n")
    r = client.call_text('read_file(path="small.txt", max_bytes=10000000000)')
    assert r.ok and r.value == "small\n", r.error
    assert r.stats is not None and r.stats.peak_rss_kb < 256 * 1024


def test_the_executor_log_says_once_at_start_up_when_openat2_is_missing(
    make_client: Callable[..., ExecutorClient], tree: tuple[Path, Path]
) -> None:
    ws, _ = tree
    without = make_client(tools=tool_modules("fallback"), workspace=ws, timeout=10)
    plain = make_client(tools=tool_modules("openat2"), workspace=ws, timeout=10)
    assert value(without, "openat2_errno()") == 38  # ENOSYS in the workers: the fallback is what serves
    for _ in range(3):  # calls in fresh workers do not repeat it
        assert "outside the workspace" in refused(without, 'read_file(path="../outside/secret.txt")')
        assert value(plain, 'list_dir(path=".")') == []
    logs = [c.local.log_path.read_text() for c in (without, plain)]  # type: ignore[attr-defined]
    assert logs[0].count(FALLBACK_WARNING) == 1, logs[0]
    assert "realpath check" in logs[0] and "--profile hardened" in logs[0]
    assert "openat2" not in logs[1], logs[1]
