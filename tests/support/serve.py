"""One ``ciayn-executor serve`` process started by hand, as the start-up and replacement red teams
start theirs: its own workspace (where every process it starts runs, so the leftovers are found),
a private ipc endpoint or a broker's, the template's import bound optionally shortened; plus the
raw DEALER sockets and the bounded collecting those tests talk to it with, and the fixtures that
clean both up (``executors``, ``ctx``: import them by name into the test module)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from protocol import decode
from tests.support.waiting import wait_until

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
GATE = str(TESTS / "tools" / "startup_gate.py")  # its import blocks until the test writes release
FLAKY = str(TESTS / "tools" / "startup_flaky.py")

# Only what the executor would keep anyway: it then does not exec itself again without secrets
# (``reexec_without_secrets``), so a constant patched by ``PATCHED`` stays patched.
ENV = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
# ``serve`` with the template's import bound (``executor.keeper.TEMPLATE_START_TIMEOUT``, 60 s) made
# shorter, so that a test can go past it within the suite's time; nothing else is changed.
PATCHED = ("import sys, executor.keeper as k; k.TEMPLATE_START_TIMEOUT = float(sys.argv.pop(1)); "
           "from executor.cli import main; sys.exit(main())")
EXIT_BOUND = 5.0  # seconds in which an executor told to stop (or unable to start) must have exited
MiB = 1024 * 1024


class Executor:
    """One ``ciayn-executor serve`` process with its own workspace and a private ipc endpoint
    (``--bind``) or a broker's (``connect``), in its own session; always cleaned up (``close``)."""

    def __init__(self, tmp: Path, tools: list[str], *args: str, connect: str | None = None,
                 import_timeout: float | None = None, name: str = "ex") -> None:
        self.workspace = tmp / f"ws-{name}"
        self.workspace.mkdir(exist_ok=True)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="ciayn-su-"))  # short: an ipc path has 107 bytes at most
        self.sock = self.sock_dir / "exec.sock"
        self.endpoint = f"ipc://{self.sock}"
        self.log_path = tmp / f"{name}.log"
        cmd = [sys.executable, "-c", PATCHED, str(import_timeout)] if import_timeout else [
            sys.executable, "-m", "executor.cli"]
        cmd += ["serve", "--workers", "1", "--workspace", str(self.workspace)]
        for t in tools:
            cmd += ["--tools", t]
        cmd += ["--connect", connect] if connect else ["--bind", self.endpoint]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([*cmd, *args], cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, name: str, timeout: float = 20.0) -> None:
        """Until the tool module left ``name`` in the workspace (or the executor exited: say why)."""
        def there() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the executor exited ({self.proc.returncode}) before {name}: {self.log()}")
            return (self.workspace / name).exists()

        wait_until(f"{name!r} in the workspace", there, timeout)

    def release(self, text: str = "") -> None:
        tmp = self.workspace / "release.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.workspace / "release")  # whole at once: the module reads it as it appears

    def wait_exit(self, timeout: float = EXIT_BOUND) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the executor did not exit within {timeout:g} s: {self.log()}") from None

    def leftovers(self) -> list[str]:
        """Processes of this executor that are still there: all of them (supervisor, template,
        workers, what a tool started) run in its workspace."""
        found = []
        for p in psutil.process_iter(["pid", "cwd", "cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                if p.info["cwd"] == str(self.workspace) and p.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])[:120]}")
        return found

    def assert_nothing_left(self) -> None:
        wait_until("every process of the executor to be gone", lambda: not self.leftovers(), EXIT_BOUND)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(EXIT_BOUND)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: whatever it left in it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(EXIT_BOUND)
        for pid in [int(line.split()[0]) for line in self.leftovers()]:  # only processes in its workspace
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@pytest.fixture
def executors(tmp_path: Path) -> Iterator[list[Executor]]:
    started: list[Executor] = []
    yield started
    for ex in started:
        ex.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start(executors: list[Executor], tmp: Path, tools: list[str], *args: str, **kw: Any) -> Executor:
    ex = Executor(tmp, tools, *args, name=f"ex{len(executors)}", **kw)
    executors.append(ex)
    return ex


def dealer(ctx: zmq.Context[Any], endpoint: str, ident: bytes) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, ident)
    sock.connect(endpoint)
    return sock


def collect(socks: list[zmq.Socket[bytes]], done: Any, timeout: float) -> dict[int, list[Any]]:
    """Every message the sockets receive until ``done(messages)`` holds, bounded by ``timeout``."""
    got: dict[int, list[Any]] = {i: [] for i in range(len(socks))}
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    index = {s: i for i, s in enumerate(socks)}
    deadline = time.monotonic() + timeout
    while not done(got):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout:g} s; got {got}")
        for sock, _ in poller.poll(int(left * 1000) + 1):
            while sock.poll(0):
                got[index[sock]].append(decode(sock.recv_multipart()))
    return got


def rss(pid: int, field: str = "VmRSS") -> int:
    """A ``/proc/PID/status`` memory field, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")
