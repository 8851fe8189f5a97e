"""Process checks for tests."""

from __future__ import annotations

import time

import psutil

from controller import LocalExecutor


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def living(processes: list[psutil.Process]) -> list[int]:
    """The pids of ``processes`` still running (as ``alive``, judged on these very processes, so a pid
    reused since is not taken for one of them)."""
    found = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:  # a zombie runs nothing; this machine's init may not reap
                found.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def live_tree(local: LocalExecutor) -> dict[int, psutil.Process]:
    """Every live process of the executor: the supervisor and all its descendants."""
    assert local.proc is not None
    root = psutil.Process(local.proc.pid)
    return {p.pid: p for p in [root, *root.children(recursive=True)] if alive(p.pid)}


def assert_tree_is_supervisor_template_and(local: LocalExecutor, worker_pid: int | None) -> None:
    """The executor's tree is its supervisor, its template and one worker: ``worker_pid`` (a reused
    worker), or, with fresh workers (``None``), the one worker forked ahead, once the worker that ran
    the last call has exited (it may take a moment)."""
    assert local.proc is not None
    deadline = time.monotonic() + 5
    while True:
        try:
            tree = live_tree(local)
            supervisor = tree.pop(local.proc.pid)
            template = [p for p in tree.values() if p.ppid() == supervisor.pid]
            assert len(template) == 1, f"the supervisor has children {template}, expected only the template"
            tree.pop(template[0].pid)
            expected = [worker_pid] if worker_pid is not None else [p.pid for p in tree.values()][:1]
            if list(tree) == expected and all(p.ppid() == template[0].pid for p in tree.values()):
                return
        except psutil.NoSuchProcess:  # a worker exited between the listing and the look at it: look again
            tree = {}
        assert time.monotonic() < deadline, (
            f"besides supervisor and template the executor holds {[(p.pid, p.cmdline()) for p in tree.values()]}, "
            f"expected only one worker {worker_pid or ''}")
        time.sleep(0.02)
