"""``ciayn-executor serve`` as an operator meets it: help, start-up errors, the ready line, shutdown on
a signal, and exiting with the process that started it. Every executor here is a real subprocess."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from controller import ExecutorClient, LocalExecutor
from executor.registry import load_tools
from protocol import Call
from tests.conftest import host_pid, pid_namespaces, template_of
from tests.support.net import free_port
from tests.support.processes import alive

FAULTY = str(Path(__file__).parent / "tools" / "faulty.py")
SERVE = [sys.executable, "-m", "executor.cli", "serve"]
START_WITHIN = 30.0  # seconds for a start-up to fail or succeed, on a loaded machine


def wait_until_dead(pids: list[int], within: float = 5.0) -> list[int]:
    """The pids still running after waiting up to ``within`` seconds for all of them to end."""
    deadline = time.monotonic() + within
    while (living := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return living


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} (parent {p.ppid()}, {p.status()}: {' '.join(p.cmdline())[:80]})")
        except psutil.NoSuchProcess:
            out.append(f"{pid} (gone)")
    return out


def tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [pid, *(p.pid for p in root.children(recursive=True))]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for ipc socket files (their paths are limited to about 100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ciayn-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``serve`` to completion (only for runs that must stop by themselves)."""
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=START_WITHIN,
                          stdin=subprocess.DEVNULL)


def read_stderr_until(proc: subprocess.Popen[str], marker: str, within: float = START_WITHIN) -> str:
    """The executor's stderr up to and including the first line holding ``marker``. Read from the raw
    descriptor: ``select`` on a buffered text file misses lines that one read already took into its
    buffer (two log lines arriving together left the second unseen until the bound ran out)."""
    assert proc.stderr is not None
    fd, data = proc.stderr.fileno(), b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
        text = data.decode(errors="replace")
        lines = text.splitlines(keepends=True)
        for n, line in enumerate(lines):
            if marker in line and line.endswith("\n"):
                return "".join(lines[: n + 1])
    raise AssertionError(f"no line with {marker!r} within {within} s; stderr so far:\n{data.decode(errors='replace')}")


# --------------------------------------------------------------------------------------- help


def test_serve_help_explains_every_option() -> None:
    out = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, timeout=START_WITHIN)
    assert out.returncode == 0
    for option in ("--tools", "--bind", "--workers", "--timeout", "--cpu-s", "--memory-mb", "--max-output-kb",
                   "--max-result-kb", "--max-queue", "--profile", "--workspace", "--parent-pid"):
        assert option in out.stdout, f"serve --help does not mention {option}"
    assert "@executor.tool" in out.stdout and "examples:" in out.stdout


def test_every_example_of_serve_help_starts_as_written(tmp_path: Path, sock_dir: Path) -> None:
    """Each example line of `serve --help` reaches "serving", with only its endpoint's address moved
    somewhere free (before: the plain tcp and the tcp --connect examples were refused as written)."""
    text = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, timeout=START_WITHIN).stdout
    examples = " ".join(text.split("examples:")[1].split("\n\n")[0].replace("\\\n", " ").split())
    commands = [c.split() for c in examples.split("ciayn-executor serve ")[1:]]
    assert len(commands) == 3
    (tmp_path / "my_tools.py").write_text(FETCH_TOOL)
    assert subprocess.run([sys.executable, "-m", "executor.cli", "keygen", "keys", "executor"], cwd=tmp_path,
                          capture_output=True, timeout=START_WITHIN).returncode == 0
    (tmp_path / "keys" / "clients").mkdir()
    for i, argv in enumerate(commands):
        for j, arg in enumerate(argv):
            if arg.startswith("ipc://"):
                argv[j] = f"ipc://{sock_dir}/{i}.sock"
            elif arg.startswith("tcp://"):
                argv[j] = f"tcp://127.0.0.1:{free_port()}"
        proc = subprocess.Popen([*SERVE, *argv], cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            read_stderr_until(proc, " serving ")
        finally:
            proc.terminate()
            proc.wait(10)


def test_serve_v_logs_at_debug(sock_dir: Path) -> None:
    proc = subprocess.Popen([*SERVE, "--tools", FAULTY, "--bind", f"ipc://{sock_dir}/v.sock", "-v"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert " DEBUG " in read_stderr_until(proc, " DEBUG ")  # e.g. "worker 1 ready", not shown at info
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_without_tools_is_a_usage_error() -> None:
    out = subprocess.run([*SERVE, "--bind", "ipc:///nonexistent/x.sock"], capture_output=True, text=True,
                         timeout=START_WITHIN)
    assert out.returncode == 2 and "--tools" in out.stderr


# ----------------------------------------------------------------------------- start-up errors


def _module(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return str(path)


FETCH_TOOL = "from executor import tool\n\n@tool\ndef fetch() -> int:\n    return 1\n"
STARTUP_ERRORS: dict[str, tuple[Callable[[Path], list[str]], list[str]]] = {
    "module raises at import": (
        lambda d: ["--tools", _module(d, "broken", "raise RuntimeError('tool module exploded')\n")],
        ["cannot start", "broken", "failed to import", "RuntimeError: tool module exploded"],
    ),
    "module calls sys.exit at import": (
        lambda d: ["--tools", _module(d, "quitter", "import sys\nsys.exit(4)\n")],
        ["cannot start", "quitter", "failed to import", "SystemExit"],
    ),
    "module crashes the interpreter at import": (
        lambda d: ["--tools", _module(d, "crasher", "import ctypes\nctypes.string_at(0)\n")],
        ["cannot start", "died while importing"],
    ),
    "nonexistent module path": (
        lambda d: ["--tools", str(d / "missing_tools.py")],
        ["cannot start", "missing_tools.py", "does not exist"],
    ),
    "nonexistent dotted module": (
        lambda d: ["--tools", "no_such_package.tools"],
        ["cannot start", "no_such_package", "ModuleNotFoundError"],
    ),
    "two modules with the same tool name": (
        lambda d: ["--tools", _module(d, "first", FETCH_TOOL), "--tools", _module(d, "second", FETCH_TOOL)],
        ["cannot start", "two tools are named 'fetch'", "first", "second"],
    ),
    "module without tools": (
        lambda d: ["--tools", _module(d, "empty", "X = 1\n")],
        ["cannot start", "no tools found"],
    ),
    "parent pid not running": (
        lambda d: ["--tools", FAULTY, "--parent-pid", str(_dead_pid())],
        ["cannot start", "parent process", "not running"],
    ),
}


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("case", list(STARTUP_ERRORS))
def test_a_bad_start_stops_with_a_clear_message_and_leaves_nothing(case: str, tmp_path: Path, sock_dir: Path) -> None:
    make_args, expected = STARTUP_ERRORS[case]
    sock = sock_dir / "exec.sock"
    out = serve("--bind", f"ipc://{sock}", *make_args(tmp_path))
    assert out.returncode != 0
    for text in expected:
        assert text in out.stderr, f"{text!r} missing from stderr:\n{out.stderr}"
    assert "Traceback" not in out.stderr, "a start-up error is a message, not a traceback"
    assert not sock.exists(), "a failed start left its socket file behind"


REFUSED_STARTS: dict[str, Callable[[Path], list[str]]] = {
    "plain tcp": lambda d: ["--bind", f"tcp://127.0.0.1:{free_port()}"],
    "abstract ipc": lambda d: ["--bind", f"ipc://@ciayn-test-{d.name}"],
    "a missing key file": lambda d: ["--bind", f"tcp://127.0.0.1:{free_port()}", "--curve-secret", str(d / "none")],
    "a dead parent": lambda d: ["--bind", f"ipc://{d}/x.sock", "--parent-pid", str(_dead_pid())],
}


@pytest.mark.parametrize("case", list(REFUSED_STARTS))
def test_a_refused_start_says_why_and_nothing_else(case: str, sock_dir: Path) -> None:
    """Before: each first printed `template: no configuration from the supervisor ([Errno 104]
    Connection reset by peer)`, the early template's complaint that its channel was closed with its
    first message unread."""
    out = serve("--tools", FAULTY, *REFUSED_STARTS[case](sock_dir))
    assert out.returncode == 1, out
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ciayn-executor: cannot start: "), out.stderr


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_an_endpoint_in_use_stops_start_up_with_a_clear_message(transport: str, sock_dir: Path) -> None:
    """Also for ipc, where ZeroMQ would silently replace the live executor's socket file."""
    endpoint = f"tcp://127.0.0.1:{free_port()}" if transport == "tcp" else f"ipc://{sock_dir}/exec.sock"
    insecure = ["--insecure"] if transport == "tcp" else []  # plain tcp is refused without it
    first = subprocess.Popen([*SERVE, "--tools", FAULTY, "--bind", endpoint, *insecure],
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        read_stderr_until(first, "serving")
        out = serve("--tools", FAULTY, "--bind", endpoint, *insecure)
        assert out.returncode != 0
        assert f"cannot bind {endpoint}" in out.stderr, out.stderr
        with ExecutorClient(endpoint) as client:
            assert client.call(Call(tool="noop")).ok, "the first executor must keep serving"
    finally:
        first.terminate()
        assert first.wait(10) == 0


def test_a_stopping_executor_removes_only_its_own_socket_file(sock_dir: Path) -> None:
    """The first executor's socket file was removed by hand and a second one serves on the same
    path: stopping the first must not delete the second's socket file."""
    endpoint = f"ipc://{sock_dir}/exec.sock"
    procs = []
    try:
        for _ in range(2):
            (sock_dir / "exec.sock").unlink(missing_ok=True)
            procs.append(subprocess.Popen([*SERVE, "--tools", FAULTY, "--bind", endpoint],
                                          stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            read_stderr_until(procs[-1], "serving")
        procs[0].terminate()
        assert procs[0].wait(10) == 0
        assert (sock_dir / "exec.sock").exists()
        with ExecutorClient(endpoint, connect_timeout=5) as client:
            assert client.call(Call(tool="noop")).ok, "the second executor is unreachable"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


# ------------------------------------------------------------------------------ running and stopping


def test_start_up_prints_the_endpoint_and_tool_count_on_stderr(sock_dir: Path) -> None:
    endpoint = f"ipc://{sock_dir}/exec.sock"
    proc = subprocess.Popen([*SERVE, "--tools", FAULTY, "--bind", endpoint, "--workers", "2"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = read_stderr_until(proc, "serving").splitlines()[-1]
        assert endpoint in line
        assert f"serving {len(load_tools([FAULTY]))} tools" in line
        assert "workers: 2" in line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert not (sock_dir / "exec.sock").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_cancels_the_running_call_and_leaves_nothing(
    signum: int, make_client: Callable[..., ExecutorClient], tmp_path: Path
) -> None:
    client = make_client(tools=[FAULTY], workers=2)
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None and local.dir is not None
    marker = tmp_path / "daemon.pid"
    running = client.submit(Call(tool="daemon_then_sleep", args=[str(marker)]))
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.01)
    daemon_pid = host_pid(local.proc.pid, int(marker.read_text()))  # the tool wrote its pid in its namespace
    pids = tree(local.proc.pid)
    assert daemon_pid in pids
    # supervisor, template, the busy worker and its daemon, and the workers forked ahead
    assert len(pids) >= 5, f"expected supervisor, template, workers and a daemon, got {pids}"

    local.proc.send_signal(signum)
    result = running.result(timeout=10)
    assert result.error is not None and result.error.kind == "cancelled", result
    assert local.proc.wait(10) == 0
    assert not (local.dir / "executor.sock").exists(), "the ipc socket file was not removed"
    survivors = wait_until_dead(pids)
    assert survivors == [], f"left running: {describe(survivors)} (of {pids}; daemon {daemon_pid})"
    assert "shutting down" in local.log_path.read_text()


STARTERS = {
    # By hand: ``serve --parent-pid`` with the starter's own pid.
    "serve --parent-pid": (
        "import os, signal, subprocess, sys\n"
        "endpoint = 'ipc://{dir}/exec.sock'\n"
        "cmd = {serve!r} + ['--tools', {faulty!r}, '--bind', endpoint, '--parent-pid', str(os.getpid())]\n"
        "p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)\n"
        "print(p.pid, endpoint, flush=True)\n"
        "signal.pause()\n"
    ),
    # A controller using LocalExecutor, which passes its pid.
    "LocalExecutor": (
        "import signal\n"
        "from controller import LocalExecutor\n"
        "local = LocalExecutor(tools=[{faulty!r}])\n"
        "local.start()\n"
        "print(local.proc.pid, local.endpoint, flush=True)\n"
        "signal.pause()\n"
    ),
}


@pytest.mark.parametrize("starter", list(STARTERS))
def test_the_executor_exits_when_the_process_that_started_it_dies(starter: str, sock_dir: Path) -> None:
    """Started by a process that is then SIGKILLed (so it can clean nothing up), the executor
    notices by itself and exits, taking its workers with it and removing its socket file."""
    code = STARTERS[starter].format(serve=SERVE, faulty=FAULTY, dir=sock_dir)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid_text, endpoint = parent.stdout.readline().split()
        with ExecutorClient(endpoint, connect_timeout=START_WITHIN) as client:
            assert client.call(Call(tool="noop")).ok
        deadline = time.monotonic() + START_WITHIN  # the worker that replaces the one used is forked shortly after
        while len(pids := tree(int(pid_text))) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pids) >= 3, f"expected supervisor, template and workers, got {describe(pids)}"
    finally:
        parent.kill()
        parent.wait(10)
    try:
        assert wait_until_dead(pids) == [], "the executor outlived the process that started it"
        assert not Path(endpoint[len("ipc://"):]).exists()
    finally:
        if starter == "LocalExecutor":  # the killed controller could not remove its private dir
            shutil.rmtree(Path(endpoint[len("ipc://"):]).parent, ignore_errors=True)

def test_a_tool_that_kills_the_template_is_answered_and_the_executor_recovers(
    make_client: Callable[..., ExecutorClient],
) -> None:
    """In the default profile a tool runs as the executor's uid. Where workers have a PID namespace
    of their own (as root), its template is that namespace's init, which its SIGKILL cannot touch:
    the call hangs until its timeout and the template stays. Elsewhere it kills the template: the
    call that did it is answered, a new template is made, later calls succeed, and the old
    template's tree is gone."""
    client = make_client(tools=[FAULTY])
    local: LocalExecutor = client.local  # type: ignore[attr-defined]
    assert local.proc is not None and local.dir is not None
    template = template_of(local.proc.pid)
    old = [p for p in tree(local.proc.pid) if p != local.proc.pid]
    r = client.call(Call(tool="kill_parent"), timeout=2 if pid_namespaces() else 20)
    for _ in range(3):
        assert client.call(Call(tool="noop"), timeout=20).ok
    assert local.proc.poll() is None
    if pid_namespaces():
        assert r.error is not None and r.error.kind == "timeout", r
        assert template_of(local.proc.pid) == template and "replacing it" not in local.log_path.read_text()
    else:
        assert r.error is not None and r.error.kind in ("cancelled", "crashed"), r
        assert "replacing it" in local.log_path.read_text()
        assert wait_until_dead(old) == []


def test_a_relative_tool_file_is_found_from_where_the_command_ran_even_with_a_workspace(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "my_tools.py").write_text(
        "from executor import tool\n\n@tool\ndef hello() -> str:\n    \"\"\"Say hi.\"\"\"\n    return 'hi'\n"
    )
    out = subprocess.run([sys.executable, "-m", "controller.cli", "call", "hello()", "--tools", "./my_tools.py",
                          "--workspace", "ws"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hi"
