"""Everything a no-op tool call is compared against, each with ``block(n) -> [seconds per call]``:
the bare ZeroMQ echo (the floor), a bare socketpair echo (the worker channel's floor), our executor
through a plain DEALER and through ``ExecutorClient``, an in-process call, a Jupyter kernel and a
fresh ``python -c`` per call. Every one runs ``tools.noop`` (or ``stamp``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq

from controller import ExecutorClient
from protocol import Call, Hello, Result, decode, encode
from protocol.codec import VERSION

from . import tools
from .paths import PACKAGE, ROOT, module_command

PEER_START_TIMEOUT = 30.0
KERNEL_TIMEOUT = 60.0
ANSWER_TIMEOUT_MS = 10_000  # a plain-DEALER peer's answer to one call
ECHO_BODY = {"tool": "noop", "args": [], "kwargs": {}, "id": "0" * 32}
CHANNEL_REQUEST = {"seq": 1, "tool": "noop", "args": [], "kwargs": {}, "limits": None}
PAUSE_S = 0.02  # between calls "at agent pacing": every process is asleep when the next one comes
BURSTS = (3, 5)  # ``Bursts``: clients at once, calls a burst (PAUSE_S between bursts)


def start_peer(*args: str, pass_fds: tuple[int, ...] = (), module: str = "peers") -> subprocess.Popen[str]:
    proc = subprocess.Popen(module_command(module, *args), cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)
    assert proc.stdout is not None
    ready = read_line(proc, PEER_START_TIMEOUT)
    if ready.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"benchmark peer {args[0]} did not start (said {ready!r})")
    return proc


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line of a peer's stdout, waiting at most ``timeout`` seconds."""
    assert proc.stdout is not None
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise RuntimeError(f"benchmark peer {proc.args!r} said nothing within {timeout:g} s")
    return proc.stdout.readline()


def stop_peer(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ZmqEcho:
    """The floor: a bare pyzmq DEALER/ROUTER msgpack echo between two processes over ipc. Its
    client loop serves every peer answered by a plain DEALER (``archfloor.ArchFloor``): a peer that
    died fails the run within ``ANSWER_TIMEOUT_MS``, never hangs it."""

    name = "bare pyzmq DEALER/ROUTER echo (floor)"

    def __init__(self, tmp: str) -> None:
        endpoint = f"ipc://{tmp}/echo-{uuid.uuid4().hex[:8]}.sock"
        self._connect(start_peer("zmq-echo", endpoint), endpoint, warm_up=50)

    def _connect(self, proc: subprocess.Popen[str], endpoint: str, warm_up: int) -> None:
        self.proc = proc
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, ANSWER_TIMEOUT_MS)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.block(warm_up)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _check(self, answer: Any) -> None:
        """Raise if ``answer`` is not what the peer should send (an echo: anything)."""

    def block(self, n: int) -> list[float]:
        times = []
        sock, body = self.sock, ECHO_BODY
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send(msgpack.packb(body))
            try:
                answer = msgpack.unpackb(sock.recv())
            except zmq.Again:
                raise RuntimeError(f"{self.name} did not answer within {ANSWER_TIMEOUT_MS} ms") from None
            times.append(time.perf_counter() - t0)
            self._check(answer)
        return times

    def close(self) -> None:
        self.sock.send(b"stop")
        stop_peer(self.proc)
        self.sock.close(0)
        self.ctx.term()


class ChannelEcho:
    """The worker channel's floor: length-prefixed msgpack frames over a socketpair to another
    process, as the supervisor talks to a worker."""

    name = "bare socketpair echo (worker channel floor)"

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = start_peer("chan-echo", str(theirs.fileno()), pass_fds=(theirs.fileno(),))
        theirs.close()
        self.block(50)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def block(self, n: int) -> list[float]:
        from .archtemplate import HEADER, recv_exact

        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            body = msgpack.packb(CHANNEL_REQUEST, use_bin_type=True)
            self.sock.sendall(HEADER.pack(len(body)) + body)
            (size,) = HEADER.unpack(recv_exact(self.sock, HEADER.size))
            msgpack.unpackb(recv_exact(self.sock, size))
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.sock.close()
        stop_peer(self.proc)


class Dealer:
    """Our executor from a plain DEALER socket in this thread: no client thread, no futures."""

    def __init__(self, endpoint: str, name: str, tool: str = "noop") -> None:
        self.name = name
        self.tool = tool
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart(encode(Hello(client="bench")))
        if not self.sock.poll(int(PEER_START_TIMEOUT * 1000)):
            raise RuntimeError(f"no executor answered at {endpoint}")
        self.sock.recv_multipart()
        self.prefix = uuid.uuid4().hex[:16]
        self.serial = 0
        self.block(20)

    def _call(self) -> Call:
        self.serial += 1
        return Call(id=f"{self.prefix}-{self.serial}", tool=self.tool)

    def block(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            call = self._call()
            t0 = time.perf_counter()
            self.sock.send_multipart(encode(call))
            result = decode(self.sock.recv_multipart())
            times.append(time.perf_counter() - t0)
            _check(result)
        return times

    def stamped(self, n: int) -> list[tuple[int, int, int, int, int]]:
        """``n`` calls of the ``stamp`` tool: (start, sent, tool ran, received, decoded) in ns, one clock."""
        rows = []
        clock = time.perf_counter_ns
        for _ in range(n):
            self.serial += 1
            call = Call(id=f"{self.prefix}-{self.serial}", tool="stamp")
            t0 = clock()
            frames = encode(call)
            self.sock.send_multipart(frames)
            t1 = clock()
            reply = self.sock.recv_multipart()
            t2 = clock()
            result = decode(reply)
            t3 = clock()
            _check(result)
            rows.append((t0, t1, int(result.value), t2, t3))  # type: ignore[union-attr]
        return rows

    def last_frames(self) -> tuple[list[bytes], list[bytes]]:
        """One real call's request and reply frames (for timing the codec on real messages)."""
        self.serial += 1
        request = encode(Call(id=f"{self.prefix}-{self.serial}", tool="noop"))
        self.sock.send_multipart(request)
        return request, self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class RawDealer(Dealer):
    """``Dealer`` with no codec of ours on the client: the call packed and the reply read with msgpack
    alone, nothing checked but ``ok``. What no real client should do; it bounds what the client's
    codec costs (``callpath.CUTS``)."""

    def block(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            self.serial += 1
            t0 = time.perf_counter()
            self.sock.send_multipart([VERSION, b"call", msgpack.packb({"id": f"{self.prefix}-{self.serial}",
                                                                        "tool": self.tool})])
            body = msgpack.unpackb(self.sock.recv_multipart()[2])
            times.append(time.perf_counter() - t0)
            if not body.get("ok"):
                raise RuntimeError(f"a benchmark call failed: {body}")
        return times


class ClientCalls:
    """Our executor through ``ExecutorClient.call`` (its I/O thread, a future per call)."""

    def __init__(self, client: ExecutorClient, name: str, tool: str = "noop") -> None:
        self.client = client
        self.name = name
        self.tool = tool
        self.block(20)

    def block(self, n: int) -> list[float]:
        times = []
        call = Call(tool=self.tool)
        for _ in range(n):
            t0 = time.perf_counter()
            result = self.client.call(call)
            times.append(time.perf_counter() - t0)
            _check(result)
        return times

    def stamped(self, n: int) -> list[tuple[int, int, int]]:
        """(start, tool ran, result in hand) in ns for ``n`` calls of ``stamp``."""
        rows = []
        call = Call(tool="stamp")
        for _ in range(n):
            t0 = time.perf_counter_ns()
            result = self.client.call(call)
            t2 = time.perf_counter_ns()
            _check(result)
            rows.append((t0, int(result.value), t2))
        return rows

    def close(self) -> None:
        pass  # the client belongs to its executor


class InProcess:
    """The same function called in this process: what RA.Aid does (no isolation at all)."""

    name = "in-process call (no isolation)"

    def block(self, n: int) -> list[float]:
        times = []
        fn = tools.noop
        clock = time.perf_counter
        for _ in range(n):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return times

    def close(self) -> None:
        pass


class FreshPython:
    """A fresh ``python -c`` per call that imports the tool module and calls the function: what a
    naive sandbox does."""

    name = "fresh `python -c` per call"

    def __init__(self) -> None:
        self.command = [sys.executable, "-c", f"from {PACKAGE} import tools; tools.noop()"]

    def block(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.run(self.command, cwd=ROOT, check=True, stdin=subprocess.DEVNULL, timeout=60)
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        pass


class JupyterKernel:
    """An IPython kernel (ipykernel) driven by ``jupyter_client``: ``execute`` of the same function,
    timed until its shell ``execute_reply``. The kernel runs this interpreter, with its own
    runtime and IPython directories under a temporary directory, started in the project root (so
    it imports the tool module as this package's)."""

    name = "Jupyter kernel execute (ipykernel, shell reply)"
    SETUP = f"from {PACKAGE} import tools"

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.tmp = tempfile.mkdtemp(prefix="ciayn-bench-jupyter-")
        spec_dir = Path(self.tmp, "kernels", "ciayn-bench")
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "ciayn bench", "language": "python"}))
        self._env = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR")}
        os.environ.update(JUPYTER_PATH=self.tmp, JUPYTER_RUNTIME_DIR=os.path.join(self.tmp, "runtime"),
                          IPYTHONDIR=os.path.join(self.tmp, "ipython"))
        self.km = KernelManager(kernel_name="ciayn-bench")
        started = time.perf_counter()
        self.km.start_kernel(cwd=str(ROOT))
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=KERNEL_TIMEOUT)
        self.execute(self.SETUP)
        self.start_s = time.perf_counter() - started
        self.block(5)

    def execute(self, code: str) -> None:
        msg_id = self.kc.execute(code, store_history=False)
        deadline = time.monotonic() + KERNEL_TIMEOUT
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.001, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the kernel answered {reply['content']}")

    def drain_iopub(self) -> None:
        """Drop the iopub messages (busy/idle, execute_input) that pile up; not timed."""
        with contextlib.suppress(Exception):
            while self.kc.iopub_channel.msg_ready():
                self.kc.iopub_channel.get_msg(timeout=0)

    def block(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.execute("tools.noop()")
            times.append(time.perf_counter() - t0)
        self.drain_iopub()
        return times

    def restart_and_answer(self) -> float:
        """Seconds from ``restart_kernel(now=True)`` (kill and start) to the reply of the same
        function's call in the new kernel (its tool module imported again, as it must be)."""
        t0 = time.perf_counter()
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=KERNEL_TIMEOUT)
        self.execute(self.SETUP + "; tools.noop()")
        elapsed = time.perf_counter() - t0
        self.drain_iopub()
        return elapsed

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=True)
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(self.tmp, ignore_errors=True)


def _check(result: Any) -> None:
    if not isinstance(result, Result) or not result.ok:
        raise RuntimeError(f"a benchmark call failed: {result}")


class Calls(Protocol):
    def block(self, n: int) -> list[float]: ...


class Paced:
    """``inner``'s calls ``PAUSE_S`` apart (the pause not timed)."""

    def __init__(self, inner: Calls) -> None:
        self.inner = inner

    def block(self, n: int) -> list[float]:
        out: list[float] = []
        for _ in range(n):
            time.sleep(PAUSE_S)
            out += self.inner.block(1)
        return out


class Bursts:
    """Several clients at once, each sending ``BURSTS[1]`` calls back to back then pausing
    ``PAUSE_S``: a pool's load between an agent's pace and a flood. Each block has its own clients
    (an ``ExecutorClient`` and a thread each, one untimed call first), closed after it: nothing of
    them runs while other blocks are timed."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def block(self, n: int) -> list[float]:
        """``n`` calls from each client; every call's time."""
        clients = [ExecutorClient(self.endpoint) for _ in range(BURSTS[0])]
        out: list[list[float]] = [[] for _ in clients]

        def run(client: ExecutorClient, times: list[float]) -> None:
            _check(client.call(Call(tool="noop")))
            for i in range(n):
                if i and i % BURSTS[1] == 0:
                    time.sleep(PAUSE_S)
                t0 = time.perf_counter()
                result = client.call(Call(tool="noop"))
                times.append(time.perf_counter() - t0)
                _check(result)

        threads = [threading.Thread(target=run, args=(c, t)) for c, t in zip(clients, out, strict=True)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            for client in clients:
                client.close()
        if sum(map(len, out)) != n * len(clients):
            raise RuntimeError("a client of the bursts failed (its error is above)")
        return [t for times in out for t in times]
