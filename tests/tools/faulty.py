"""Tools that misbehave in every way the executor must survive (the fault suite's cast)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from executor import signals, tool

_counter = 0


@tool
def noop() -> None:
    """Do nothing."""


@tool
def echo(value: object = None) -> object:
    """Return the value given."""
    return value


@tool
def counter() -> int:
    """Count calls in this worker (module state persists until the worker is replaced)."""
    global _counter
    _counter += 1
    return _counter


@tool
def whoami() -> dict[str, int]:
    """The worker's pid."""
    return {"pid": os.getpid()}


@tool
def sleep_forever() -> None:
    """Hang."""
    while True:
        time.sleep(3600)


@tool
def busy_loop() -> None:
    """Spin on the CPU forever."""
    while True:
        pass


@tool
def ignore_sigterm_then_sleep() -> None:
    """Ignore SIGTERM and hang."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)


@tool
def allocate_forever() -> int:
    """Allocate memory until something stops it."""
    hoard = []
    while True:
        hoard.append(bytearray(16 * 1024 * 1024))


@tool
def segfault() -> None:
    """Crash the interpreter."""
    ctypes.string_at(0)


@tool
def hard_exit() -> None:
    """os._exit(7)."""
    os._exit(7)


@tool
def sys_exit() -> None:
    """sys.exit(3)."""
    sys.exit(3)


@tool
def keyboard_interrupt() -> None:
    """Raise KeyboardInterrupt."""
    raise KeyboardInterrupt


@tool
def recurse(n: int = 0) -> int:
    """Recurse without end."""
    return recurse(n + 1) + 1


@tool
def print_flood(mb: int = 300) -> None:
    """Print hundreds of MB."""
    line = "x" * 1023 + "\n"
    for _ in range(mb * 1024):
        sys.stdout.write(line)


@tool
def huge_string(mb: int = 64) -> str:
    """Return a huge string."""
    return "y" * (mb * 1024 * 1024)


@tool
def unpackable() -> object:
    """Return something msgpack cannot carry."""
    return {1, 2, 3}


@tool
def unreprable() -> object:
    """Return an object that msgpack cannot carry and whose repr fails."""

    class Bad:
        def __repr__(self) -> str:
            raise RuntimeError("no repr for you")

    return Bad()


@tool
def read_stdin() -> str:
    """Read stdin to the end."""
    return sys.stdin.read()


@tool
def daemon() -> int:
    """Double-fork a daemon that outlives the call unless killed; return its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.close(r)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(3600)
            os._exit(0)
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    daemon_pid = int(os.read(r, 64).decode())
    os.close(r)
    return daemon_pid


@tool
def fork_children(n: int = 200) -> list[int]:
    """Fork n sleeping children and return their pids."""
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        pids.append(pid)
    return pids


@tool
def fail(message: str = "boom") -> None:
    """Raise a plain exception."""
    raise ValueError(message)


@tool
def shout(text: str = "hello") -> str:
    """Print to stdout and stderr, then return."""
    print(text)
    print(f"err:{text}", file=sys.stderr)
    return text


@tool
def finish(summary: str = "done") -> str:
    """Signal task completion."""
    signals.complete(summary)
    return "ok"


@tool(timeout=0.5)
def slow_with_own_timeout() -> None:
    """Sleep longer than this tool's own 0.5 s timeout."""
    time.sleep(30)


@tool(idempotent=True, no_repeat=True, bundleable=True)
def flagged(x: int) -> int:
    """A tool with every flag."""
    return x


@tool
def nap(seconds: float = 0.2) -> float:
    """Sleep a while, then return how long."""
    time.sleep(seconds)
    return seconds


@tool
def append_line(path: str, text: str = "ran", then_sleep: float = 0.0) -> int:
    """Append a line to a file (a side effect visible outside the executor), optionally sleep, and
    return how many lines the file holds now."""
    with open(path, "a") as f:
        f.write(text + "\n")
    time.sleep(then_sleep)
    with open(path) as f:
        return len(f.readlines())


@tool
def print_then_return(kb: int = 300) -> str:
    """Write ``kb`` KB to stdout as fast as possible, then return at once."""
    sys.stdout.write("z" * (kb * 1024))
    sys.stdout.flush()
    return "returned"


@tool
def close_channel_then_sleep() -> None:
    """Close every inherited descriptor above stderr (as daemonising code does), then hang."""
    os.closerange(3, 65536)
    time.sleep(3600)


@tool
def daemon_then_sleep(path: str) -> None:
    """Double-fork a daemon, write its pid to ``path`` (the sign that the call is running), and hang."""
    pid = daemon()
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.rename(path + ".tmp", path)
    time.sleep(3600)


@tool(idempotent=True)
def idempotent_append(path: str, text: str = "ran", then_sleep: float = 0.0) -> int:
    """``append_line`` flagged idempotent: a client may run it again after its executor died."""
    return append_line(path, text, then_sleep)


@tool
def kill_parent() -> None:
    """SIGKILL the process that forked this worker (the executor's template), as any code running
    under the same uid can, then hang."""
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)


def _frame_on_every_socket(body: bytes) -> None:
    """Write ``body`` as a length-prefixed frame (the worker channel's framing) on every socket this
    process holds: the worker's channel to the supervisor among them."""
    import stat
    import struct

    frame = struct.pack("!I", len(body)) + body
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.write(fd, frame)
        except OSError:
            pass


@tool
def scribble_on_channel(body: bytes = b"\xc1") -> None:
    """Write ``body`` as a length-prefixed frame on every inherited socket (the worker's channel to
    the supervisor among them), as a confused or hostile tool might, then hang."""
    _frame_on_every_socket(body)
    time.sleep(3600)


@tool
def undecodable(where: str = "error") -> str:
    """Put text that cannot be encoded as UTF-8 (a surrogate escape, as os.listdir gives for a file
    name that is not UTF-8) in the error message, a signal, stdout or the value."""
    text = b"name-\xff".decode("utf-8", "surrogateescape")
    if where == "error":
        raise FileNotFoundError(f"no such file: {text}")
    if where == "signal":
        signals.note(text)
    if where == "stdout":
        print(text)
    return text


@tool
def allocate_shared(mb: int = 1024) -> int:
    """Touch shared anonymous memory, which RLIMIT_DATA does not count (only a memory cgroup stops it)."""
    import mmap

    region = mmap.mmap(-1, mb * 1024 * 1024)
    for offset in range(0, len(region), 4096):
        region[offset] = 1
    return len(region)


@tool
def child_eats_memory(mb: int = 1024) -> int:
    """Start a child process that allocates memory (RLIMIT_DATA is per process; a cgroup is per tree)."""
    import subprocess

    code = f"x = [bytearray(16 << 20) for _ in range({mb // 16})]"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode


@tool
def fork_bomb(limit: int = 2000) -> int:
    """Fork sleeping children until fork fails or `limit` is reached; return how many were started."""
    started = 0
    for _ in range(limit):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        started += 1
    return started


@tool
def forge_reply(with_seq: bool = False) -> str:
    """Write a well-formed reply frame on the worker's channel (claiming to be this call's result),
    then return normally, so the real reply follows the forged one. With ``with_seq``, the forgery
    copies the request's sequence number (found in the worker's memory, as a determined tool could)."""
    import gc

    import msgpack

    forged: dict[str, object] = {"ok": True, "value": "forged", "signals": []}
    if with_seq:
        for obj in gc.get_objects():
            if isinstance(obj, dict) and obj.get("tool") == "forge_reply" and "seq" in obj:
                forged["seq"] = obj["seq"]
    body = msgpack.packb(forged)
    _frame_on_every_socket(body)
    return "real result of forge"
