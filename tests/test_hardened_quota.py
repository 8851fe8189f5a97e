"""``serve --profile hardened --workspace-rw``: each call's writes are a transaction bounded by
``--workspace-quota`` (``executor.sandbox.overlay``). A real hardened executor (real namespaces, overlay,
tmpfs, seccomp, Landlock) serves ``tests/tools/workspace_filler.py``; every hostile way of filling
the disk is tried, and the host's workspace is judged afterwards. They need root and the kernel's
layers; elsewhere they skip, naming what is missing (on CI, as root, a missing layer fails)."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import require_layer

from controller import ExecutorClient
from executor.sandbox import overlay, start
from executor.sandbox.mounts import check_idmap
from protocol import Call, Result
from tests.support.quota import MISSING, OWNER, QUOTA_MB, Served
from tests.support.quota import added as _added
from tests.support.quota import stop as _stop

TOOLS = str(Path(__file__).parent / "tools" / "workspace_filler.py")


def _host_state() -> dict[str, list[str]]:
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(line.split()[4] for line in f)
    return {"mounts": mounts, "shm": sorted(os.listdir("/dev/shm")),
            "tmp": sorted(n for n in os.listdir("/tmp") if "ciayn-apply" in n or "upper" in n)}


def _start(top: Path, workspace: Path, quota_mb: int = QUOTA_MB, sockdir: Path | None = None) -> Served:
    sockdir = sockdir or top / "run"
    sockdir.mkdir(mode=0o700)
    sock = sockdir / "executor.sock"
    cmd = [sys.executable, "-m", "executor.cli", "serve", "--profile", "hardened", "--skip-selfcheck",
           "--workspace-rw", "--workspace-quota", str(quota_mb), "--tools", TOOLS, "--bind", f"ipc://{sock}",
           "--workspace", str(workspace), "--workers", "2", "--timeout", "20", "--memory-mb", "256",
           "--parent-pid", str(os.getpid()), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the hardened executor did not start: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.02)
    return Served(proc, ExecutorClient(f"ipc://{sock}", timeout=60), workspace, top)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    require_layer(not MISSING, f"this machine lacks hardened layers: {MISSING}")
    top = Path(tempfile.mkdtemp(prefix="ciayn-quota-", dir="/var/tmp"))  # not under /tmp: see selfcheck.Target
    top.chmod(0o755)
    workspace = top / "workspace"
    workspace.mkdir()
    os.chown(workspace, OWNER, OWNER)
    problem = check_idmap(str(workspace))
    require_layer(problem is None, f"the workspace's filesystem takes no idmapped overlay: {problem}")
    s = _start(top, workspace)
    yield s
    _stop(s)
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def ws(served: Served) -> Served:
    """The module's executor with an empty workspace (emptied from the host, between calls)."""
    for child in served.workspace.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    return served


def _refused(result: Result) -> str:
    assert not result.ok and result.error is not None, result
    assert result.error.kind == "output_limit", result.error
    assert "discarded" in result.error.message, result.error.message
    return result.error.message


# --- what a well-behaved tool sees --------------------------------------------------------------------


def test_small_writes_land_in_the_workspace_as_its_owner_and_the_next_call_sees_them(ws: Served) -> None:
    result = ws.call('write(name="notes/a.txt", text="hello")')
    assert result.ok and result.value == 5, result
    host = ws.workspace / "notes" / "a.txt"
    assert host.read_text() == "hello"  # on the host before the result came back
    assert (host.stat().st_uid, host.stat().st_gid) == (OWNER, OWNER)
    assert (ws.workspace / "notes").stat().st_uid == OWNER
    assert ws.call('read(name="notes/a.txt")').value == "hello"
    assert ws.call('write(name="notes/a.txt", text="again")').ok
    assert ws.call('read(name="notes/a.txt")').value == "again"
    assert ws.call('remove(name="notes")').value == "done"
    assert not (ws.workspace / "notes").exists()
    assert ws.call('listing()').value == []


def test_a_directory_of_the_hosts_keeps_its_owner_and_mode_when_a_call_writes_in_it(ws: Served) -> None:
    shared = ws.workspace / "shared"
    shared.mkdir()
    os.chown(shared, OWNER, OWNER)
    shared.chmod(0o2750)
    assert ws.call("write(name='shared/x', text='x')").ok
    st = shared.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (OWNER, OWNER, 0o2750)
    assert (shared / "x").stat().st_uid == OWNER


def test_entries_the_workspaces_owner_does_not_own_cannot_be_changed(ws: Served) -> None:
    """The tools act as the workspace's owner only: a directory of another user or group (root here), even
    writable by all, cannot be written in (the overlay cannot copy up what it cannot map)."""
    other = ws.workspace / "roots"
    other.mkdir()
    other.chmod(0o777)
    result = ws.call("write(name='roots/x', text='x')")
    assert not result.ok and result.error is not None and "Permission denied" in result.error.message
    assert list(other.iterdir()) == []


def test_a_call_that_writes_more_than_the_quota_gets_output_limit_and_changes_nothing(ws: Served) -> None:
    (ws.workspace / "kept.txt").write_text("the host's")
    before = ws.usage()
    message = _refused(ws.call(f'fill(name="big", megabytes={3 * QUOTA_MB})'))
    assert f"quota of {QUOTA_MB} MB" in message and "--workspace-quota" in message
    assert not (ws.workspace / "big").exists() and (ws.workspace / "kept.txt").read_text() == "the host's"
    assert ws.usage() == before
    assert ws.call('read(name="big")').value == "missing"


def test_the_quota_is_on_the_workspace_after_the_call_and_deletes_make_room(ws: Served) -> None:
    for name in ("one", "two"):
        assert ws.call(f'write(name="{name}", megabytes=3)').ok
    _refused(ws.call('write(name="three", megabytes=3)'))  # 9 MB > 8 MB
    assert sorted(p.name for p in ws.workspace.iterdir()) == ["one", "two"]
    assert ws.call('remove(name="one")').value == "done"
    assert ws.call('write(name="three", megabytes=3)').ok
    assert sorted(p.name for p in ws.workspace.iterdir()) == ["three", "two"]
    assert ws.usage() <= QUOTA_MB << 20


def test_what_the_host_removes_between_calls_is_measured_before_a_call_is_refused(ws: Served) -> None:
    """The workspace's size is tracked through the calls' changes (no walk of it per call); a call
    the tracked size would refuse is measured afresh first."""
    assert ws.call("write(name='a', megabytes=5)").ok
    (ws.workspace / "a").unlink()  # by the host: the tracked size still counts it
    assert ws.call("write(name='b', megabytes=5)").ok
    assert [p.name for p in ws.workspace.iterdir()] == ["b"]
    _refused(ws.call("write(name='c', megabytes=5)"))


def test_calls_running_side_by_side_cannot_pass_the_quota_together(ws: Served) -> None:
    """Each alone fits, both do not: their appliers take turns, and the second sees the first's bytes."""
    futures = [ws.client.submit(Call(tool="write", kwargs={"name": f"side{i}", "megabytes": 5})) for i in range(2)]
    results = [f.result(timeout=60) for f in futures]
    assert sorted(r.ok for r in results) == [False, True], results
    _refused(next(r for r in results if not r.ok))
    assert len(list(ws.workspace.iterdir())) == 1 and ws.usage() <= QUOTA_MB << 20


# --- hostile tools --------------------------------------------------------------------------------------


def test_many_small_files_count_a_block_each_and_the_file_count_is_capped(ws: Served) -> None:
    result = ws.call("many_files(directory='small', count=5000, size=1)")  # 5000 x 4 KiB > 8 MiB
    _refused(result)
    assert not (ws.workspace / "small").exists()
    assert ws.call("many_files(directory='small', count=100, size=1)").ok
    assert len(list((ws.workspace / "small").iterdir())) == 100


def test_a_huge_directory_stops_at_the_layers_file_cap(ws: Served) -> None:
    cap = (QUOTA_MB << 20) // overlay.BLOCK + 16
    result = ws.call(f"wide(directory='wide', count={2 * cap})")
    _refused(result)
    assert not (ws.workspace / "wide").exists()


def test_a_sparse_file_counts_at_its_full_size(ws: Served) -> None:
    _refused(ws.call("sparse(name='holes', megabytes=64)"))  # 4 KiB of data, 64 MiB apparent
    assert not (ws.workspace / "holes").exists()


def test_hard_links_count_once_per_name(ws: Served) -> None:
    _refused(ws.call("hard_links(name='linked', megabytes=1, links=12)"))  # 13 names x 1 MiB
    assert list(ws.workspace.iterdir()) == []
    assert ws.call("hard_links(name='linked', megabytes=1, links=2)").value == "linked 2"
    names = sorted(p.name for p in ws.workspace.iterdir())
    assert names == ["linked", "linked.link0", "linked.link1"]
    assert len({(ws.workspace / n).stat().st_ino for n in names}) == 3  # applied as separate files


def test_symbolic_links_are_applied_as_links_and_never_followed(ws: Served, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    result = ws.call(f"symlinks(pairs={{'out': {str(outside)!r}, 'etc': '/etc', 'loop': 'loop'}})")
    assert result.ok and all(r.startswith("denied") for r in result.value), result.value
    assert os.readlink(ws.workspace / "out") == str(outside) and os.readlink(ws.workspace / "etc") == "/etc"
    assert outside.read_text() == "untouched"
    result = ws.call("write(name='etc/ciayn-escaped', text='x')")  # through the link applied last call
    assert not result.ok and not Path("/etc/ciayn-escaped").exists()
    # replaced by a directory holding a file: the link is removed, never written through
    assert ws.call("remove(name='etc')").value == "done"
    assert ws.call("write(name='etc/inside', text='in the workspace')").ok
    assert (ws.workspace / "etc").is_dir() and not (ws.workspace / "etc").is_symlink()
    assert (ws.workspace / "etc" / "inside").read_text() == "in the workspace"


def test_fifos_sockets_and_devices_cannot_be_made(ws: Served) -> None:
    result = ws.call("special_files()")
    assert result.ok and all(r.startswith("denied") for r in result.value), result.value
    assert list(ws.workspace.iterdir()) == []


def test_renames_are_applied_and_a_directory_rename_is_a_copy(ws: Served) -> None:
    assert ws.call("write(name='src/a.txt', text='moved')").ok
    assert ws.call("rename(old='src', new='dst')").value == "done"
    assert not (ws.workspace / "src").exists() and (ws.workspace / "dst" / "a.txt").read_text() == "moved"
    assert ws.call("rename(old='dst/a.txt', new='b.txt')").value == "done"
    assert (ws.workspace / "b.txt").read_text() == "moved" and list((ws.workspace / "dst").iterdir()) == []


def test_directories_nested_too_deep_are_refused(ws: Served) -> None:
    message = _refused(ws.call(f"deep(depth={overlay.MAX_DEPTH + 20})"))
    assert f"nested more than {overlay.MAX_DEPTH} deep" in message
    assert list(ws.workspace.iterdir()) == []
    assert ws.call("deep(depth=20)").ok
    assert (ws.workspace / "/".join(["d"] * 20)).is_dir()


def test_racing_writers_cannot_pass_the_quota_together(ws: Served) -> None:
    _refused(ws.call(f"racing_writers(threads=4, megabytes={QUOTA_MB})"))
    assert list(ws.workspace.iterdir()) == []


@pytest.mark.parametrize("how", ["exit", "abort", "segv"])
def test_a_call_that_writes_then_crashes_changes_nothing(ws: Served, how: str) -> None:
    result = ws.call(f"write_then_crash(name='crash-{how}', megabytes=1, how='{how}')")
    assert not result.ok and result.error is not None and result.error.kind == "crashed", result.error
    assert list(ws.workspace.iterdir()) == []


def test_a_call_killed_while_a_child_writes_changes_nothing(ws: Served) -> None:
    result = ws.call("killed_mid_write(name='stream')")
    assert not result.ok and result.error is not None and result.error.kind == "crashed", result.error
    assert list(ws.workspace.iterdir()) == []


def test_a_timed_out_call_changes_nothing(ws: Served) -> None:
    result = ws.call("hang_after_write(name='slow')", timeout=2)
    assert not result.ok and result.error is not None and result.error.kind == "timeout", result.error
    assert list(ws.workspace.iterdir()) == []


def test_a_call_that_writes_garbage_on_its_channel_changes_nothing(ws: Served) -> None:
    result = ws.call("garbage_on_channel(name='garbled')")
    assert not result.ok and result.error is not None and result.error.kind == "crashed", result.error
    assert "malformed" in result.error.message
    assert list(ws.workspace.iterdir()) == []


def test_a_writer_left_behind_after_the_call_writes_nothing(ws: Served) -> None:
    assert ws.call("write_after_return(name='late')").ok
    deadline = time.monotonic() + 2.0  # the writer would have written after 0.5 s
    while time.monotonic() < deadline:
        assert not (ws.workspace / "late").exists()
        time.sleep(0.05)
    assert ws.call("read(name='late')").value == "missing"


def test_a_thread_still_writing_when_the_call_answers_stops_with_the_answer(ws: Served) -> None:
    """The keeper stops every process of the call before it reads the call's changes: the workspace
    holds what was written when the call answered, and nothing more ever after."""
    assert ws.call("thread_after_return(name='tail')").ok
    size = (ws.workspace / "tail").stat().st_size
    assert 0 < size <= QUOTA_MB << 20
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert (ws.workspace / "tail").stat().st_size == size
        time.sleep(0.05)
    assert ws.call("read(name='tail')").value == "t" * size


# --- the applier alone (``overlay.commit`` on a hand-made upper layer) -------------------------------------


@pytest.fixture
def layers(tmp_path: Path) -> tuple[Path, Path]:
    if os.geteuid() != 0:
        pytest.skip("overlay whiteouts (character devices 0:0) and trusted xattrs need root")
    upper, real = tmp_path / "upper", tmp_path / "real"
    upper.mkdir()
    real.mkdir()
    return upper, real


def test_commit_applies_files_links_and_the_overlays_deletion_marks(layers: tuple[Path, Path]) -> None:
    upper, real = layers
    for name in ("gone.txt", "kept.txt"):
        (real / name).write_text("old")
    (real / "cleared").mkdir()
    (real / "cleared" / "old.txt").write_text("old")
    (real / "merged").mkdir()
    (real / "merged" / "old.txt").write_text("old")
    os.mknod(upper / "gone.txt", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # a whiteout: deleted by the call
    (upper / "new.txt").write_text("new")
    (upper / "cleared").mkdir()  # opaque: the call removed the directory and made it again
    os.setxattr(upper / "cleared", overlay.OPAQUE_XATTR, b"y")
    (upper / "cleared" / "fresh.txt").write_text("fresh")
    (upper / "merged").mkdir()
    (upper / "merged" / "added.txt").write_text("added")
    os.symlink("/etc/passwd", upper / "link")
    assert overlay.commit(str(upper), str(real), 1 << 20) is None
    assert sorted(p.name for p in real.iterdir()) == ["cleared", "kept.txt", "link", "merged", "new.txt"]
    assert [p.name for p in (real / "cleared").iterdir()] == ["fresh.txt"]
    assert sorted(p.name for p in (real / "merged").iterdir()) == ["added.txt", "old.txt"]
    assert os.readlink(real / "link") == "/etc/passwd" and (real / "new.txt").read_text() == "new"


def test_commit_refuses_the_whole_change_set_for_one_fifo(layers: tuple[Path, Path]) -> None:
    upper, real = layers
    (upper / "file.txt").write_text("x")
    os.mkfifo(upper / "pipe")
    problem = overlay.commit(str(upper), str(real), 1 << 20)
    assert problem is not None and "'pipe', a FIFO" in problem and list(real.iterdir()) == []


def test_commit_without_o_tmpfile_writes_under_a_temporary_name(layers: tuple[Path, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    upper, real = layers
    (upper / "file.txt").write_text("whole")
    real_open = os.open

    def no_tmpfile(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE on this filesystem")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    assert overlay.commit(str(upper), str(real), 1 << 20) is None
    assert [p.name for p in real.iterdir()] == ["file.txt"] and (real / "file.txt").read_text() == "whole"


# --- the start-up checks ---------------------------------------------------------------------------------


def test_a_workspace_whose_path_an_overlay_cannot_take_is_refused_before_serving(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    odd = tmp_path / "a,b:c"
    odd.mkdir()
    args = argparse.Namespace(reuse_workers=False, no_cgroups=False, bind="ipc:///tmp/x/executor.sock", connect=None,
                              curve_secret=None, workspace=str(odd), workspace_rw=True, allow_degraded=False,
                              skip_selfcheck=True, pass_env=[], workspace_quota=QUOTA_MB)
    assert start.start_hardened(args) == 2
    err = capsys.readouterr().err
    assert "an overlay's layer path cannot" in err and ", :" in err


def test_the_quota_reaches_the_hardened_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    require_layer(not MISSING, f"this machine lacks hardened layers: {MISSING}")
    monkeypatch.setattr("atexit.register", lambda fn: fn)
    args = argparse.Namespace(reuse_workers=False, no_cgroups=False, bind="ipc:///tmp/x/executor.sock", connect=None,
                              curve_secret=None, workspace=str(tmp_path), workspace_rw=True, allow_degraded=False,
                              skip_selfcheck=True, pass_env=[], workspace_quota=3, max_result_kb=64)
    assert start.start_hardened(args) == 0
    sandbox = args.confinement
    assert sandbox is not None and sandbox.keeper
    assert (sandbox.config.workspace_quota_mb, sandbox.config.max_result_kb) == (3, 64)


def test_the_executors_socket_directory_inside_the_workspace_stays_hidden(tmp_path: Path) -> None:
    """An overlay layer does not show the mounts under it: what the hardened view hides inside the
    workspace is hidden again on top of the overlay."""
    require_layer(not MISSING, f"this machine lacks hardened layers: {MISSING}")
    top = Path(tempfile.mkdtemp(prefix="ciayn-quota-", dir="/var/tmp"))
    top.chmod(0o755)
    workspace = top / "workspace"
    workspace.mkdir()
    s = _start(top, workspace, sockdir=workspace / "run")
    try:
        assert s.call("listing()").value == ["run"]
        for text in ("listing(name='run')", "write(name='run/x', text='in')"):
            result = s.call(text)
            assert not result.ok and result.error is not None and "Permission denied" in result.error.message
        assert s.call("remove(name='run')").value.startswith("denied")
        assert [p.name for p in (workspace / "run").iterdir()] == ["executor.sock"]
    finally:
        _stop(s)
        shutil.rmtree(top, ignore_errors=True)


# --- the host after the executor --------------------------------------------------------------------


def test_nothing_is_left_mounted_or_in_tmp_or_dev_shm_after_the_executor_stops(served: Served) -> None:
    top = Path(tempfile.mkdtemp(prefix="ciayn-quota-", dir="/var/tmp"))
    top.chmod(0o755)
    workspace = top / "workspace"
    workspace.mkdir()
    before = _host_state()
    s = _start(top, workspace)
    try:
        assert s.call("write(name='kept', text='x')").ok
        _refused(s.call(f"fill(name='big', megabytes={2 * QUOTA_MB})"))
        s.call("hang_after_write(name='slow')", timeout=1)
        s.call("write_after_return(name='late')")
        pid = s.proc.pid
    finally:
        _stop(s)
    deadline = time.monotonic() + 10  # the kernel tears namespaces down after the processes are gone
    while (left := _added(before, _host_state())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left
    assert not psutil.pid_exists(pid)
    assert sorted(p.name for p in workspace.iterdir()) == ["kept"]  # no temporary file of an apply
    shutil.rmtree(top, ignore_errors=True)
