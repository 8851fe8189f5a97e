"""The keeper's apply step (``executor.sandbox.overlay.commit``) as a transaction, beyond what the red team's
tests (tests/test_overlay_redteam.py, against real executors) reach: a keeper killed at each step
(after its copy, before its steps in place) and what the next apply or the executor's exit removes,
copies unnamed within the default descriptor limit, the walk's bounds, the ``Applying`` notice (sent
only when something is applied; the call's own forwarded as malformed)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
from pathlib import Path
from unittest import mock

import pytest

from executor.sandbox import keeper, overlay
from executor.workers import framing
from executor.workers.channel import Applying, Reply


@pytest.fixture
def layers(tmp_path: Path) -> tuple[Path, Path, str]:
    if os.geteuid() != 0:
        pytest.skip("the applier chowns to the workspace's owner: root only")
    upper, real, private = tmp_path / "upper", tmp_path / "real", tmp_path / "private"
    for d in (upper, real, private):
        d.mkdir()
    return upper, real, str(private / "workspace-size")


def _journal(real: Path) -> str | None:
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return overlay._Journal(fd, None).read()
    finally:
        os.close(fd)


def _visible(real: Path) -> dict[str, str]:
    return {p.name: "<dir>" if p.is_dir() else p.read_text() for p in real.iterdir()
            if not p.name.startswith(overlay.TEMP)}


def _killed_keeper(upper: Path, real: Path, tally: str, step: str) -> None:
    """Run ``commit`` in a child that SIGKILLs itself (as a cancel or a shutdown would) at ``step`` of
    ``overlay._Stage``, with everything before it done."""
    pid = os.fork()
    if pid == 0:
        with mock.patch.object(overlay._Stage, step, lambda *_: os.kill(os.getpid(), signal.SIGKILL)):
            overlay.commit(str(upper), str(real), 1 << 30, tally)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL


def _changes(upper: Path, real: Path) -> None:
    (real / "kept.txt").write_text("old")
    (real / "gone.txt").write_text("old")
    (real / "sub").mkdir()
    (upper / "kept.txt").write_text("new")
    (upper / "added.txt").write_text("added")
    os.mknod(upper / "gone.txt", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # a whiteout
    (upper / "sub").mkdir()
    (upper / "sub" / "deeper.txt").write_text("deeper")
    (upper / "newdir").mkdir()
    (upper / "newdir" / "inside.txt").write_text("inside")


BEFORE = {"kept.txt": "old", "gone.txt": "old", "sub": "<dir>"}


def test_a_keeper_killed_after_its_copy_leaves_nothing(layers: tuple[Path, Path, str]) -> None:
    upper, real, tally = layers
    _changes(upper, real)
    _killed_keeper(upper, real, tally, "trash")  # every file copied, nothing in place yet
    assert {p.name: "<dir>" if p.is_dir() else p.read_text() for p in real.iterdir()} == BEFORE
    assert list((real / "sub").iterdir()) == [] and _journal(real) is None


def test_a_keeper_killed_before_its_first_step_in_place_leaves_a_trash_the_next_apply_removes(
        layers: tuple[Path, Path, str]) -> None:
    upper, real, tally = layers
    _changes(upper, real)
    _killed_keeper(upper, real, tally, "put_in_place")
    assert _visible(real) == BEFORE and list((real / "sub").iterdir()) == []
    assert [p.name for p in real.iterdir() if p.name.startswith(overlay.TEMP)]  # named in the journal
    assert _journal(real) is not None

    for p in upper.iterdir():  # the next call's changes
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (upper / "next.txt").write_text("next")
    assert overlay.commit(str(upper), str(real), 1 << 30, tally) is None
    assert not list(real.rglob(f"{overlay.TEMP}*")) and _journal(real) is None
    assert _visible(real) == {**BEFORE, "next.txt": "next"}


def test_the_executors_exit_removes_the_trash_of_an_apply_killed_in_its_last_steps(
        layers: tuple[Path, Path, str]) -> None:
    """A keeper SIGKILLed by a stop: the journal (an xattr of the workspace, which outlives the
    executor) names its trash; ``recover`` (the executor's exit) removes it."""
    upper, real, tally = layers
    _changes(upper, real)
    _killed_keeper(upper, real, tally, "put_in_place")
    assert _journal(real) is not None
    overlay.recover(str(real))
    assert _journal(real) is None and not list(real.rglob(f"{overlay.TEMP}*"))
    assert _visible(real) == BEFORE


def test_a_full_apply_replaces_and_deletes_and_leaves_nothing_else(layers: tuple[Path, Path, str]) -> None:
    upper, real, tally = layers
    _changes(upper, real)
    assert overlay.commit(str(upper), str(real), 1 << 30, tally) is None
    assert {p.name: "<dir>" if p.is_dir() else p.read_text() for p in real.iterdir()} == {
        "kept.txt": "new", "added.txt": "added", "sub": "<dir>", "newdir": "<dir>"}
    assert (real / "sub" / "deeper.txt").read_text() == "deeper"
    assert (real / "newdir" / "inside.txt").read_text() == "inside"
    assert _journal(real) is None


def test_descriptors_running_short_stage_the_rest_by_name(layers: tuple[Path, Path, str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    upper, real, tally = layers
    for i in range(30):
        (upper / f"f{i}").write_text(str(i))
    monkeypatch.setattr(overlay, "_fd_budget", lambda depth: 10)
    assert overlay.commit(str(upper), str(real), 1 << 30, tally) is None
    assert sorted(p.name for p in real.iterdir()) == sorted(f"f{i}" for i in range(30))
    assert all((real / f"f{i}").read_text() == str(i) for i in range(30))


def test_a_committed_apply_leaves_no_temporary_name_and_replaces_across_kinds(layers: tuple[Path, Path, str]) -> None:
    upper, real, tally = layers
    (real / "was_dir").mkdir()
    (real / "was_dir" / "f").write_text("old")
    (real / "was_file").write_text("old")
    (upper / "was_dir").write_text("now a file")
    (upper / "was_file").mkdir()
    (upper / "was_file" / "g").write_text("now a directory")
    announced: list[int] = []
    assert overlay.commit(str(upper), str(real), 1 << 30, tally, announce=lambda: announced.append(1)) is None
    assert announced == [1]
    assert (real / "was_dir").read_text() == "now a file" and (real / "was_file" / "g").read_text() == "now a directory"
    assert not list(real.rglob(f"{overlay.TEMP}*")) and _journal(real) is None


def test_a_shallow_change_set_is_copied_unnamed_within_the_default_256_descriptors(
        layers: tuple[Path, Path, str]) -> None:
    """The keeper's descriptor limit is the call's (256 by default): a change set two levels deep
    keeps 200 copies unnamed, so the trash (what a stop could leave) is made only after the copy."""
    upper, real, tally = layers
    (upper / "d").mkdir()
    for i in range(200):
        (upper / "d" / f"f{i}").write_text(str(i))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    made_during_copy: list[bool] = []
    copying = [False]
    real_copy, real_trash = overlay._Stage.copy, overlay._Stage.trash

    def copy(self: overlay._Stage, *args: object, **kwargs: object) -> None:
        top = not copying[0]
        copying[0] = True
        try:
            real_copy(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            copying[0] = not top

    def trash(self: overlay._Stage) -> int:
        made_during_copy.append(copying[0])
        return real_trash(self)

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        with mock.patch.object(overlay._Stage, "copy", copy), mock.patch.object(overlay._Stage, "trash", trash):
            assert overlay.commit(str(upper), str(real), 1 << 30, tally) is None
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert made_during_copy and not any(made_during_copy)
    assert len(list((real / "d").iterdir())) == 200


def test_nothing_to_apply_is_not_announced(layers: tuple[Path, Path, str]) -> None:
    upper, real, tally = layers
    announced: list[int] = []
    assert overlay.commit(str(upper), str(real), 1 << 30, tally, announce=lambda: announced.append(1)) is None
    assert announced == []


def test_an_apply_past_its_time_applies_nothing(layers: tuple[Path, Path, str]) -> None:
    upper, real, tally = layers
    for i in range(50):
        (upper / f"f{i}").write_text("x")
    problem = overlay.commit(str(upper), str(real), 1 << 30, tally, within=0.0)
    assert problem is not None and "applying them took more than 0 s" in problem
    assert list(real.iterdir()) == []


def _chain(top: Path, names: list[str]) -> None:
    """Nest directories ``names`` under ``top`` from descriptors (the path may pass PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for name in names:
        os.mkdir(name, dir_fd=fd)
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(os.open("file", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    os.close(fd)


def _usage(path: Path, budget: int | None = None) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return overlay.tree_usage(fd, budget)
    finally:
        os.close(fd)


def test_the_walk_measures_past_path_max_and_is_bounded_in_depth_and_work(tmp_path: Path) -> None:
    long = tmp_path / "long"
    long.mkdir()
    _chain(long, ["x" * 250] * 20)  # 5,000 bytes of path
    assert _usage(long) == 21 * overlay.BLOCK  # each directory (one block each on this filesystem) and the file

    deep = tmp_path / "deep"
    deep.mkdir()
    _chain(deep, ["d"] * (overlay.WALK_DEPTH + 30))
    seen = _usage(deep) // overlay.BLOCK
    assert seen == overlay.WALK_DEPTH + 1  # the levels it enters, and the first directory it does not

    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(200):
        (wide / str(i)).touch()
    assert _usage(wide, budget=10 * overlay.BLOCK) == 11 * overlay.BLOCK  # stopped once past the budget
    assert _usage(wide) == 200 * overlay.BLOCK


def test_the_calls_own_applying_notice_is_forwarded_as_a_malformed_message() -> None:
    forged = framing.pack(Applying(seq=3).to_wire())
    judged = keeper._as_the_calls(forged)
    assert judged != forged and Applying.from_wire(keeper._decode(judged)) is None
    with pytest.raises(ValueError):
        Reply.from_wire(keeper._decode(judged))
    reply = framing.pack(Reply(seq=3, ok=True, value="applying").to_wire())
    assert keeper._as_the_calls(reply) is reply
