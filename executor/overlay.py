"""``--workspace-rw`` under ``--profile hardened``: each call's writes to the workspace are a
transaction, bounded by ``--workspace-quota``.

No process that runs tool code ever writes the real workspace. A hardened worker sees it as an
overlay: the real workspace (through the idmapped mount, so the tools act as its owner) is the
lower layer; the upper layer is a private tmpfs of the call's own, capped at the quota in bytes
(``size=``) and in files (``nr_inodes=``), so while the call runs it cannot add more than that,
whatever it does (many small files, sparse files, hard links, racing writers: the kernel refuses
with ENOSPC). When the call is over, the worker's **keeper** (the process the template forked,
which forks the sandboxed process that runs the call and stays outside its sandbox) applies the
upper layer to the real workspace, or discards it:

* applied only if the worker answered the call: a reply to the request in flight reached the
  keeper. A call that timed out, crashed or was killed (memory, output) before answering, or whose
  reply was malformed or too large, changes nothing;
* before anything is applied, the whole change set is checked: only regular files, directories,
  symbolic links and the overlay's own deletion marks (whiteouts, opaque directories) are taken,
  nested at most ``MAX_DEPTH`` deep, and the workspace's size afterwards (``usage``) must stay
  within the quota (or not grow). Otherwise nothing is applied and the call's result becomes an
  ``output_limit`` error saying why;
* files are copied (never moved or linked: the upper layer is the tool's), each written to an
  unnamed file (``O_TMPFILE``) and renamed into place whole, owned by the workspace's owner, without
  set-ID bits; symbolic links are made as links and never followed; every file is opened from a
  directory descriptor with ``O_NOFOLLOW``, and sizing enters only what ``lstat`` shows is a
  directory;
* appliers of concurrent calls take turns (``flock`` on the workspace directory).

The keeper holds the call's reply until no process of the call can run any more (the sandboxed
process is PID 1 of its namespace: stopped with no child, or dead, nothing of the call is left),
applies, then forwards the reply, changed to the error if the changes were refused. So a result the
client holds means the workspace already shows (or will never show) the call's writes: the next
call sees them, and nothing of the call writes anything afterwards.

Cost: a second fork per worker (ahead of the call), one hop more for the request and the reply,
and, for a call that wrote something, the copy (and a walk of what it replaces or deletes). The
workspace's size is walked once, by the first call that adds to it, and then tracked through every
change applied (``commit``'s tally). Mounts live only in the keeper's and the
worker's mount namespaces, which die with them: nothing is left on the host by construction (no
loop device, no image file, no project quota to set up).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import shutil
import signal
import socket
import stat
import struct
import time
from typing import NoReturn

from executor import framing
from executor.channel import CallRequest, ChannelError, Reply, Started
from protocol import Limits
from protocol.codec import unpack

MB = 1024 * 1024
BLOCK = 4096  # every name counts at least this much (and sizes are rounded up to it): bounds files too
DEFAULT_QUOTA_MB = 1024
MAX_DEPTH = 100  # directories nested deeper than this in one call's changes are refused (2 fds a level)
LOCK_WAIT = 60.0  # seconds an applier waits for another call's apply to finish
UPPER = "/.ciayn-upper"  # in the staged root: where the keeper mounts the call's tmpfs
TALLY = "/.ciayn-tally"  # in the staged root: the executor's tmpfs holding the workspace's size (``commit``)
WHITEOUT_RDEV = 0  # overlayfs marks a deletion with a character device 0:0
OPAQUE_XATTR = "trusted.overlay.opaque"  # a directory that hides the lower one of its name
OVERLAY_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"  # no metadata-only copy-ups, no redirects
STOP_WAIT = 5.0  # seconds the keeper waits for an answered call to stop before killing it
PF_EXITING = 0x4  # a task's flag from the start of its exit
_HEADER = struct.Struct("!I")
_READ = 1 << 16


class Refused(Exception):
    """The call's changes cannot be applied; the message is for the call's result."""


def usage(st: os.stat_result) -> int:
    """What one name costs against the quota: its apparent size rounded up to ``BLOCK`` (so a
    sparse file counts in full, and each name at least one block, which bounds the number of files
    too). Hard links count once per name: that is how they are applied."""
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return max(BLOCK, -(-st.st_size // BLOCK) * BLOCK)
    return BLOCK


def tree_usage(dir_fd: int) -> int:
    """``usage`` of everything under an open directory, never following a symbolic link: only
    entries seen as directories by ``lstat`` are entered, and no tool process can change the real
    workspace meanwhile (appliers hold its lock). One descriptor at a time, however wide."""
    total = 0
    stack = [f"/proc/self/fd/{dir_fd}"]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                total += usage(st)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return total


def _open_dir(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _lstat(name: str, dir_fd: int | None) -> os.stat_result | None:
    if dir_fd is None:
        return None
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "file of an unknown type"


class _Changes:
    """One walk of the upper layer against the real workspace: a dry run (``apply=False``) sizes
    and checks the change set; the second walk applies it."""

    def __init__(self, owner: tuple[int, int], apply: bool) -> None:
        self.owner = owner
        self.apply = apply
        self.delta = 0  # bytes (``usage``) the workspace gains
        self.entries = 0

    def directory(self, upper: int, real: int | None, depth: int, where: str) -> None:
        if depth > MAX_DEPTH:
            raise Refused(f"directories nested more than {MAX_DEPTH} deep ({where[:200]}...)")
        for name in sorted(os.listdir(upper)):
            self.entries += 1
            path = f"{where}/{name}"
            st = os.stat(name, dir_fd=upper, follow_symlinks=False)
            old = _lstat(name, real)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == WHITEOUT_RDEV:  # deleted by the call
                self.delta -= self._old_usage(real, name, old)
                if self.apply and real is not None and old is not None:
                    _remove(real, name, old)
            elif stat.S_ISDIR(st.st_mode):
                merged = old is not None and stat.S_ISDIR(old.st_mode) and not _opaque(upper, name)
                self.delta += usage(st) - (usage(old) if merged and old is not None else
                                           self._old_usage(real, name, old))
                self._enter(upper, real, name, st, old, merged, depth, path)
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                self.delta += usage(st) - self._old_usage(real, name, old)
                if self.apply and real is not None:
                    _put(upper, real, name, st, old, self.owner)
            else:
                raise Refused(f"the call made {path[1:]!r}, a {_kind(st.st_mode)}: only files, directories and "
                              "symbolic links can be written to the workspace")

    def _enter(self, upper: int, real: int | None, name: str, st: os.stat_result, old: os.stat_result | None,
               merged: bool, depth: int, path: str) -> None:
        sub_real = None
        if self.apply and real is not None:
            if not merged:
                if old is not None:
                    _remove(real, name, old)
                os.mkdir(name, 0o700, dir_fd=real)
            sub_real = _open_dir(name, real)
            if not merged:  # a directory of the host's keeps its owner
                os.fchown(sub_real, *self.owner)
            if not merged or old is None or stat.S_IMODE(st.st_mode) != stat.S_IMODE(old.st_mode):
                os.fchmod(sub_real, stat.S_IMODE(st.st_mode) & 0o777)
        elif merged and real is not None:
            sub_real = _open_dir(name, real)
        sub_upper = _open_dir(name, upper)
        try:
            self.directory(sub_upper, sub_real, depth + 1, path)
        finally:
            os.close(sub_upper)
            if sub_real is not None:
                os.close(sub_real)

    @staticmethod
    def _old_usage(real: int | None, name: str, old: os.stat_result | None) -> int:
        if real is None or old is None:
            return 0
        if stat.S_ISDIR(old.st_mode):
            fd = _open_dir(name, real)
            try:
                return usage(old) + tree_usage(fd)
            finally:
                os.close(fd)
        return usage(old)


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
        shutil.rmtree(name, dir_fd=real)  # descriptor-based: never follows a symbolic link
    else:
        os.unlink(name, dir_fd=real)


def _put(upper: int, real: int, name: str, st: os.stat_result, old: os.stat_result | None,
         owner: tuple[int, int]) -> None:
    """Write one file or symbolic link of the upper layer into the real directory, whole: made under a
    temporary name and renamed over ``name``."""
    temp = f".ciayn-apply-{os.urandom(8).hex()}"
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=upper), temp, dir_fd=real)
        os.chown(temp, *owner, dir_fd=real, follow_symlinks=False)
    else:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=upper)
        try:
            try:  # unnamed until it is whole: nothing is left if the keeper is killed meanwhile
                dst, named = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=real), False
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC  # no O_TMPFILE here
                dst, named = os.open(temp, flags, 0o600, dir_fd=real), True
            try:
                offset = 0
                while sent := os.sendfile(dst, src, offset, 1 << 30):
                    offset += sent
                os.fchown(dst, *owner)
                os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
                if not named:
                    os.link(f"/proc/self/fd/{dst}", temp, dst_dir_fd=real, follow_symlinks=True)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    if old is not None and stat.S_ISDIR(old.st_mode):
        shutil.rmtree(name, dir_fd=real)
    os.rename(temp, name, src_dir_fd=real, dst_dir_fd=real)


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


def commit(upper: str, workspace: str, quota: int, tally: str | None = None) -> str | None:
    """Apply the upper layer ``upper`` to ``workspace`` if the change set is acceptable and the
    workspace stays within ``quota`` bytes (or does not grow). Returns None when applied (or there
    was nothing to apply), else why nothing was applied, for the call's result. Runs in the keeper,
    as root, after every process of the call is gone.

    ``tally`` is a file (private to the executor) that remembers the workspace's size between
    calls, so that a call does not walk the whole workspace: measured by the first call that adds
    to it, then kept up to date by every change applied. A call the tally would refuse is measured
    afresh first (the host may have removed files meanwhile); what the host adds between calls is
    not seen until then."""
    up = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    ws = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not os.listdir(up):
            return None  # nothing written: the common case costs one readdir
        st = os.fstat(ws)
        owner = (st.st_uid, st.st_gid)
        try:
            _lock(ws)
            plan = _Changes(owner, apply=False)
            plan.directory(up, ws, 0, "")
            before = _read_tally(tally)
            if plan.delta > 0 and (before is None or before + plan.delta > quota):
                before = tree_usage(ws)  # measured: the first time, or before refusing
                _write_tally(tally, before)
                if before + plan.delta > quota:
                    return (f"the call's changes to the workspace were discarded: they would take it to "
                            f"{(before + plan.delta) / MB:.2f} MB, over its quota of {quota / MB:g} MB "
                            f"(--workspace-quota; it held {before / MB:.2f} MB)")
        except Refused as e:
            return f"the call's changes to the workspace were discarded: {e}"
        _write_tally(tally, None)  # unknown while applying (a keeper killed meanwhile leaves none)
        done = _Changes(owner, apply=True)
        try:
            done.directory(up, ws, 0, "")
        except OSError as e:
            return (f"the call's changes to the workspace could not all be applied ({e}); "
                    f"{done.entries} of {plan.entries} entries were")
        if before is not None:
            _write_tally(tally, max(0, before + plan.delta))
        return None
    finally:
        os.close(up)
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


# --------------------------------------------------------------------------------------------------
# the keeper: between the supervisor and the sandboxed process that runs the call


class _Frames:
    """Splits a byte stream of length-prefixed frames (``executor.framing``) without decoding it,
    so frames can be forwarded byte for byte."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def size(self) -> int | None:
        """The body size the next frame announces, once its header is in."""
        return _HEADER.unpack_from(self.buf)[0] if len(self.buf) >= _HEADER.size else None

    def pop(self) -> bytes | None:
        size = self.size()
        if size is None or len(self.buf) < _HEADER.size + size:
            return None
        frame = bytes(self.buf[: _HEADER.size + size])
        del self.buf[: _HEADER.size + size]
        return frame


def _exiting(pid: int) -> bool:
    """Whether every thread of ``pid`` is in its exit (``PF_EXITING``): none runs code any more."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except FileNotFoundError:
            continue  # that thread is gone
        if not int(fields[6]) & PF_EXITING:  # the 9th field, flags
            return False
    return True


def _has_children(pid: int) -> bool:
    """Whether ``pid`` has a child (running or not yet reaped), from /proc: any of its threads'."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/children") as f:
            if f.read().strip():
                return True
    return False


def _reply_cap(limits: Limits) -> int:
    from executor.worker import reply_cap  # imported late: executor.worker imports this module's importer

    return reply_cap(limits)


def _is_start(frame: bytes) -> bool:
    try:
        return Started.from_wire(_decode(frame) or {}) is not None
    except ChannelError:
        return False  # held, and judged by the supervisor like any malformed message


def _decode(frame: bytes) -> object:
    try:
        return unpack(frame[_HEADER.size:])
    except Exception:  # msgpack raises many types for malformed input
        return None


class Keeper:
    """The process a hardened ``--workspace-rw`` worker is, outside the sandbox: it relays the
    channel between the supervisor and ``child`` (the sandboxed process running the call), holds
    what ``child`` sends after its start until no process of the call runs any more, commits the
    call's upper layer if that was the reply to the request, then forwards it. A ``child`` that dies
    before answering is mirrored (the keeper exits with its exit code or signal, so the supervisor
    reports the death as usual)."""

    def __init__(self, chan: socket.socket, inner: socket.socket, child: int, upper: str, workspace: str,
                 quota: int, max_result_kb: int, pid_namespace: bool = True, tally: str | None = None) -> None:
        self.chan, self.inner, self.child = chan, inner, child
        self.upper, self.workspace, self.quota, self.tally = upper, workspace, quota, tally
        self.cap = _reply_cap(Limits(max_result_kb=max_result_kb))
        self.request: CallRequest | None = None
        self.from_supervisor = _Frames()
        self.from_child = _Frames()
        self.held: list[bytes] = []  # frames of the child after its start, until the call is stopped
        self.passthrough = False  # something we cannot judge: forward as is, apply nothing
        self.pid_namespace = pid_namespace  # the child is PID 1 of its own (else: --allow-degraded)

    def run(self) -> NoReturn:
        pidfd = os.pidfd_open(self.child)
        poller = select.poll()
        for fd in (self.chan.fileno(), self.inner.fileno(), pidfd):
            poller.register(fd, select.POLLIN)
        inner_open = True
        status: int | None = None  # the child's wait status, once it is gone
        while True:
            fds = {fd for fd, _ in poller.poll()}
            if self.chan.fileno() in fds and not self._from_supervisor():
                self._kill_child()  # the supervisor is gone (shutting down): so is the call
                os._exit(0)
            if inner_open and self.inner.fileno() in fds and not self._from_child():
                poller.unregister(self.inner.fileno())
                inner_open = False
            if self.held and not self.passthrough:  # its answer (or what stands for it) is in
                status = self._stop_call()
                break
            if pidfd in fds:
                _, status = os.waitpid(self.child, 0)
                break
        while inner_open and self._from_child(block=False):  # what it sent before it stopped or died
            pass
        self._finish()
        if status is None or os.WIFSTOPPED(status):  # stopped for the commit: it was about to exit anyway
            self._kill_child()
            os._exit(0)
        self._exit_like(status)

    def _stop_call(self) -> int | None:
        """The child answered: make sure no process of the call runs any more before its changes are
        read. It is sent SIGSTOP (which it cannot catch; a group stop completes once every thread is
        out of its system call); usually it has already begun to exit (the worker exits right after
        its reply), so every thread being in its exit (``PF_EXITING``) counts as well. Either way,
        with no child (PID 1 of its namespace, it inherits every orphan) nothing else of the call
        exists, and its exit, which takes milliseconds (a forked address space, namespaces to tear
        down), is left until after the answer. With a child, it is killed with its namespace and
        waited for. Returns its wait status if it is gone already, else None."""
        if not self.pid_namespace:  # what it started is not bound to it: kill all (orphans come to us)
            from executor.worker import kill_children

            kill_children(wait=STOP_WAIT)
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child, signal.SIGSTOP)
        deadline = time.monotonic() + STOP_WAIT
        while True:
            pid, status = os.waitpid(self.child, os.WUNTRACED | os.WNOHANG)
            if pid and not os.WIFSTOPPED(status):
                return status  # gone, and its namespace with it
            if (pid or _exiting(self.child)) and not _has_children(self.child):
                return None
            if pid or time.monotonic() > deadline:
                self._kill_child()
                return None
            time.sleep(0.0002)

    def _from_supervisor(self) -> bool:
        data = self.chan.recv(_READ)
        if not data:
            return False
        self.from_supervisor.feed(data)
        while (frame := self.from_supervisor.pop()) is not None:
            with contextlib.suppress(ValueError):  # ChannelError, pydantic's ValidationError
                self.request = CallRequest.from_wire(_decode(frame))
                if self.request.limits:
                    self.cap = _reply_cap(Limits.model_validate(self.request.limits))
        with contextlib.suppress(OSError):  # a dead child: its exit is seen on the pidfd
            self.inner.sendall(data)
        return True

    def _from_child(self, block: bool = True) -> bool:
        try:
            data = self.inner.recv(_READ, 0 if block else socket.MSG_DONTWAIT)
        except (BlockingIOError, ConnectionError):
            return False
        if not data:
            return False
        if self.passthrough:
            self.chan.sendall(data)
            return True
        self.from_child.feed(data)
        while True:
            size = self.from_child.size()
            if size is not None and size > self.cap:  # the supervisor refuses it (output_limit): let it see it
                self._pass_through()
                return True
            frame = self.from_child.pop()
            if frame is None:
                return True
            if not self.held and _is_start(frame):
                self.chan.sendall(frame)  # the call started: from here on it may have had effects
            else:
                self.held.append(frame)

    def _pass_through(self) -> None:
        self.passthrough = True
        self.chan.sendall(b"".join(self.held) + bytes(self.from_child.buf))
        self.held.clear()
        self.from_child.buf.clear()

    def _reply(self) -> Reply | None:
        """The child's reply to the request in flight, if that is exactly what it sent."""
        if self.passthrough or self.request is None or len(self.held) != 1 or self.from_child.buf:
            return None
        try:
            reply = Reply.from_wire(_decode(self.held[0]))
        except (ChannelError, TypeError, ValueError):
            return None
        return reply if reply.seq == self.request.seq else None

    def _finish(self) -> None:
        """Every process of the call is stopped or gone: commit if the child answered the request in
        flight (a death after its answer does not undo it), then forward its frames."""
        reply = self._reply()
        if reply is not None:
            try:
                problem = commit(self.upper, self.workspace, self.quota, self.tally)
            except OSError as e:
                problem = f"the call's changes to the workspace could not be applied: {e}"
            if problem is not None:
                reply.ok, reply.value, reply.value_is_repr = False, None, False
                reply.error = {"kind": "output_limit", "message": problem}
                self.held = [framing.pack(reply.to_wire())]
        with contextlib.suppress(OSError):
            self.chan.sendall(b"".join(self.held) + bytes(self.from_child.buf))

    def _kill_child(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.child, 0)

    @staticmethod
    def _exit_like(status: int) -> NoReturn:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70)

