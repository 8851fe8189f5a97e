"""How the template makes workers. A fresh worker forked with the bare ``fork()``
(``executor.workers.quickfork``) is as sound as one made by ``os.fork()``: its random numbers are its own,
its ``threading`` state is its own, and where the bare fork would be wrong (a thread in the
template, a tool module's after-fork hook) the template uses ``os.fork()``. The rights no worker
may hold are dropped by the template before any tool module is imported. Real executors; the unit
tests at the end check the fork decision in-process."""

from __future__ import annotations

import contextlib
import os
import posix
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from controller import ExecutorClient
from executor.workers import quickfork
from executor.workers.privacy import CAP_SYS_PTRACE, CAP_SYS_RESOURCE, HOST_ADMIN_CAPS
from protocol import Call
from tests.conftest import TESTS
from tests.support.waiting import wait_until

TOOLS = TESTS / "tools"


def _values(client: ExecutorClient, tool: str, n: int) -> list[object]:
    out = []
    for _ in range(n):
        r = client.call(Call(tool=tool))
        assert r.ok, r.error
        out.append(r.value)
    return out


def test_every_worker_draws_random_numbers_of_its_own(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[str(TOOLS / "fork_state.py")], workers=2)
    draws = _values(client, "draw", 6)
    assert len(set(draws)) == len(draws), f"workers drew the same numbers: {draws}"


def test_a_fresh_worker_knows_only_its_own_thread(make_client: Callable[..., ExecutorClient]) -> None:
    client = make_client(tools=[str(TOOLS / "fork_state.py")], workers=1)
    for seen in _values(client, "threads", 3):
        assert seen == {"count": 1, "main_is_current": True, "ident_is_ours": True}


def test_a_tool_modules_after_fork_hook_runs_in_every_worker(make_client: Callable[..., ExecutorClient]) -> None:
    """The bare fork runs no hook: a module that registered one makes the template use os.fork()."""
    client = make_client(tools=[str(TOOLS / "fork_hooked.py")], workers=2)
    assert _values(client, "hook_ran", 4) == [True] * 4


def test_a_thread_left_in_the_template_is_not_a_workers(make_client: Callable[..., ExecutorClient]) -> None:
    """With a second thread in the template (it may hold a lock at the fork), the template uses
    os.fork(), whose hooks leave the worker's threading module listing its one thread."""
    client = make_client(tools=[str(TOOLS / "fork_threaded.py")], workers=2)
    assert _values(client, "thread_names", 3) == [["MainThread"]] * 3


def test_a_tool_modules_import_runs_without_the_rights_no_worker_holds(
        make_client: Callable[..., ExecutorClient]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: other users hold none of these capabilities anyway")
    client = make_client(tools=[str(TOOLS / "import_caps.py")], workers=1)
    seen = _values(client, "caps", 1)[0]
    assert isinstance(seen, dict)
    for cap in (CAP_SYS_PTRACE, CAP_SYS_RESOURCE, *HOST_ADMIN_CAPS.values()):
        assert not seen["import"] & (1 << cap), f"capability {cap} held while the tool module was imported"
        assert not seen["call"] & (1 << cap), f"capability {cap} held by a worker"
    assert seen["call"] == seen["import"], "the template and its worker hold different rights"


def test_the_first_template_holds_none_of_the_supervisors_modules(
        make_client: Callable[..., ExecutorClient]) -> None:
    """It is forked before the supervisor imports ZeroMQ and the rest: each worker copies less."""
    client = make_client(tools=[str(TOOLS / "fork_state.py")], workers=1)
    assert _values(client, "supervisor_modules", 2) == [[], []]


def _processes_naming(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_a_start_refused_before_the_tools_load_imports_none_and_leaves_no_template(tmp_path: Path) -> None:
    """The template forked early waits for its configuration: an executor that refuses to start
    (its ipc endpoint is served already) never imports a tool module, and its template dies with it."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-test-"))
    endpoint = f"ipc://{sock_dir}/exec.sock"
    serve = [sys.executable, "-m", "executor.cli", "serve", "--tools", str(TOOLS / "import_marker.py"),
             "--bind", endpoint, "--workers", "1"]
    first_ws, second_ws = tmp_path / "first", tmp_path / "second"
    first_ws.mkdir()
    second_ws.mkdir()
    first = subprocess.Popen([*serve, "--workspace", str(first_ws)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with ExecutorClient(endpoint) as client:
            r = client.call(Call(tool="present"))
            assert r.ok and r.value is True, r  # the control: an executor that starts imports the module
        out = subprocess.run([*serve, "--workspace", str(second_ws)], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "another process is serving on it" in out.stderr, out.stderr
        assert not (second_ws / "imported-by").exists(), "a refused executor imported a tool module"
        wait_until("the refused executor's template to be gone", lambda: not _processes_naming(str(second_ws)),
                   timeout=10)
    finally:
        first.terminate()
        first.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_the_decision_names_what_makes_the_bare_fork_unsafe() -> None:
    assert quickfork.why_not() == "" or "threads" in quickfork.why_not()  # pytest may run threads of its own
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        assert "threads" in quickfork.why_not()
    finally:
        stop.set()
        t.join(5)


def test_watching_hooks_records_who_registered_through_either_name() -> None:
    real = os.register_at_fork
    before = list(quickfork._tool_hooks)
    undo = quickfork.watch_hooks()
    try:
        os.register_at_fork(after_in_child=lambda: None)
        posix.register_at_fork(after_in_child=lambda: None)  # the C module's own name for it
        assert quickfork._tool_hooks[len(before):] == [__name__, __name__]
        assert __name__ in quickfork.why_not()
    finally:
        undo()
        quickfork._tool_hooks[:] = before
    assert os.register_at_fork is real and posix.register_at_fork is real


def test_the_bare_fork_gives_the_child_a_reseeded_generator() -> None:
    """In-process: ``fork`` (bare or not) returns 0 in a child that draws other numbers than we do."""
    import random

    r, w = os.pipe()
    pid = quickfork.fork()
    if pid == 0:
        os.write(w, repr(random.random()).encode())
        os._exit(0)
    os.close(w)
    try:
        child = float(os.read(r, 100))
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert child != random.random()


def _pidfds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[pidfd]"
    return n


def test_the_supervisor_holds_a_pidfd_per_worker_and_drops_it_at_the_workers_exit(
        make_client: Callable[..., ExecutorClient]) -> None:
    """Workers are signalled through pidfds the template sends with each worker: one per worker
    process the supervisor may still have to kill, none kept for workers that are gone."""
    client = make_client(tools=[str(TESTS / "tools" / "faulty.py")], workers=2)
    supervisor = client.local.proc.pid  # type: ignore[attr-defined]
    wait_until("a pidfd for each ready worker", lambda: _pidfds(supervisor) >= 2, timeout=10)
    for _ in range(40):
        assert client.call(Call(tool="noop")).ok
    # 2 ready workers, plus at most the few that answered and await their kill: never 40.
    wait_until("the pidfds of the used workers to be closed", lambda: 2 <= _pidfds(supervisor) <= 4, timeout=10)


def test_a_pid_whose_pidfd_was_closed_is_never_signalled() -> None:
    """In-process, the pool's rule (``executor.slot.Pids``): a worker is killed through its pidfd; once
    its exit closed the pidfd, its number (which another process may hold by then) is left alone."""
    from executor.slot import Pids

    pool = Pids()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pool.have_pidfds = True
        pool.signal(bystander.pid)  # as if a worker of that pid had exited and been forgotten
        with pytest.raises(subprocess.TimeoutExpired):
            bystander.wait(0.2)
        pool.pidfds[bystander.pid] = os.pidfd_open(bystander.pid)
        pool.signal(bystander.pid)
        assert bystander.wait(10) == -signal.SIGKILL
        pool.forget(bystander.pid)
        assert not pool.pidfds
    finally:
        bystander.kill()
        bystander.wait(10)
