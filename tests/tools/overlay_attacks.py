"""Tools that attack a hardened ``--workspace-rw`` executor's overlay and its keeper's apply step
(tests/test_overlay_redteam.py). Loaded next to tests/tools/workspace_filler.py, whose polite tools
(write, read, listing, remove) they share the executor with. Paths are relative to the workspace;
each tool reports what it saw as data, and the tests judge the host afterwards."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import stat
import struct
import sys
import time

from executor import tool, workspace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forged_notice import forge_applying as _forge_applying  # beside this file: see its docstring


def _path(name: str) -> str:
    return os.path.join(str(workspace()), name)


def _outcome(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except OSError as e:
        return f"denied: {errno.errorcode.get(e.errno or 0, e.errno)}"
    return "done"


@tool
def long_names(directory: str, count: int, length: int = 255) -> str:
    """``count`` empty files in ``directory``, each name ``length`` bytes long (what grows the host's
    directory most per name), until the first error."""
    os.makedirs(_path(directory), exist_ok=True)
    for i in range(count):
        name = f"{i:06d}".ljust(length, "n")
        try:
            os.close(os.open(_path(f"{directory}/{name}"), os.O_CREAT | os.O_WRONLY, 0o644))
        except OSError as e:
            return f"stopped at {i}: {errno.errorcode.get(e.errno or 0)}"
    return f"made {count}"


@tool
def clear(directory: str) -> int:
    """Delete every entry of ``directory`` (the directory itself stays); return how many."""
    names = os.listdir(_path(directory))
    for name in names:
        os.unlink(_path(f"{directory}/{name}"))
    return len(names)


@tool
def put(name: str, kilobytes: int) -> int:
    """Write ``kilobytes`` KiB of data to ``name`` (its directory must exist); return the bytes."""
    data = b"p" * (kilobytes << 10)
    with open(_path(name), "wb") as f:
        f.write(data)
    return len(data)


@tool
def truncate_to(name: str, megabytes: int) -> str:
    """Set ``name``'s size to ``megabytes`` MiB with truncate(2): a hole, not data."""
    return _outcome(lambda: os.truncate(_path(name), megabytes << 20))


@tool
def deep_long(depth: int, length: int) -> str:
    """Nest ``depth`` directories whose names are ``length`` bytes long, from the workspace's root
    (relative steps: the tool itself never needs the whole path)."""
    os.chdir(str(workspace()))
    for i in range(depth):
        try:
            os.mkdir("x" * length)
            os.chdir("x" * length)
        except OSError as e:
            return f"stopped at {i}: {errno.errorcode.get(e.errno or 0)}"
    return f"nested {depth}"


@tool
def deep_write(depth: int, length: int, text: str) -> str:
    """Write a file named f at the bottom of ``deep_long``'s directories (entered one step at a time),
    so that the apply goes through every one of them."""
    os.chdir(str(workspace()))
    for _ in range(depth):
        os.chdir("x" * length)
    with open("f", "w") as f:
        f.write(text)
    return "written"


@tool
def remove_tree(name: str) -> str:
    """Delete the directory tree ``name`` (descriptor-based: any depth)."""
    return _outcome(lambda: shutil.rmtree(_path(name)))


ODD_NAMES = (b"new\nline", b"bad\xff\xfeutf8", b"tab\tand space ", b"-dash", b".ciayn-apply-0000000000000000",
             b"\x01\x1b[31mescape")


@tool
def odd_names() -> list[str]:
    """A file for each name of ``ODD_NAMES`` (bytes: newlines, invalid UTF-8, control characters, the
    applier's own temporary prefix), its content its index."""
    root = os.fsencode(str(workspace()))
    out = []
    for i, name in enumerate(ODD_NAMES):
        def make(name: bytes = name, i: int = i) -> None:
            fd = os.open(root + b"/" + name, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
            os.write(fd, str(i).encode())
            os.close(fd)
        out.append(_outcome(make))
    return out


_libc = ctypes.CDLL(None, use_errno=True)
NR_OPENAT2, NR_MKNODAT = 437, 259
AT_FDCWD = -100


def _syscall_ok(nr: int, *args: object) -> str:
    if _libc.syscall(nr, *args) < 0:
        return f"denied: {errno.errorcode.get(ctypes.get_errno())}"
    return "done"


@tool
def setid_files() -> dict[str, str]:
    """Try to leave set-user-ID and set-group-ID files and directories in the workspace by every
    path that takes a mode: chmod (seccomp's), mknod of a regular file and openat2 (their modes are
    not seccomp's arguments), mkdir. Returns each attempt's outcome and the mode it left, as seen in
    the sandbox."""
    out: dict[str, str] = {}
    open(_path("chmodded"), "w").close()
    out["chmod"] = _outcome(lambda: os.chmod(_path("chmodded"), 0o6755))
    out["mknod"] = _syscall_ok(NR_MKNODAT, AT_FDCWD, os.fsencode(_path("mknodded")), stat.S_IFREG | 0o6755, 0)
    how = struct.pack("=QQQ", os.O_CREAT | os.O_WRONLY, 0o6755, 0)  # struct open_how: flags, mode, resolve
    fd = _libc.syscall(NR_OPENAT2, AT_FDCWD, os.fsencode(_path("openat2ed")), how, len(how))
    out["openat2"] = "done" if fd >= 0 else f"denied: {errno.errorcode.get(ctypes.get_errno())}"
    if fd >= 0:
        os.close(fd)
    os.umask(0)
    out["mkdir"] = _outcome(lambda: os.mkdir(_path("setgid-dir"), 0o7777))
    for name in ("chmodded", "mknodded", "openat2ed", "setgid-dir"):
        with_mode = os.lstat(_path(name)).st_mode if os.path.lexists(_path(name)) else 0
        out[f"{name} mode"] = oct(stat.S_IMODE(with_mode))
    return out


@tool
def crafted_marks(directory: str) -> dict[str, str]:
    """Forge the overlay's own deletion marks by hand in the workspace: a whiteout (character device
    0:0, by mknod and by renameat2's RENAME_WHITEOUT) and the opaque-directory xattr (trusted and
    user namespaces) on ``directory``."""
    os.makedirs(_path(directory), exist_ok=True)
    out = {"whiteout": _syscall_ok(NR_MKNODAT, AT_FDCWD, os.fsencode(_path("forged")), stat.S_IFCHR | 0o600, 0)}
    open(_path("victim"), "w").close()
    rename_whiteout = 4
    out["rename_whiteout"] = "done" if _libc.renameat2(AT_FDCWD, os.fsencode(_path("victim")), AT_FDCWD,
                                                       os.fsencode(_path("moved")), rename_whiteout) == 0 else (
        f"denied: {errno.errorcode.get(ctypes.get_errno())}")
    for attr in ("trusted.overlay.opaque", "user.overlay.opaque", "trusted.overlay.redirect"):
        out[attr] = _outcome(lambda attr=attr: os.setxattr(_path(directory), attr, b"y"))
    return out


@tool
def special_extras(name: str, megabytes: int) -> dict[str, str]:
    """Space that is not the file's size: ``megabytes`` MiB preallocated past its end
    (fallocate KEEP_SIZE), and user xattrs (64 KiB each) on it."""
    out: dict[str, str] = {}
    fd = os.open(_path(name), os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"small")
        keep_size = 1
        res = _libc.fallocate(fd, keep_size, ctypes.c_long(0), ctypes.c_long(megabytes << 20))
        out["fallocate"] = "done" if res == 0 else f"denied: {errno.errorcode.get(ctypes.get_errno())}"
        out["blocks_kb"] = str(os.fstat(fd).st_blocks // 2)
    finally:
        os.close(fd)
    made = 0
    for i in range(64):
        try:
            os.setxattr(_path(name), f"user.pad{i}", b"a" * 65000)
            made += 1
        except OSError as e:
            out["xattr_stop"] = errno.errorcode.get(e.errno or 0, str(e.errno))
            break
    out["xattrs"] = str(made)
    return out


@tool
def write_and_hold(name: str, text: str, seconds: float) -> str:
    """Write ``name`` (making its directories), then stay in the call for ``seconds`` (the tests
    bound it) before answering: a call whose writes are uncommitted meanwhile."""
    os.makedirs(os.path.dirname(_path(name)) or ".", exist_ok=True)
    with open(_path(name), "w") as f:
        f.write(text)
    time.sleep(seconds)
    return "held"


@tool
def replace_with_symlink(name: str, target: str) -> str:
    """Replace the directory ``name`` by a symbolic link to ``target``."""
    shutil.rmtree(_path(name))
    os.symlink(target, _path(name))
    return "replaced"


@tool
def rename_onto(old: str, new: str) -> str:
    """rename(2) ``old`` onto ``new`` (replacing it if the kernel lets it)."""
    return _outcome(lambda: os.rename(_path(old), _path(new)))


@tool
def forge_applying(name: str, seconds: float) -> str:
    """Write ``name``, then send the keepers' own notice (``applying``: 60 s more for the call) on the
    worker's channel for every sequence number a call may have, and stay ``seconds``."""
    with open(_path(name), "w") as f:
        f.write("before the forged notice")
    _forge_applying()
    time.sleep(seconds)
    return "forged"


@tool
def lock_workspace(seconds: float) -> str:
    """Hold an exclusive flock on the workspace's directory (the lock the keepers' appliers take
    turns with) for ``seconds``."""
    fd = os.open(str(workspace()), os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    time.sleep(seconds)
    return "held the lock"


@tool
def answer_just_before(directory: str, count: int, deadline: float, margin: float) -> str:
    """Make ``count`` files in ``directory`` (an apply that takes a while), then answer ``margin``
    seconds before ``deadline`` seconds from the call's start: the keeper applies while the call's
    time runs out."""
    start = time.monotonic()
    long_names(directory, count, 200)
    time.sleep(max(0.0, start + deadline - margin - time.monotonic()))
    return "answered"
