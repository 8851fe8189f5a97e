"""Workspace file access that a path, a symlink or a rename race cannot lead out of the workspace.
Every path a model gives is resolved by the kernel beneath a descriptor of the workspace root
(``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``: ``open_beneath``, ``make_parents``): a
step that would leave the root is refused, and magic links are never followed. Writers must refuse a
file with more than one hard link. Where openat2 is missing (``openat2_missing``) the fallback is
``confine``'s ``realpath`` check, which a directory swapped mid-call can beat: the hardened profile is
then the boundary. Why and how: docs/executor.md#workspace-paths.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from executor.context import workspace

SYS_OPENAT2 = 437  # one number on every architecture: openat2 came after the syscall tables were unified
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
AT_FDCWD = -100
EAGAIN_RETRIES = 64  # openat2 answers EAGAIN when a rename raced one of its ".." steps; retry this often


class _OpenHow(ctypes.Structure):
    """``struct open_how`` (linux/openat2.h)."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    """The raw ``openat2(dirfd, path, {flags | O_CLOEXEC, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS})``.
    Returns a descriptor or raises ``OSError`` with the kernel's errno (``ENOSYS`` where it has none)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = _syscall(SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


_UNPROBED = "unprobed"
_missing: str | None = _UNPROBED
NO_OPENAT2 = "the kernel has no openat2 (it came in Linux 5.6), or a seccomp filter hides it"


def openat2_missing() -> str | None:
    """Why this process cannot use openat2 (None: it can). Probed once, with a harmless open of ".";
    the built-in toolkit calls it at import, in the template, and logs a reason."""
    global _missing
    if _missing == _UNPROBED:
        try:
            os.close(openat2(AT_FDCWD, ".", os.O_PATH))
            _missing = None
        except OSError as e:
            _missing = NO_OPENAT2 if e.errno == errno.ENOSYS else f"openat2 fails here ({e.strerror})"
    return _missing


def _lost_openat2(e: OSError) -> bool:
    """Whether a call's openat2 answered ENOSYS after all (a seccomp filter applied after the probe);
    from then on this process uses the fallback."""
    global _missing
    if e.errno != errno.ENOSYS:
        return False
    _missing = NO_OPENAT2
    return True


def confine(path: str) -> Path:
    """The resolved absolute form of ``path``, or ``PermissionError`` if it lies outside the workspace.

    A check of the path as it is now, for tools that take a path and hand it on: a parent directory
    swapped for a symlink after the check can still lead the later open out of the workspace. To
    open a file race-free, use ``open_beneath``."""
    root = workspace()
    _check_text(path)
    target = Path(os.path.realpath(root / path))  # an absolute ``path`` replaces ``root`` here
    # realpath leaves a looping symlink unresolved (some Python versions also keep the ".." after it)
    if ".." in target.parts or target.is_symlink():
        raise OSError(f"path {path!r} goes through a symlink loop; it cannot be used")
    if not target.is_relative_to(root):
        raise _outside(path, root)
    return target


def relative(path: str) -> str:
    """``path`` relative to the workspace, as resolved beneath it: relative paths stay as given, an
    absolute one must start with the workspace root. Also how a path is named back to the model."""
    return _relative(path, workspace())


def open_beneath(path: str, flags: int, mode: int = 0o666) -> int:
    """Open ``path`` inside the workspace, following symlinks only while they stay inside; returns a
    descriptor (``O_CLOEXEC``). Errors are ``OSError`` subclasses with messages for the model."""
    root = workspace()
    rel = _relative(path, root)
    with _root_fd(root) as rfd:
        try:
            if openat2_missing() is None:
                try:
                    return _resolve(rfd, root, rel, flags, mode)
                except OSError as e:
                    if not _lost_openat2(e):
                        raise
            return _open_checked(path, flags, mode)
        except OSError as e:
            raise _explain(e, path, root) from None


def make_parents(path: str) -> None:
    """Create the missing parent directories of ``path``, each inside the workspace."""
    root = workspace()
    parent = PurePosixPath(_relative(path, root)).parent
    if parent == PurePosixPath("."):
        return
    try:
        if openat2_missing() is None:
            try:
                with _root_fd(root) as rfd:
                    _make_dirs(rfd, root, parent, path)
                return
            except OSError as e:
                if not _lost_openat2(e):
                    raise
        confine(path).parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        if e.errno is None:
            raise  # already written for the model
        raise NotADirectoryError(f"cannot create the parent directory of {path!r}: a file is in the way") from None
    except OSError as e:
        raise _explain(e, path, root) from None


def _make_dirs(rfd: int, root: Path, parent: PurePosixPath, path: str) -> None:
    """Resolve ``parent`` beneath the root, creating each missing component with ``mkdirat`` in the
    descriptor of the one before it (itself resolved beneath the root)."""
    try:
        os.close(_resolve(rfd, root, str(parent), os.O_PATH | os.O_DIRECTORY))
        return  # the common case: it exists
    except FileNotFoundError:
        pass
    here = os.dup(rfd)
    try:
        done = PurePosixPath()
        for part in parent.parts:
            done /= part
            try:
                fd = _resolve(rfd, root, str(done), os.O_PATH | os.O_DIRECTORY)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o777, dir_fd=here)
                except FileExistsError:
                    pass  # made meanwhile, or a dangling symlink: the open below tells them apart
                try:
                    fd = _resolve(rfd, root, str(done), os.O_PATH | os.O_DIRECTORY)
                except FileNotFoundError:
                    raise NotADirectoryError(
                        f"cannot create the parent directory of {path!r}: {str(done)!r} is a symlink to nothing"
                    ) from None
            os.close(here)
            here = fd
    finally:
        os.close(here)


def _resolve(rfd: int, root: Path, rel: str, flags: int, mode: int = 0) -> int:
    """openat2 beneath the root, retried on EAGAIN; an EXDEV is retried once with the realpath when
    that lies inside (absolute symlinks pointing inside), still beneath the root."""
    try:
        return _openat2_retrying(rfd, rel, flags, mode)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        try:
            real = Path(os.path.realpath(root / rel))
        except OSError:  # a symlink that is a directory by the time realpath reads it: a race, so no retry
            raise e from None
        if real == root / rel or not real.is_relative_to(root):
            raise
        return _openat2_retrying(rfd, str(real.relative_to(root)), flags, mode)


def _openat2_retrying(rfd: int, rel: str, flags: int, mode: int) -> int:
    for _ in range(EAGAIN_RETRIES):
        try:
            return openat2(rfd, rel, flags, mode)
        except BlockingIOError:
            continue
    raise OSError(errno.EAGAIN, "the workspace kept changing while the path was resolved; try again")


def _open_checked(path: str, flags: int, mode: int) -> int:
    """The fallback without openat2: check with ``confine``, then open refusing a final symlink."""
    target = confine(path)
    try:
        return os.open(target, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and target.is_symlink():
            raise PermissionError(f"{path!r} became a symlink while it was opened; refusing to follow it") from None
        raise


@contextmanager
def _root_fd(root: Path) -> Iterator[int]:
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _relative(path: str, root: Path) -> str:
    _check_text(path)
    p = PurePosixPath(path)
    if not p.is_absolute():
        return str(p)
    if p.parts[: len(root.parts)] != root.parts:
        raise _outside(path, root)
    return str(PurePosixPath(*p.parts[len(root.parts) :]))


def _check_text(path: str) -> None:
    if "\0" in path:
        raise ValueError(f"path {path!r} contains a NUL character; give a plain file path")


def _outside(path: str, root: Path) -> PermissionError:
    return PermissionError(
        f"path {path!r} is outside the workspace {root}; use a path inside it "
        "(relative paths are relative to the workspace)"
    )


# What the kernel's errno means for a path the model gave: the error type and its message.
_EXPLAINED: dict[int, tuple[type[OSError], str]] = {
    errno.ENOENT: (FileNotFoundError, "{path!r} does not exist in the workspace; use list_dir to see what does"),
    errno.ENOTDIR: (FileNotFoundError, "{path!r} does not exist: a part of it is a file, not a directory"),
    errno.ELOOP: (OSError, "path {path!r} goes through a symlink loop (or a /proc magic link); it cannot be used"),
    errno.EISDIR: (IsADirectoryError, "{path!r} is a directory; give a file path to write to"),
    errno.ENXIO: (OSError, "{path!r} is not a regular file (a pipe, socket or device); it cannot be used"),
    errno.EAGAIN: (OSError, "the workspace kept changing while {path!r} was resolved; try again"),
    errno.EACCES: (PermissionError, "{path!r}: permission denied"),
    errno.EPERM: (PermissionError, "{path!r}: permission denied"),
    errno.EROFS: (PermissionError, "{path!r}: the workspace is read-only for tools here; it cannot be written"),
}


def _explain(e: OSError, path: str, root: Path) -> OSError:
    """The kernel's answer as an error written for the model (errors already written pass through)."""
    if e.filename is None and e.errno is None:
        return e
    if e.errno == errno.EXDEV:
        return _outside(path, root)
    kind, message = _EXPLAINED.get(e.errno or 0, (OSError, "{path!r}: {strerror}"))
    return kind(message.format(path=path, strerror=e.strerror or e))
