"""Tools that write the workspace of a hardened ``--workspace-rw`` executor, politely and not
(tests/test_hardened_quota.py). Paths are relative to the workspace; each tool reports what it saw
as data, and the tests judge the host's workspace afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from executor import tool, workspace


def _path(name: str) -> str:
    return os.path.join(str(workspace()), name)


def _try(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except OSError as e:
        return f"denied: {os.strerror(e.errno) if e.errno else e}"
    return "done"


@tool
def write(name: str, text: str = "", megabytes: int = 0) -> int:
    """Write ``text`` (or ``megabytes`` MiB of x) to ``name``; return the bytes written."""
    data = text.encode() if text else b"x" * (megabytes << 20)
    os.makedirs(os.path.dirname(_path(name)) or ".", exist_ok=True)
    with open(_path(name), "wb") as f:
        f.write(data)
    return len(data)


@tool
def read(name: str) -> str:
    """The text of ``name``, or 'missing'."""
    try:
        with open(_path(name)) as f:
            return f.read()
    except FileNotFoundError:
        return "missing"


@tool
def listing(name: str = ".") -> list[str]:
    """The sorted names in directory ``name`` of the workspace."""
    return sorted(os.listdir(_path(name)))


@tool
def many_files(directory: str, count: int, size: int) -> str:
    """Write ``count`` files of ``size`` bytes in ``directory``, until the first error."""
    os.makedirs(_path(directory), exist_ok=True)
    data = b"y" * size
    for i in range(count):
        try:
            with open(_path(f"{directory}/f{i}"), "wb") as f:
                f.write(data)
        except OSError as e:
            return f"stopped at {i}: {os.strerror(e.errno or 0)}"
    return f"wrote {count}"


@tool
def fill(name: str, megabytes: int) -> str:
    """Append 1 MiB chunks to ``name`` until ``megabytes`` or the first error."""
    chunk = b"z" * (1 << 20)
    with open(_path(name), "wb") as f:
        for i in range(megabytes):
            try:
                f.write(chunk)
                f.flush()
            except OSError as e:
                return f"stopped at {i} MB: {os.strerror(e.errno or 0)}"
    return f"wrote {megabytes} MB"


@tool
def sparse(name: str, megabytes: int) -> str:
    """A sparse file of ``megabytes`` MiB (one byte of data at the end)."""
    def make() -> None:
        with open(_path(name), "wb") as f:
            f.seek((megabytes << 20) - 1)
            f.write(b"!")
    return _try(make)


@tool
def hard_links(name: str, megabytes: int, links: int) -> str:
    """One file of ``megabytes`` MiB and ``links`` hard links to it."""
    write(name, megabytes=megabytes)
    for i in range(links):
        try:
            os.link(_path(name), _path(f"{name}.link{i}"))
        except OSError as e:
            return f"stopped at link {i}: {os.strerror(e.errno or 0)}"
    return f"linked {links}"


def _write_through(name: str) -> None:
    with open(_path(name), "w") as f:
        f.write("through")


@tool
def symlinks(pairs: dict[str, str]) -> list[str]:
    """Make each symbolic link name -> target; then try to write through each."""
    out = []
    for name, target in pairs.items():
        os.symlink(target, _path(name))
        out.append(_try(lambda name=name: _write_through(name)))  # type: ignore[misc]
    return out


@tool
def special_files() -> list[str]:
    """A FIFO, a UNIX socket and a device node in the workspace."""
    import socket

    def sock() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.bind(_path("sock"))

    return [_try(lambda: os.mkfifo(_path("fifo"))), _try(sock),
            _try(lambda: os.mknod(_path("null"), 0o666 | 0o020000, os.makedev(1, 3)))]


@tool
def remove(name: str) -> str:
    """Delete the file or directory tree ``name``."""
    import shutil

    def rm() -> None:
        if os.path.isdir(_path(name)) and not os.path.islink(_path(name)):
            shutil.rmtree(_path(name))
        else:
            os.unlink(_path(name))
    return _try(rm)


@tool
def rename(old: str, new: str) -> str:
    """Rename ``old`` to ``new`` (a lower directory cannot be: EXDEV, which ``mv`` and shutil get round)."""
    import shutil

    return _try(lambda: shutil.move(_path(old), _path(new)))


@tool
def deep(depth: int) -> str:
    """Nest ``depth`` directories, each named d, from the workspace's root."""
    os.chdir(str(workspace()))
    for i in range(depth):
        try:
            os.mkdir("d")
            os.chdir("d")
        except OSError as e:
            return f"stopped at {i}: {os.strerror(e.errno or 0)}"
    return f"nested {depth}"


@tool
def wide(directory: str, count: int) -> str:
    """``count`` empty files in one directory, until the first error."""
    os.makedirs(_path(directory), exist_ok=True)
    for i in range(count):
        try:
            os.close(os.open(_path(f"{directory}/{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
        except OSError as e:
            return f"stopped at {i}: {os.strerror(e.errno or 0)}"
    return f"made {count}"


@tool
def racing_writers(threads: int, megabytes: int) -> str:
    """``threads`` threads, each appending to its own file up to ``megabytes`` MiB, all at once."""
    errors: list[str] = []

    def run(i: int) -> None:
        r = fill(f"race{i}", megabytes)
        if r.startswith("stopped"):
            errors.append(r)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return f"{len(errors)} of {threads} stopped"


@tool
def write_then_crash(name: str, megabytes: int, how: str) -> None:
    """Write ``name``, then die: ``how`` is 'exit' (os._exit), 'abort', or 'segv' (a real fault: as
    PID 1 of its namespace, signals it sends itself are ignored)."""
    write(name, megabytes=megabytes)
    _die(how)


def _die(how: str) -> None:
    if how == "exit":
        os._exit(3)
    if how == "segv":
        import ctypes

        ctypes.string_at(0)
    os.abort()


@tool
def killed_mid_write(name: str) -> None:
    """A child keeps writing ``name`` while the tool aborts."""
    subprocess.Popen([sys.executable, "-c", f"f = open({_path(name)!r}, 'wb')\nwhile True: f.write(b'w' * 65536)"])
    time.sleep(0.3)
    _die("abort")


@tool
def write_after_return(name: str) -> str:
    """Leave a detached child that writes ``name`` a moment after the call returned."""
    code = f"import time\ntime.sleep(0.5)\nopen({_path(name)!r}, 'w').write('late')"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    return "left a writer"


@tool
def thread_after_return(name: str) -> str:
    """Leave a thread appending to ``name`` (64 KiB at a time) while the worker answers."""
    def append() -> None:
        with open(_path(name), "ab") as f:
            while True:
                f.write(b"t" * 65536)
                f.flush()
                time.sleep(0.001)

    threading.Thread(target=append, daemon=True).start()
    deadline = time.monotonic() + 5
    while not (os.path.exists(_path(name)) and os.path.getsize(_path(name))) and time.monotonic() < deadline:
        time.sleep(0.005)  # answer while it is writing
    return "left a writing thread"


@tool
def garbage_on_channel(name: str) -> None:
    """Write ``name``, then send the executor something that is not a frame of ours on the worker's
    channel (the one socket it holds), and wait."""
    import stat

    write(name, text="before the garbage")
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.write(fd, b"\x00\x00\x00\x05hello")
        except OSError:
            continue
    time.sleep(10)


@tool
def hang_after_write(name: str) -> None:
    """Write ``name``, then sleep past the call's timeout."""
    write(name, text="before the timeout")
    time.sleep(3600)
