"""The bundled toolkits, called in-process on a real filesystem with real symlinks and subprocesses.

The file tools run twice: with openat2 (the kernel resolves beneath the workspace) and with the
realpath fallback used where openat2 is missing. Through a real executor: ``test_workspace_*.py``."""

from __future__ import annotations

import os
import re
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from executor import signals
from executor.registry import load_tools
from executor.toolkits import builtin, paths, shell
from executor.toolkits.builtin import complete_task, emit_note, list_dir, read_file, write_file
from executor.toolkits.shell import run_shell
from tests.support.processes import alive


@pytest.fixture(params=["openat2", "fallback"])
def ws(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A workspace, with a sibling directory ``outside`` that tools must never reach; the file tools
    resolve paths with openat2, or with the fallback check as on a kernel without it."""
    if request.param == "fallback":
        monkeypatch.setattr(paths, "openat2_missing", lambda: "no openat2 in this test")
    elif paths.openat2_missing() is not None:
        pytest.skip(f"openat2 is not usable here: {paths.openat2_missing()}")
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("top secret")
    monkeypatch.setenv("CIAYN_WORKSPACE", str(root))
    return root


@pytest.fixture
def shell_ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A workspace for run_shell, which resolves no paths (so it runs once, not per path mode)."""
    monkeypatch.setenv("CIAYN_WORKSPACE", str(tmp_path))
    return tmp_path


@pytest.fixture
def outside(ws: Path) -> Path:
    return ws.parent / "outside"


def wait_until_dead(pids: list[int], within: float = 5.0) -> list[int]:
    """The pids still alive (not gone, not a zombie) after waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        living = [pid for pid in pids if alive(pid)]
        if not living or time.monotonic() >= deadline:
            return living
        time.sleep(0.02)


def live_sleep_children() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "sleep" and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


# --- the registry sees exactly these tools -------------------------------------------------------


def test_load_tools_yields_exactly_the_builtin_tools_with_their_flags_and_no_shell() -> None:
    tools = load_tools(["executor.toolkits.builtin"])
    flags = {name: (t.spec.bundleable, t.spec.idempotent, t.spec.no_repeat) for name, t in tools.items()}
    assert flags == {
        "read_file": (True, True, False),
        "write_file": (False, False, False),
        "list_dir": (True, True, False),
        "emit_note": (True, False, False),
        "complete_task": (False, False, False),
    }
    assert set(builtin.__all__) == set(tools)
    assert tools["read_file"].spec.signature == "(path: str, max_bytes: int = 200000) -> str"
    assert all(t.spec.doc and "No docstring" not in t.spec.doc for t in tools.values())


def test_the_shell_toolkit_is_run_shell_documented_as_unconfined() -> None:
    tools = load_tools(["executor.toolkits.shell"])
    assert list(tools) == ["run_shell"] and shell.__all__ == ["run_shell"]
    spec = tools["run_shell"].spec
    assert (spec.bundleable, spec.idempotent, spec.no_repeat) == (False, False, False)
    assert spec.timeout is not None and spec.timeout > shell.SHELL_TIMEOUT_MAX
    assert "full shell access as the executor's user" in " ".join(spec.doc.split())
    assert "--profile hardened" in spec.doc
    assert "full shell access as the executor's user" in (shell.__doc__ or "")


# --- read_file, write_file, list_dir: happy paths ------------------------------------------------


def test_write_then_read_round_trips_and_creates_parent_directories(ws: Path) -> None:
    assert write_file("src/pkg/mod.py", "print('héllo')\n") == "wrote 16 bytes to src/pkg/mod.py"
    assert (ws / "src/pkg/mod.py").read_text(encoding="utf-8") == "print('héllo')\n"
    assert read_file("src/pkg/mod.py") == "print('héllo')\n"


def test_write_file_overwrites(ws: Path) -> None:
    (ws / "a.txt").write_text("a much longer old content")
    write_file("a.txt", "new")
    assert (ws / "a.txt").read_text() == "new"


def test_absolute_path_inside_the_workspace_is_allowed(ws: Path) -> None:
    write_file(str(ws / "abs.txt"), "x")
    assert read_file(str(ws / "abs.txt")) == "x"


def test_workspace_is_read_at_call_time(ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("CIAYN_WORKSPACE", str(other))
    write_file("f.txt", "in other")
    assert (other / "f.txt").read_text() == "in other"
    assert not (ws / "f.txt").exists()


def test_list_dir_is_sorted_with_directories_marked(ws: Path) -> None:
    (ws / "b.txt").write_text("")
    (ws / "a_dir").mkdir()
    (ws / "a_dir" / "inner.txt").write_text("")
    (ws / "C").write_text("")
    assert list_dir() == ["C", "a_dir/", "b.txt"]
    assert list_dir("a_dir") == ["inner.txt"]


def test_list_dir_is_bounded_with_a_marker(ws: Path) -> None:
    big = ws / "big"
    big.mkdir()
    for i in range(builtin.LIST_DIR_MAX_ENTRIES + 5):
        (big / f"f{i:05d}").touch()
    names = list_dir("big")
    assert len(names) == builtin.LIST_DIR_MAX_ENTRIES + 1
    assert names[0] == "f00000"
    assert names[-1] == "[... 5 more entries not shown]"


# --- read_file errors and truncation -------------------------------------------------------------


def test_missing_file_is_a_clear_file_not_found(ws: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"'nope\.txt' does not exist"):
        read_file("nope.txt")
    with pytest.raises(FileNotFoundError):
        list_dir("nope")


def test_reading_a_directory_says_so(ws: Path) -> None:
    (ws / "d").mkdir()
    with pytest.raises(IsADirectoryError, match="list_dir"):
        read_file("d")
    with pytest.raises(IsADirectoryError):
        write_file("d", "x")


def test_listing_a_file_says_so(ws: Path) -> None:
    (ws / "f.txt").touch()
    with pytest.raises(NotADirectoryError, match="read_file"):
        list_dir("f.txt")


def test_writing_under_a_file_says_a_file_is_in_the_way(ws: Path) -> None:
    (ws / "f.txt").touch()
    with pytest.raises(NotADirectoryError, match="a file is in the way"):
        write_file("f.txt/child.txt", "x")


def test_binary_file_is_refused_as_binary(ws: Path) -> None:
    (ws / "img.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError, match="binary"):
        read_file("img.bin")


def test_non_utf8_file_is_refused_as_not_text(ws: Path) -> None:
    (ws / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_file("latin1.txt")


def test_fifo_is_refused_without_hanging(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    with pytest.raises(ValueError, match="not a regular file"):
        read_file("pipe")


def test_large_file_is_truncated_with_a_marker_saying_how_much(ws: Path) -> None:
    (ws / "big.txt").write_text("x" * 1000)
    text = read_file("big.txt", max_bytes=100)
    body, marker = text.split("\n", 1)
    assert body == "x" * 100
    assert "first 100 of 1000 bytes" in marker and "900 bytes cut" in marker


def test_truncation_does_not_split_a_multibyte_character(ws: Path) -> None:
    (ws / "u.txt").write_text("ab" + "é" * 10, encoding="utf-8")  # é is 2 bytes
    text = read_file("u.txt", max_bytes=5)  # 'ab' + one é + half of the next
    assert text.startswith("abé\n")
    assert "first 4 of 22 bytes" in text


def test_a_file_exactly_max_bytes_long_is_not_truncated(ws: Path) -> None:
    (ws / "f.txt").write_text("12345")
    assert read_file("f.txt", max_bytes=5) == "12345"


# --- confinement ---------------------------------------------------------------------------------


def test_dotdot_escape_is_refused(ws: Path, outside: Path) -> None:
    with pytest.raises(PermissionError, match=r"'\.\./outside/secret.txt' is outside the workspace"):
        read_file("../outside/secret.txt")
    with pytest.raises(PermissionError):
        write_file("sub/../../outside/new.txt", "x")
    with pytest.raises(PermissionError):
        list_dir("..")
    assert not (outside / "new.txt").exists()


def test_absolute_path_outside_is_refused(ws: Path, outside: Path) -> None:
    with pytest.raises(PermissionError, match=f"outside the workspace {re.escape(str(ws))}"):
        read_file(str(outside / "secret.txt"))
    with pytest.raises(PermissionError):
        write_file(str(outside / "new.txt"), "x")
    with pytest.raises(PermissionError):
        list_dir("/")
    assert not (outside / "new.txt").exists()


def test_symlinked_file_pointing_outside_is_refused(ws: Path, outside: Path) -> None:
    (ws / "link.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(PermissionError, match="outside the workspace"):
        read_file("link.txt")
    with pytest.raises(PermissionError):
        write_file("link.txt", "overwritten")
    assert (outside / "secret.txt").read_text() == "top secret"


def test_symlink_pointing_inside_is_followed(ws: Path) -> None:
    (ws / "real.txt").write_text("real")
    (ws / "alias.txt").symlink_to("real.txt")
    assert read_file("alias.txt") == "real"
    write_file("alias.txt", "changed")
    assert (ws / "real.txt").read_text() == "changed"


def test_symlinked_directory_pointing_outside_is_refused_for_read_write_and_list(ws: Path, outside: Path) -> None:
    (ws / "escape").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionError):
        read_file("escape/secret.txt")
    with pytest.raises(PermissionError):
        write_file("escape/planted.txt", "x")
    with pytest.raises(PermissionError):
        write_file("escape/deeper/planted.txt", "x")
    with pytest.raises(PermissionError):
        list_dir("escape")
    assert sorted(os.listdir(outside)) == ["secret.txt"]


def test_writing_through_a_dangling_symlink_to_outside_is_refused(ws: Path, outside: Path) -> None:
    (ws / "dangling.txt").symlink_to(outside / "created-by-tool.txt")
    with pytest.raises(PermissionError, match="outside the workspace"):
        write_file("dangling.txt", "x")
    assert not (outside / "created-by-tool.txt").exists()


def test_symlink_loop_is_refused_even_with_dotdot_after_it(ws: Path, outside: Path) -> None:
    (ws / "a").symlink_to("b")
    (ws / "b").symlink_to("a")
    with pytest.raises(OSError, match="symlink loop"):
        read_file("a")
    with pytest.raises(OSError):  # PermissionError or the loop error, depending on the Python version
        write_file("a/../../outside/x.txt", "x")
    assert not (outside / "x.txt").exists()


def test_an_absolute_symlink_pointing_inside_is_followed(ws: Path) -> None:
    (ws / "real").mkdir()
    (ws / "real" / "f.txt").write_text("via an absolute link")
    (ws / "abs").symlink_to(ws / "real", target_is_directory=True)  # the kernel refuses these beneath a root
    assert read_file("abs/f.txt") == "via an absolute link"
    assert write_file("abs/new/deeper.txt", "x") == "wrote 1 bytes to abs/new/deeper.txt"
    assert (ws / "real" / "new" / "deeper.txt").read_text() == "x"
    assert list_dir("abs") == ["f.txt", "new/"]


def test_writing_through_a_dangling_symlink_inside_creates_its_target(ws: Path) -> None:
    (ws / "alias.txt").symlink_to("later.txt")
    write_file("alias.txt", "made")
    assert (ws / "later.txt").read_text() == "made"


def test_a_dangling_symlink_in_the_parent_path_is_a_clear_error_with_openat2(ws: Path) -> None:
    (ws / "gone").symlink_to("nowhere")
    if paths.openat2_missing() is not None:  # the fallback resolves the link first, then makes "nowhere/"
        assert write_file("gone/f.txt", "x") == "wrote 1 bytes to gone/f.txt"
        assert (ws / "nowhere" / "f.txt").read_text() == "x"
        return
    with pytest.raises(NotADirectoryError, match=r"parent directory of 'gone/f\.txt': 'gone' is a symlink to nothing"):
        write_file("gone/f.txt", "x")
    assert sorted(os.listdir(ws)) == ["gone"]


def test_a_proc_magic_link_is_never_followed(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A workspace that holds a procfs (a container's root, say): /proc/PID/root and fd/N are magic
    links to anywhere; openat2 refuses them (RESOLVE_NO_MAGICLINKS), the fallback finds them outside."""
    monkeypatch.setenv("CIAYN_WORKSPACE", f"/proc/{os.getpid()}")
    expected = "magic link" if paths.openat2_missing() is None else "outside the workspace"
    with pytest.raises(OSError, match=expected):
        read_file("root/etc/hostname")
    with pytest.raises(OSError, match=expected):
        list_dir("cwd")


def test_writing_to_a_fifo_is_refused_without_hanging(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    with pytest.raises(OSError, match="not a regular file"):
        write_file("pipe", "x")


# --- hard links ----------------------------------------------------------------------------------


def test_write_refuses_a_hard_link_to_a_file_outside_and_leaves_both_untouched(ws: Path, outside: Path) -> None:
    os.link(outside / "secret.txt", ws / "planted.txt")
    with pytest.raises(PermissionError, match=r"'planted\.txt' has 2 hard links"):
        write_file("planted.txt", "overwritten")
    assert (outside / "secret.txt").read_text() == "top secret"  # not truncated either: checked before any change


def test_write_refuses_any_file_with_two_names_even_through_a_symlink(ws: Path) -> None:
    (ws / "a.txt").write_text("a")
    os.link(ws / "a.txt", ws / "b.txt")
    (ws / "link.txt").symlink_to("b.txt")
    for name in ("a.txt", "b.txt", "link.txt"):
        with pytest.raises(PermissionError, match="hard links"):
            write_file(name, "x")
    assert (ws / "a.txt").read_text() == "a"


def test_read_of_a_hard_linked_file_reads_it_like_any_workspace_file(ws: Path, outside: Path) -> None:
    # Documented: whoever could make the link could already read the file (fs.protected_hardlinks).
    os.link(outside / "secret.txt", ws / "shared.txt")
    assert read_file("shared.txt") == "top secret"


# --- read_file memory ------------------------------------------------------------------------------


def peak_allocated(fn: Callable[[], object]) -> tuple[object, int]:
    """What ``fn()`` returned (or the exception it raised) and the most memory it held at once."""
    tracemalloc.start()
    try:
        try:
            result: object = fn()
        except Exception as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_max_bytes_on_a_small_file_allocates_only_the_file(ws: Path) -> None:
    (ws / "small.txt").write_text("hello\n" * 100)
    read_file("small.txt")  # warm up caches and imports outside the measurement
    text, peak = peak_allocated(lambda: read_file("small.txt", max_bytes=10**10))
    assert text == "hello\n" * 100
    assert peak < 64 * 1024, f"read_file allocated {peak} bytes for a 600-byte file"


def test_a_large_file_is_read_in_bounded_chunks(ws: Path) -> None:
    size = 3 * builtin.READ_CHUNK + 123
    (ws / "big.txt").write_bytes(b"y" * size)
    text, peak = peak_allocated(lambda: read_file("big.txt", max_bytes=10**10))
    assert isinstance(text, str) and len(text) == size
    assert peak < 4 * size, f"read_file allocated {peak} bytes for a {size}-byte file"


def test_a_sparse_file_stops_at_the_first_chunk_with_a_nul(ws: Path) -> None:
    with open(ws / "sparse.txt", "wb") as f:
        f.truncate(1 << 40)  # 1 TiB of holes: no disk, all NULs
    error, peak = peak_allocated(lambda: read_file("sparse.txt", max_bytes=10**13))
    assert isinstance(error, ValueError) and "binary" in str(error)
    assert peak < 4 * builtin.READ_CHUNK


# --- run_shell -----------------------------------------------------------------------------------


def test_run_shell_reports_exit_code_stdout_and_stderr(shell_ws: Path) -> None:
    r = run_shell("echo out; echo err >&2; exit 3")
    assert r == {"exit_code": 3, "stdout": "out\n", "stderr": "err\n", "timed_out": False}


def test_run_shell_runs_in_the_workspace(shell_ws: Path) -> None:
    (shell_ws / "marker").touch()
    r = run_shell("pwd; ls")
    assert r["stdout"] == f"{shell_ws}\nmarker\n"


def test_run_shell_reports_death_by_signal_as_negative_exit_code(shell_ws: Path) -> None:
    assert run_shell("kill -TERM $$")["exit_code"] == -15


def test_run_shell_timeout_kills_the_whole_group_and_returns_fast(shell_ws: Path) -> None:
    start = time.monotonic()
    r = run_shell("echo $$ > pids; sleep 60 & echo $! >> pids; sleep 60", timeout=1.0)
    elapsed = time.monotonic() - start
    assert r["timed_out"] is True
    assert "timed out after 1 s" in str(r["stderr"])
    assert 1.0 <= elapsed < 10
    pids = [int(line) for line in (shell_ws / "pids").read_text().split()]
    assert len(pids) == 2
    assert wait_until_dead(pids) == []
    assert live_sleep_children() == []


def test_background_processes_do_not_outlive_the_command(shell_ws: Path) -> None:
    start = time.monotonic()
    r = run_shell("sleep 60 & echo $!")
    assert time.monotonic() - start < 10
    assert r["timed_out"] is False and r["exit_code"] == 0
    assert wait_until_dead([int(str(r["stdout"]))]) == []
    assert live_sleep_children() == []


def test_run_shell_waits_for_a_command_that_closed_its_output(shell_ws: Path) -> None:
    r = run_shell("exec >&- 2>&-; sleep 0.3; exit 4", timeout=10)
    assert r["exit_code"] == 4 and r["timed_out"] is False


def test_run_shell_output_is_capped_keeping_head_and_tail(shell_ws: Path) -> None:
    r = run_shell("seq 1 100000; seq 1 20 >&2")
    out = str(r["stdout"])
    total = len("".join(f"{i}\n" for i in range(1, 100001)).encode())
    assert len(out.encode()) < shell.SHELL_OUTPUT_CAP + 100
    assert out.startswith("1\n2\n3\n")
    assert out.endswith("99999\n100000\n")
    assert f"[... {total - shell.SHELL_OUTPUT_CAP} bytes cut ...]" in out
    assert r["stderr"] == "".join(f"{i}\n" for i in range(1, 21))


def test_run_shell_stdin_is_at_eof_immediately(shell_ws: Path) -> None:
    # Give this process a stdin that never ends, so a command inheriting it would hang until timeout.
    read_end, write_end = os.pipe()
    saved = os.dup(0)
    os.dup2(read_end, 0)
    try:
        r = run_shell("cat; echo done", timeout=5)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    assert r == {"exit_code": 0, "stdout": "done\n", "stderr": "", "timed_out": False}


def test_run_shell_refuses_an_out_of_range_timeout(shell_ws: Path) -> None:
    with pytest.raises(ValueError, match="timeout"):
        run_shell("true", timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        run_shell("true", timeout=shell.SHELL_TIMEOUT_MAX + 1)


# --- signals -------------------------------------------------------------------------------------


def test_emit_note_and_complete_task_raise_signals() -> None:
    signals.drain()
    assert emit_note("found 3 failing tests") == "noted"
    assert "complete" in complete_task("fixed them")
    drained = [(s.kind, s.message) for s in signals.drain()]
    assert drained == [("note", "found 3 failing tests"), ("complete", "fixed them")]
    assert signals.drain() == []
