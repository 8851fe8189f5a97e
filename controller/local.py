"""``LocalExecutor``: a private executor for one controller, started and stopped with it.

Its files (the ipc socket and the executor's log) live in ``/tmp/ciayn-executor-<controller pid>-*``,
a 0700 directory removed on exit. A controller killed with SIGKILL cannot remove it; the executor
exits on its own (``--parent-pid``), and the next ``LocalExecutor`` to start removes directories
whose controller is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType

from controller.client import ExecutorClient, ExecutorUnavailable
from protocol import Call, Result, ToolSpec
from protocol.environment import allowed_environment
from protocol.errors import CiaynError

START_TIMEOUT = 60.0
STOP_TIMEOUT = 5.0
DIR_PREFIX = "ciayn-executor-"
_FLAG_NAMES = {
    "workers": "--workers",
    "timeout": "--timeout",
    "max_timeout": "--max-timeout",
    "cpu_s": "--cpu-s",
    "memory_mb": "--memory-mb",
    "max_output_kb": "--max-output-kb",
    "max_result_kb": "--max-result-kb",
    "max_queue": "--max-queue",
    "profile": "--profile",  # "hardened": needs root; its selfcheck gates the start (ExecutorStartError)
    "workspace_rw": "--workspace-rw",  # a switch, with profile="hardened": tools may write the workspace
    "workspace_quota": "--workspace-quota",
    "log_level": "--log-level",
    "max_processes": "--max-processes",
    "no_cgroups": "--no-cgroups",  # a switch: True adds it
    "reuse_workers": "--reuse-workers",  # a switch: tools are trusted, workers run call after call
    "max_queue_mb": "--max-queue-mb",
    "max_queue_wait": "--max-queue-wait",
}


def executor_environment(pass_env: Sequence[str]) -> dict[str, str]:
    """The environment an executor is started with: the tools' allowlist (``protocol.environment``),
    so the controller's API keys never reach a tool unless passed on purpose, plus what Python needs
    to find the project (``PYTHONPATH``, ``VIRTUAL_ENV``)."""
    env = allowed_environment(os.environ, pass_env)
    env.update({k: os.environ[k] for k in ("PYTHONPATH", "VIRTUAL_ENV") if k in os.environ})
    return env


class ExecutorStartError(CiaynError, RuntimeError):
    """The executor did not come up; the message includes the tail of its stderr."""


def sweep_stale_dirs(tmp: str | None = None) -> list[Path]:
    """Remove private executor directories (``ciayn-executor-<pid>-*``) of this user whose
    controller process no longer exists; the ones removed."""
    removed: list[Path] = []
    root = Path(tmp or tempfile.gettempdir())
    for entry in root.glob(f"{DIR_PREFIX}*-*"):
        pid_text = entry.name[len(DIR_PREFIX) :].split("-", 1)[0]
        try:
            pid = int(pid_text)
            if entry.lstat().st_uid != os.getuid() or not entry.is_dir():
                continue
        except (ValueError, OSError):
            continue
        try:
            os.kill(pid, 0)
            continue  # its controller is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


class LocalExecutor:
    """Start ``ciayn-executor serve`` on an ipc endpoint in a private 0700 directory, yield a
    connected ``ExecutorClient``, and stop the executor on exit. The executor is told our pid
    (``--parent-pid``), so it also exits if this process dies without cleaning up.

        with LocalExecutor(tools=["executor.toolkits.builtin"], workspace="ws", timeout=10) as client:
            client.call_text('list_dir(".")')

    It is also a ``ToolClient`` itself once started (``tools``/``submit``/``call``/``cancel`` go to
    its client). ``pass_env`` names environment variables the executor hands to tools
    (``ciayn-executor serve --pass-env``); every other variable is withheld from them."""

    def __init__(
        self,
        tools: Sequence[str],
        *,
        workspace: str | os.PathLike[str] | None = None,
        client_timeout: float | None = None,
        pass_env: Sequence[str] = (),
        **limits: object,
    ) -> None:
        unknown = set(limits) - set(_FLAG_NAMES)
        if unknown:
            raise TypeError(f"unknown executor option(s): {', '.join(sorted(unknown))}")
        if not tools:
            raise ValueError("LocalExecutor needs at least one tool module")
        self.modules = list(tools)  # the tool modules it serves
        self.workspace = Path(workspace).resolve() if workspace is not None else None
        self.limits = limits
        self.pass_env = list(pass_env)
        self.client_timeout = client_timeout
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: ExecutorClient | None = None

    @property
    def endpoint(self) -> str:
        assert self.dir is not None, "the executor is not started"
        return f"ipc://{self.dir}/executor.sock"

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "executor.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "executor.cli", "serve", "--bind", self.endpoint, "--parent-pid", str(os.getpid())]
        for t in self.modules:
            cmd += ["--tools", str(t)]
        if self.workspace is not None:
            cmd += ["--workspace", str(self.workspace)]
        for name in self.pass_env:
            cmd += ["--pass-env", name]
        for key, value in self.limits.items():
            if value is True:
                cmd.append(_FLAG_NAMES[key])
            elif value is not None and value is not False:
                cmd += [_FLAG_NAMES[key], str(value)]
        return cmd

    def start(self) -> ExecutorClient:
        sweep_stale_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))  # mode 0700
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, env=executor_environment(self.pass_env))
        finally:
            log.close()
        client = ExecutorClient(self.endpoint, connect_timeout=0.2, timeout=self.client_timeout)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                client.close()
                tail = self.log_tail()
                self.stop()
                raise ExecutorStartError(
                    f"the executor exited with code {self.proc.returncode} before it was ready.\n{tail}")
            try:
                client.tools(timeout=0.2)
                break
            except ExecutorUnavailable:
                if time.monotonic() > deadline:
                    client.close()
                    tail = self.log_tail()
                    self.stop()
                    raise ExecutorStartError(
                        f"the executor did not answer within {START_TIMEOUT:g} s.\n{tail}") from None
        client.connect_timeout = 10.0
        self.client = client
        return client

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except (OSError, AssertionError):
            return "(no executor log)"
        return "executor log (last lines):\n" + "\n".join("  " + line for line in text[-lines:])

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def kill(self) -> None:
        """Stop at once, without waiting (a second Ctrl-C): SIGKILL the executor's process group and
        remove its directory."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # The ToolClient protocol, through the started executor's client.

    def _client(self) -> ExecutorClient:
        if self.client is None:
            raise RuntimeError("the LocalExecutor is not started (use it as a context manager or call start())")
        return self.client

    def tools(self) -> list[ToolSpec]:
        return self._client().tools()

    def submit(self, call: Call, timeout: float | None = None) -> Future[Result]:
        return self._client().submit(call, timeout)

    def call(self, call: Call, timeout: float | None = None) -> Result:
        return self._client().call(call, timeout)

    def cancel(self, call_id: str) -> None:
        self._client().cancel(call_id)

    def __enter__(self) -> ExecutorClient:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
