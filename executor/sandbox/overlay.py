"""``--workspace-rw``: apply one call's writes (the upper layer of its overlay) to the real workspace
as a transaction, bounded by ``--workspace-quota``.

``commit`` is run by the call's keeper (``executor.sandbox.keeper``), as root, once no process of
the call can run any more: it checks the whole change set first (``_Plan``: only files,
directories and symbolic links, at most ``MAX_DEPTH`` deep, the workspace within its quota
afterwards, sizes as ``usage`` counts them), and applies all of it or nothing, staged so that a
keeper killed midway leaves nothing the next apply or ``recover`` does not remove (``_Stage``,
``_Journal``). It returns None, or why the changes were discarded, for the call's result. Files are
copied from directory descriptors, never through a symbolic link; appliers take turns (``flock``).
docs/security.md ("Inside the hardened profile") gives the design and its reasons.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import shutil
import stat
import time
from collections.abc import Callable
from typing import NamedTuple

MB = 1024 * 1024
BLOCK = 4096  # every name counts at least this much (and sizes are rounded up to it): bounds files too
DEFAULT_QUOTA_MB = 1024
MAX_DEPTH = 100  # directories nested deeper than this in one call's changes are refused (2 fds a level)
WALK_DEPTH = MAX_DEPTH + 1  # levels a walk of the host's workspace enters (tree_usage): all a call can make
TEMP = ".ciayn-apply-"  # an apply's temporary names start with this and its token
JOURNAL_XATTR = "trusted.ciayn.apply"  # on the workspace's directory: the token of an apply under way
TEMP_NAME = f"{TEMP}{'0' * 16}"  # an apply's trash directory, at the workspace's root (``_Stage``)
APPLY_MARGIN = 10.0  # seconds of the supervisor's APPLY_GRACE kept for the renames and the reply
LOCK_WAIT = 60.0  # seconds an applier waits for another call's apply to finish
UPPER = "/.ciayn-upper"  # in the staged root: where the keeper mounts the call's tmpfs
TALLY = "/.ciayn-tally"  # in the staged root: the executor's tmpfs holding the workspace's size (``commit``)
WHITEOUT_RDEV = 0  # overlayfs marks a deletion with a character device 0:0
OPAQUE_XATTR = "trusted.overlay.opaque"  # a directory that hides the lower one of its name
OVERLAY_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"  # no metadata-only copy-ups, no redirects
STOP_WAIT = 5.0  # seconds the keeper waits for an answered call to stop before killing it


class Refused(Exception):
    """The call's changes cannot be applied; the message is for the call's result."""


def _rounded(size: int) -> int:
    return max(BLOCK, -(-size // BLOCK) * BLOCK)


def usage(st: os.stat_result) -> int:
    """What one name costs against the quota: its apparent size rounded up to ``BLOCK`` (so a
    sparse file counts in full, and each name at least one block, which bounds the number of files
    too). Hard links count once per name: that is how they are applied."""
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return _rounded(st.st_size)
    return BLOCK


def _dirent(name: str) -> int:
    """At most what adding ``name`` grows a host directory by: twice an ext4 entry (8 bytes and the
    name, 4-aligned: the largest of the common filesystems), for blocks that splits left half full.
    The upper layer's own size of a directory (tmpfs: 20 bytes a name) says nothing about it."""
    return 2 * ((8 + len(os.fsencode(name)) + 3) & ~3)


def tree_usage(dir_fd: int, budget: int | None = None) -> int:
    """``usage`` of everything under an open directory, walked from directory descriptors (each
    level opened from its parent's with ``O_NOFOLLOW | O_DIRECTORY``, read with ``scandir`` on the
    descriptor, sized with ``fstatat``): no path grows with the depth, and only what ``lstat`` shows
    is a directory is entered. No tool process can change the real workspace meanwhile (appliers
    hold its lock); what the host removes meanwhile is skipped.

    Bounded: it enters at most ``WALK_DEPTH`` levels (two descriptors a level; a directory deeper
    counts as itself: nothing a call applies is that deep, see ``MAX_DEPTH``), and with ``budget``
    it stops as soon as the total passes ``budget`` bytes and returns what it counted so far (each
    name costs at least ``BLOCK``, so it reads at most ``budget // BLOCK + 1`` names): a lower
    bound then. Memory: one directory stream a level, however wide."""
    total = 0
    fds: list[int] = []
    streams: list[os._ScandirIterator[str]] = [os.scandir(dir_fd)]
    try:
        while streams:
            entry = next(streams[-1], None)
            if entry is None:
                streams.pop().close()
                if fds:
                    os.close(fds.pop())
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += usage(st)
            if budget is not None and total > budget:
                break
            if stat.S_ISDIR(st.st_mode) and len(streams) <= WALK_DEPTH:
                try:
                    fd = _open_dir(entry.name, fds[-1] if fds else dir_fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                fds.append(fd)
                streams.append(os.scandir(fd))
    finally:
        for stream in streams:
            stream.close()
        for fd in fds:
            os.close(fd)
    return total


def _open_dir(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _open_path(top: int, where: tuple[str, ...]) -> int:
    """A directory below ``top`` opened one name at a time (never a path string, never a link)."""
    fd = os.dup(top)
    try:
        for name in where:
            sub = _open_dir(name, fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(name: str, dir_fd: int | None) -> os.stat_result | None:
    if dir_fd is None:
        return None
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == WHITEOUT_RDEV


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "file of an unknown type"


class _Plan:
    """The dry run: checks the change set (kinds, depth) and costs it, without changing anything.

    ``delta`` is what the workspace's ``tree_usage`` can grow by at most: files and links at their
    ``usage``; a directory the call makes at what it will take on the host (``_dirent`` for each of
    its names); a directory of the host's that gets new names at its growth by ``_dirent`` each,
    rounded up to blocks with one block more for the index, and never as shrinking (a host's
    directory keeps its size when names leave it). What the call deletes is credited at its
    ``usage``, a deleted tree walked with a budget of ``quota`` bytes for the whole change set (a
    tree past it is credited in part: a lower bound)."""

    def __init__(self, quota: int) -> None:
        self.delta = 0
        self.entries = 0
        self.depth = 0  # how deep its directories go
        self.walk_left = quota

    def directory(self, upper: int, real: int | None, size: int, depth: int, where: tuple[str, ...]) -> None:
        """``real``: the host's directory merged with ``upper`` (None: a new one); ``size``: its size."""
        if depth > MAX_DEPTH:
            raise Refused(f"directories nested more than {MAX_DEPTH} deep ({'/'.join(where)[:200]}...)")
        self.depth = max(self.depth, depth)
        grows = 0
        for name in sorted(os.listdir(upper)):
            self.entries += 1
            st = os.stat(name, dir_fd=upper, follow_symlinks=False)
            old = _lstat(name, real)
            if _is_whiteout(st):  # deleted by the call
                self.delta -= self._old_usage(real, name, old)
                continue
            if old is None:
                grows += _dirent(name)
            if stat.S_ISDIR(st.st_mode):
                merged = old is not None and stat.S_ISDIR(old.st_mode) and not _opaque(upper, name)
                if not merged:
                    self.delta -= self._old_usage(real, name, old)
                sub_real = _open_dir(name, real) if merged and real is not None else None
                sub_upper = _open_dir(name, upper)
                try:
                    self.directory(sub_upper, sub_real, old.st_size if merged and old is not None else 0,
                                   depth + 1, (*where, name))
                finally:
                    os.close(sub_upper)
                    if sub_real is not None:
                        os.close(sub_real)
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                self.delta += usage(st) - self._old_usage(real, name, old)
            else:
                raise Refused(f"the call made {'/'.join((*where, name))!r}, a {_kind(st.st_mode)}: only files, "
                              "directories and symbolic links can be written to the workspace")
        if depth == 0:  # the apply's trash directory, for a while (``_Stage``)
            grows += _dirent(TEMP_NAME)
        if real is None:  # made by the call: an empty directory is one block
            self.delta += _rounded(BLOCK + grows)
        elif grows:
            self.delta += _rounded(size + grows + BLOCK) - _rounded(size)

    def _old_usage(self, real: int | None, name: str, old: os.stat_result | None) -> int:
        if real is None or old is None:
            return 0
        if not stat.S_ISDIR(old.st_mode) or self.walk_left <= 0:
            return usage(old)
        fd = _open_dir(name, real)
        try:
            inside = tree_usage(fd, self.walk_left)
        finally:
            os.close(fd)
        self.walk_left -= inside
        return usage(old) + inside


class _Op(NamedTuple):
    """One step of putting a copied change set in place, in the directory ``where`` (below the
    workspace's root, or with ``hidden`` below the trash directory, where new trees are built)."""

    where: tuple[str, ...]
    name: str
    kind: str  # "file" (``fd`` or ``staged``), "link" (to ``target``), "mkdir", "dir" (``staged``), "chmod", "delete"
    mode: int = 0
    fd: int = -1  # the file's copy, unnamed (O_TMPFILE)
    staged: str = ""  # its name in the trash directory (a new tree; a file without O_TMPFILE or descriptors)
    target: str = ""
    hidden: bool = False


class _Stage:
    """Applies a planned change set in steps, so that a keeper killed at any point leaves as little
    as possible:

    1. ``copy``: every file's bytes are copied to an unnamed file (``O_TMPFILE``) on the host's
       filesystem, held open: a keeper killed here leaves nothing at all (the kernel frees them).
       Where that is not possible (no ``O_TMPFILE``, or more files than ``fd_budget``), to a name in
       the trash directory, ``TEMP`` + this apply's token at the workspace's root.
    2. ``put_in_place``: first every directory the call made is built whole in the trash directory
       (nothing the workspace shows changes); then, in the walk's order, each new tree is renamed
       into place, each file linked in (an existing name replaced by a rename), each link made, each
       deletion done by a rename into the trash. Metadata only: a rename or two per entry the
       workspace's own directories gain, lose or replace. A keeper killed here leaves the steps done
       so far (each entry whole) and the trash directory.
    3. ``empty_trash``: the trash directory (what was replaced or deleted) is removed.

    The token is written to the journal (``_Journal``) before the trash directory is made, so what
    a killed apply left is removed by the next apply, or when the executor exits (``recover``)."""

    def __init__(self, ws: int, owner: tuple[int, int], token: str, journal: _Journal, fd_budget: int) -> None:
        self.ws, self.owner, self.token, self.journal = ws, owner, token, journal
        self.fd_budget = fd_budget
        self.hidden: list[_Op] = []  # step 2's first part: in the trash directory
        self.ops: list[_Op] = []  # its second: in the workspace
        self.files = 0
        self.count = 0
        self.placed = 0
        self.trash_fd = -1

    def close(self) -> None:
        for op in (*self.hidden, *self.ops):
            if op.fd >= 0:
                os.close(op.fd)
        self.hidden.clear()
        self.ops.clear()
        if self.trash_fd >= 0:
            os.close(self.trash_fd)
            self.trash_fd = -1

    def trash(self) -> int:
        """The trash directory, made (after the journal that names it) when first needed."""
        if self.trash_fd < 0:
            self.journal.write(self.token)
            os.mkdir(TEMP + self.token, 0o700, dir_fd=self.ws)
            self.trash_fd = _open_dir(TEMP + self.token, self.ws)
        return self.trash_fd

    def _temp(self) -> str:
        self.count += 1
        return str(self.count)

    def _add(self, op: _Op) -> None:
        (self.hidden if op.hidden else self.ops).append(op)

    def copy(self, upper: int, real: int | None, where: tuple[str, ...], hidden: bool = False) -> None:
        """Step 1 for the directory ``where`` (``real``: the host's, merged; None: made by the call,
        then ``hidden``: built in the trash directory)."""
        for name in sorted(os.listdir(upper)):
            st = os.stat(name, dir_fd=upper, follow_symlinks=False)
            old = _lstat(name, real)
            if _is_whiteout(st):
                if old is not None:
                    self._add(_Op(where, name, "delete"))
                continue
            mode = stat.S_IMODE(st.st_mode) & 0o777
            if stat.S_ISLNK(st.st_mode):
                self._add(_Op(where, name, "link", target=os.readlink(name, dir_fd=upper), hidden=hidden))
                continue
            if stat.S_ISREG(st.st_mode):
                self._add(self._copy_file(upper, real, name, st, where, hidden))
                continue
            # a directory (the plan refused every other kind)
            merged = old is not None and real is not None and stat.S_ISDIR(old.st_mode) and not _opaque(upper, name)
            if merged:
                assert old is not None
                if stat.S_IMODE(old.st_mode) != stat.S_IMODE(st.st_mode):  # a host's set-group-ID bit stays
                    self._add(_Op(where, name, "chmod", mode))
                inside = (*where, name)
            elif hidden:
                self._add(_Op(where, name, "mkdir", mode, hidden=True))
                inside = (*where, name)
            else:  # a new tree: built in the trash, then renamed into place
                staged = self._temp()
                self._add(_Op((), staged, "mkdir", mode, hidden=True))
                self._add(_Op(where, name, "dir", staged=staged))
                inside = (staged,)
            sub_upper = _open_dir(name, upper)
            sub_real = _open_dir(name, real) if merged and real is not None else None
            try:
                self.copy(sub_upper, sub_real, inside, hidden or not merged)
            finally:
                os.close(sub_upper)
                if sub_real is not None:
                    os.close(sub_real)

    def _copy_file(self, upper: int, real: int | None, name: str, st: os.stat_result,
                   where: tuple[str, ...], hidden: bool) -> _Op:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=upper)
        try:
            dst, staged = -1, ""
            if self.files < self.fd_budget:
                try:  # on the filesystem of the nearest host directory: linkable into its place
                    dst = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600,
                                  dir_fd=self.ws if real is None else real)
                    self.files += 1
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.EMFILE):
                        raise
            if dst < 0:
                staged = self._temp()
                flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                dst = os.open(staged, flags, 0o600, dir_fd=self.trash())
            try:
                offset = 0
                while sent := os.sendfile(dst, src, offset, 1 << 30):
                    offset += sent
                os.fchown(dst, *self.owner)
                os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            except BaseException:
                os.close(dst)
                raise
            if staged:
                os.close(dst)
                dst = -1
            return _Op(where, name, "file", fd=dst, staged=staged, hidden=hidden)
        finally:
            os.close(src)

    def put_in_place(self) -> None:
        """Step 2; ``placed`` counts the entries of the workspace put in place."""
        self._run(self.hidden, self.trash())
        self._run(self.ops, self.ws, count=True)

    def _run(self, ops: list[_Op], top: int, count: bool = False) -> None:
        path: list[int] = []  # descriptors of the directories from ``top`` down to the current one
        names: tuple[str, ...] = ()
        try:
            for op in ops:
                keep = 0
                while keep < min(len(names), len(op.where)) and names[keep] == op.where[keep]:
                    keep += 1
                while len(path) > keep:
                    os.close(path.pop())
                for name in op.where[keep:]:
                    path.append(_open_dir(name, path[-1] if path else top))
                names = op.where
                self._put(path[-1] if path else top, op)
                self.placed += count
        finally:
            for fd in path:
                os.close(fd)

    def _put(self, fd: int, op: _Op) -> None:
        if op.kind == "chmod":
            sub = _open_dir(op.name, fd)
            try:
                os.fchmod(sub, op.mode)
            finally:
                os.close(sub)
            return
        now = None if op.hidden else _lstat(op.name, fd)  # as it is now: the host may have changed it
        if now is not None and (op.kind in ("delete", "dir") or stat.S_ISDIR(now.st_mode)):
            self._set_aside(fd, op.name, now)  # a rename cannot replace a directory, nor put one over a file
            now = None
        if op.kind == "mkdir":
            os.mkdir(op.name, 0o700, dir_fd=fd)
            sub = _open_dir(op.name, fd)
            try:
                os.fchown(sub, *self.owner)  # a directory of the host's keeps its owner
                os.fchmod(sub, op.mode)
            finally:
                os.close(sub)
            return
        if op.kind == "delete":
            return
        if op.kind == "link" and op.hidden:
            os.symlink(op.target, op.name, dir_fd=fd)
            os.chown(op.name, *self.owner, dir_fd=fd, follow_symlinks=False)
            return
        if op.kind == "file" and not op.staged and (now is None or op.hidden):  # a new name: linked straight in
            os.link(f"/proc/self/fd/{op.fd}", op.name, dst_dir_fd=fd, follow_symlinks=True)
            return
        staged = op.staged
        if op.kind == "link":
            staged = self._temp()
            os.symlink(op.target, staged, dir_fd=self.trash())
            os.chown(staged, *self.owner, dir_fd=self.trash(), follow_symlinks=False)
        elif op.kind == "file" and not staged:  # replacing a name: linked in the trash, renamed over it (atomic)
            staged = self._temp()
            os.link(f"/proc/self/fd/{op.fd}", staged, dst_dir_fd=self.trash(), follow_symlinks=True)
        os.rename(staged, op.name, src_dir_fd=self.trash(), dst_dir_fd=fd)

    def _set_aside(self, fd: int, name: str, now: os.stat_result) -> None:
        try:
            os.rename(name, self._temp(), src_dir_fd=fd, dst_dir_fd=self.trash())
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            _remove(fd, name, now)  # on another filesystem (a mount inside the workspace): removed in place

    def empty_trash(self) -> bool:
        """Step 3; False if the trash could not all be removed (the journal then stays, so the next
        apply tries again)."""
        if self.trash_fd < 0:
            return True
        try:
            _remove(self.ws, TEMP + self.token, os.fstat(self.trash_fd))
        except (OSError, RecursionError):  # the host changed it, or a host's tree deeper than rmtree goes
            return False
        return True


def clean(ws: int, token: str) -> None:
    """Remove the trash directory of the apply ``token``: what a keeper killed mid-apply left."""
    old = _lstat(TEMP + token, ws)
    if old is not None and stat.S_ISDIR(old.st_mode):
        with contextlib.suppress(OSError, RecursionError):  # never blocks an apply
            _remove(ws, TEMP + token, old)


def _opaque(upper: int, name: str) -> bool:
    fd = _open_dir(name, upper)
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise
    finally:
        os.close(fd)


def _remove(real: int, name: str, old: os.stat_result) -> None:
    if stat.S_ISDIR(old.st_mode):
        shutil.rmtree(name, dir_fd=real)  # descriptor-based: never follows a symbolic link, any path length
    else:
        os.unlink(name, dir_fd=real)


def _lock(fd: int, wait: float = LOCK_WAIT) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise Refused(f"another call's changes were still being applied after {wait:g} s") from None
            time.sleep(0.005)


def commit(upper: str, workspace: str, quota: int, tally: str | None = None,
           announce: Callable[[], None] | None = None, within: float | None = None) -> str | None:
    """Apply the upper layer ``upper`` to ``workspace`` if the change set is acceptable and the
    workspace stays within ``quota`` bytes (or does not grow). Returns None when applied (or there
    was nothing to apply), else why nothing (or, if the host's workspace failed under it, not all)
    was applied, for the call's result. Runs in the keeper, as root, after every process of the
    call is gone. ``announce`` is called first when there is something to apply; ``within`` (seconds
    from then) bounds the wait for the lock, the plan and the copy: past it nothing is applied.

    ``tally`` is a file (private to the executor) that remembers the workspace's size between
    calls, so that a call does not walk the whole workspace: measured by the first call that adds
    to it, then kept up to date by every change applied. A call the tally would refuse is measured
    afresh first (the host may have removed files meanwhile); what the host adds between calls is
    not seen until then. ``_Journal`` names an apply under way (``_Stage``)."""
    up = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    ws = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not os.listdir(up):
            return None  # nothing written: the common case costs one readdir
        if announce is not None:
            announce()
        until = None if within is None else time.monotonic() + within
        journal = _Journal(ws, tally)
        try:
            plan, before = _judge(up, ws, quota, tally, journal, until)
        except Refused as e:
            return f"the call's changes to the workspace were discarded: {e}"
        _write_tally(tally, None)  # unknown while applying (a keeper killed meanwhile leaves none)
        problem = _apply(up, ws, plan, journal, until, within)
        if problem is None and before is not None:
            _write_tally(tally, max(0, before + plan.delta))
        return problem
    finally:
        os.close(up)
        os.close(ws)


def _judge(up: int, ws: int, quota: int, tally: str | None, journal: _Journal,
           until: float | None) -> tuple[_Plan, int | None]:
    """Take the lock, remove what an apply killed midway left, and plan the change set: the plan and
    the workspace's size before it (None: unknown), or ``Refused`` saying why nothing is applied."""
    _lock(ws, LOCK_WAIT if until is None else max(0.0, min(LOCK_WAIT, until - time.monotonic())))
    journal.recover()  # what an apply killed midway left
    plan = _Plan(quota)
    plan.directory(up, ws, os.fstat(ws).st_size, 0, ())
    before = _read_tally(tally)
    if plan.delta > 0 and (before is None or before + plan.delta > quota):
        before = tree_usage(ws, quota)  # measured: the first time, or before refusing
        _write_tally(tally, before if before <= quota else None)  # a walk cut short is a lower bound
        if before + plan.delta > quota:
            raise Refused(f"they would take it to {(before + plan.delta) / MB:.2f} MB or more, over its quota "
                          f"of {quota / MB:g} MB (--workspace-quota; it held {before / MB:.2f} MB or more)")
    return plan, before


def _apply(up: int, ws: int, plan: _Plan, journal: _Journal, until: float | None,
           within: float | None) -> str | None:
    """Apply a planned change set in ``_Stage``'s steps, the lock held: None, or what went wrong."""
    st = os.fstat(ws)
    stage = _Stage(ws, (st.st_uid, st.st_gid), os.urandom(8).hex(), journal, _fd_budget(plan.depth))
    try:
        try:
            stage.copy(up, ws, ())
            if until is not None and time.monotonic() > until:
                raise Refused(f"applying them took more than {within:g} s")
            stage.trash()  # journal and trash directory before the first step in place
        except (OSError, Refused) as e:
            why = e if isinstance(e, Refused) else f"they could not be copied to it ({e})"
            return f"the call's changes to the workspace were discarded: {why}"
        try:
            stage.put_in_place()
        except (OSError, RecursionError) as e:  # the host changed the workspace under the apply
            return (f"the call's changes to the workspace could not all be applied ({e}): "
                    f"{stage.placed} of {len(stage.ops)} were put in place")
    finally:
        if stage.empty_trash():
            with contextlib.suppress(OSError):  # the next apply finds nothing to remove then
                journal.write(None)
        stage.close()
    return None


def _fd_budget(depth: int) -> int:
    """How many copies step 1 holds open unnamed (the rest are named in the trash directory): what
    this process may open, less what its walks of a change set ``depth`` deep need at once (two a
    level, and a few). The keeper's limit is the call's ``open_files`` (256 by default)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, soft - 2 * depth - 32)


class _Journal:
    """Names the apply under way (its token, so its trash directory), None when none is: a trusted
    extended attribute (``JOURNAL_XATTR``) of the workspace's directory, which only root reads or
    writes (the tools have no capability) and which outlives the executor, so a trash left by a
    keeper killed mid-apply is found by the next apply or executor; on a filesystem without trusted
    attributes, a file beside the tally (gone with the executor). A constant size either way."""

    def __init__(self, ws: int, tally: str | None) -> None:
        self.ws, self.path = ws, None if tally is None else f"{tally}.journal"

    def read(self) -> str | None:
        try:
            token = os.getxattr(self.ws, JOURNAL_XATTR).decode(errors="replace")
        except OSError as e:
            if e.errno not in (errno.ENOTSUP, errno.ENODATA) or self.path is None:
                return None
            try:
                with open(self.path) as f:
                    token = f.read().strip()
            except OSError:
                return None
        return token if len(token) == 16 and all(c in "0123456789abcdef" for c in token) else None

    def write(self, token: str | None) -> None:
        try:
            if token is None:
                os.removexattr(self.ws, JOURNAL_XATTR)
            else:
                os.setxattr(self.ws, JOURNAL_XATTR, token.encode())
            return
        except OSError as e:
            if token is None and e.errno == errno.ENODATA:
                return
            if e.errno != errno.ENOTSUP or self.path is None:
                raise
        if token is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)

    def recover(self) -> None:
        """Remove what the apply the journal names left (its trash directory); the caller holds the lock."""
        token = self.read()
        if token is not None:
            clean(self.ws, token)
            self.write(None)


def recover(workspace: str, tally: str | None = None, wait: float = STOP_WAIT) -> None:
    """At the executor's exit: once no keeper applies any more (the lock, ``wait`` at most), remove
    what one killed mid-apply (a stop) left, so the workspace shows all or nothing of every call."""
    with contextlib.suppress(OSError, Refused):
        ws = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _lock(ws, wait)
            _Journal(ws, tally).recover()
        finally:
            os.close(ws)


def _read_tally(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _write_tally(path: str | None, size: int | None) -> None:
    if path is None:
        return
    if size is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    temp = f"{path}.{os.getpid()}"
    with open(temp, "w") as f:
        f.write(str(size))
    os.rename(temp, path)
