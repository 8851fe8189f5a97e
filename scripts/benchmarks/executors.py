"""Executors for the benchmarks, started the way users start them: one executor on a private ipc
endpoint (``LocalExecutor``, with any extra ``serve`` flags), or a pool behind
``ciayn-executor broker`` over tcp on loopback (once the broker exists)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import zmq

from controller import ExecutorClient, LocalExecutor
from protocol import Hello, Welcome, decode, encode

from .features import Features
from .paths import HERE

BENCH_TOOLS = str(HERE / "tools.py")
WHATIF = str(HERE / "whatif.py")
POOL_READY_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0


class BenchExecutor(LocalExecutor):
    """``LocalExecutor`` that passes extra ``serve`` flags (``--reuse-workers``, ...) through, and
    can start the executor with benchmark-only what-if ``patches`` (see whatif.py)."""

    def __init__(self, *, extra: list[str] | None = None, patches: list[str] | None = None,
                 **options: object) -> None:
        super().__init__(tools=[BENCH_TOOLS], **options)  # type: ignore[arg-type]
        self.extra = list(extra or [])
        self.patches = list(patches or [])

    def command(self) -> list[str]:
        command = [*super().command(), *self.extra]
        if not self.patches:
            return command
        if command[1:3] != ["-m", "executor.cli"]:
            raise RuntimeError(f"cannot apply what-if patches to {command[:3]}")
        # -P: the script's folder (this package's, whose module names are generic) is not put on the
        # executor's sys.path; it imports executor/ as ``-m executor.cli`` would.
        return [command[0], "-P", WHATIF, ",".join(self.patches), "--", *command[3:]]


@dataclass
class Running:
    """A started executor (or pool): where to call it, and the processes that make it up."""

    endpoint: str
    client: ExecutorClient
    roots: list[int] = field(default_factory=list)  # supervisors (and the broker)

    def supervisor(self) -> psutil.Process:
        return psutil.Process(self.roots[0])


@contextlib.contextmanager
def direct(workers: int = 1, *, extra: list[str] | None = None, patches: list[str] | None = None,
           **options: object) -> Iterator[Running]:
    """One executor over ipc with ``workers`` workers."""
    local = BenchExecutor(workers=workers, extra=extra, patches=patches, **options)
    client = local.start()
    try:
        assert local.proc is not None
        yield Running(local.endpoint, client, [local.proc.pid])
    finally:
        local.stop()


class Shared:
    """Executors kept for the whole run and handed to every figure that asks for the same flavour:
    for the hardened profile, whose start (a selfcheck of every layer) takes seconds."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.running: dict[tuple[object, ...], Running] = {}

    @contextlib.contextmanager
    def get(self, workers: int = 1, *, extra: list[str] | None = None, **options: object) -> Iterator[Running]:
        """Like ``direct``, but the executor outlives the ``with`` (until ``close``)."""
        key = (workers, tuple(extra or ()), tuple(sorted(options.items())))
        if key not in self.running:
            self.running[key] = self.stack.enter_context(direct(workers, extra=extra, **options))  # type: ignore[arg-type]
        yield self.running[key]

    def close(self) -> None:
        self.stack.close()
        self.running.clear()


SHARED = Shared()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def brokered(features: Features, workers: int, executors: int = 2, *, extra: list[str] | None = None,
             **options: object) -> Iterator[Running]:
    """A broker on loopback tcp and ``executors`` executors (``serve --connect``) sharing ``workers``
    workers between them; yields once the pool answers ``hello`` with all of them."""
    tmp = Path(tempfile.mkdtemp(prefix="ciayn-bench-pool-"))
    frontend, backend = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "executor.cli"]
    broker = [*base, "broker", "--frontend", frontend, "--backend", backend]
    if features.insecure_flag_broker:
        broker.append("--insecure")
    if features.broker_recovery_flag:
        broker += ["--recovery-s", "0"]
    commands = [broker]
    counts = [workers // executors + (1 if i < workers % executors else 0) for i in range(min(executors, workers))]
    for n in counts:
        serve = [*base, "serve", "--tools", BENCH_TOOLS, "--connect", backend, "--workers", str(n),
                 "--parent-pid", str(os.getpid())]
        for key, value in options.items():
            serve += [f"--{key.replace('_', '-')}", str(value)]
        if features.insecure_flag_serve:
            serve.append("--insecure")
        serve += extra or []
        commands.append(serve)
    procs: list[subprocess.Popen[bytes]] = []
    client: ExecutorClient | None = None
    try:
        for i, command in enumerate(commands):
            with open(tmp / f"{i}.log", "wb") as log:
                procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                              start_new_session=True))
        _wait_for_pool(frontend, workers, procs, tmp)
        client = ExecutorClient(frontend, timeout=30)
        client.tools()
        yield Running(frontend, client, [p.pid for p in procs])
    finally:
        if client is not None:
            client.close()
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_for_pool(frontend: str, workers: int, procs: list[subprocess.Popen[bytes]], logs: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend)
    deadline = time.monotonic() + POOL_READY_TIMEOUT
    seen = 0
    try:
        while time.monotonic() < deadline:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a pool process exited with code {dead[0].returncode}: {_tails(logs)}")
            sock.send_multipart(encode(Hello(client="bench")))
            if sock.poll(500):
                msg = decode(sock.recv_multipart())
                if isinstance(msg, Welcome):
                    seen = msg.workers
                    if seen >= workers:
                        return
            time.sleep(0.05)
        raise RuntimeError(f"the pool offered {seen} of {workers} workers after {POOL_READY_TIMEOUT:g} s: "
                           f"{_tails(logs)}")
    finally:
        sock.close(0)
        ctx.term()


def _tails(logs: Path) -> str:
    parts = []
    for path in sorted(logs.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()[-5:]
        parts.append(f"{path.name}: " + " | ".join(lines))
    return "; ".join(parts)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
