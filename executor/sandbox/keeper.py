"""``--workspace-rw``: the call's *keeper*, the process a hardened worker is outside its sandbox.

``split`` runs in the freshly forked worker before any layer: it mounts the call's upper layer (a
tmpfs capped at the quota) in a mount namespace of its own and forks the process that is PID 1 of
a new PID namespace, takes over the channel, enters the sandbox and runs the call (only that child
returns). The parent becomes the ``Keeper``: it relays the channel between the supervisor and the
call, holds the call's reply until no process of the call runs any more, applies its writes
(``overlay.commit``, announced by ``Applying``), and forwards the reply, turned into an
``output_limit`` error if the writes were refused. Not ``executor.keeper`` (the supervisor's
template keeper).
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import stat
import struct
import time
import traceback
from typing import NoReturn

from executor.sandbox.config import HardenedConfig
from executor.sandbox.kernel import (
    CLONE_NEWNS,
    CLONE_NEWPID,
    MS_NODEV,
    MS_NOSUID,
    PR_SET_PDEATHSIG,
    LayerError,
    check,
    libc,
    prctl,
)
from executor.sandbox.mounts import mount
from executor.sandbox.overlay import APPLY_MARGIN, BLOCK, MB, STOP_WAIT, TALLY, UPPER, commit
from executor.workers import framing
from executor.workers.channel import Applying, CallRequest, ChannelError, Reply, Started, reply_cap
from executor.workers.processes import kill_children
from executor.workers.procfs import PF_EXITING, stat_fields
from protocol.timing import APPLY_GRACE
from protocol.values import unpack

_HEADER = struct.Struct("!I")
_READ = 1 << 16


def split(config: HardenedConfig, root: str, pid_namespace: bool) -> None:
    """Become the keeper of this worker's call (see the module's docstring); returns only in the
    child that runs the call. ``root``: the view the template built; ``pid_namespace``: the child
    gets one of its own (not with ``--allow-degraded`` on a machine without it)."""
    chan_fd = _channel_fd()
    check("mount-ns", "unshare(CLONE_NEWNS) for the call's upper layer", libc.unshare(CLONE_NEWNS))
    upper = root + UPPER
    quota = config.workspace_quota_mb * MB
    mount("tmpfs", upper, "tmpfs", MS_NOSUID | MS_NODEV, f"size={quota},nr_inodes={quota // BLOCK + 16},mode=0700")
    workspace = os.path.realpath(config.workspace)
    os.mkdir(upper + "/upper")
    os.chmod(upper + "/upper", stat.S_IMODE(os.stat(workspace).st_mode))
    os.chown(upper + "/upper", config.uid, config.gid)  # the tools own the merged root
    os.mkdir(upper + "/work", 0o700)
    keeper_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if pid_namespace:
        check("pid-ns", "unshare(CLONE_NEWPID)", libc.unshare(CLONE_NEWPID))
    pid = os.fork()
    if pid == 0:
        os.dup2(child_end.fileno(), chan_fd, inheritable=False)  # the worker code's channel, now to the keeper
        keeper_end.close()
        child_end.close()
        prctl("pid-ns", "die with the keeper", PR_SET_PDEATHSIG, signal.SIGKILL)
        return
    child_end.close()
    try:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        # The worker's file size limit stays: the call could not write a larger file either.
        _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
        Keeper(socket.socket(fileno=chan_fd), keeper_end, pid, upper + "/upper", workspace, quota,
               config.max_result_kb, pid_namespace=pid_namespace, tally=root + TALLY + "/workspace-size").run()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(70)


def _channel_fd() -> int:
    """The worker's channel: the one socket it holds (``executor.workers.worker`` closed every other
    descriptor but stdio before entering the sandbox)."""
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                sockets.append(fd)
    if len(sockets) != 1:
        raise LayerError("filesystem", f"expected one channel socket in a new worker, found {len(sockets)}")
    return sockets[0]




class _Frames:
    """Splits a byte stream of length-prefixed frames (``executor.workers.framing``) without decoding it,
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
            fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:
            continue  # that thread is gone
        if not int(fields[6]) & PF_EXITING:
            return False
    return True


def _has_children(pid: int) -> bool:
    """Whether ``pid`` has a child (running or not yet reaped), from /proc: any of its threads'."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/children") as f:
            if f.read().strip():
                return True
    return False


def _is_start(frame: bytes) -> bool:
    try:
        return Started.from_wire(_decode(frame) or {}) is not None
    except ChannelError:
        return False  # held, and judged by the supervisor like any malformed message


def _as_the_calls(frame: bytes) -> bytes:
    """A frame of the child's, made fit to forward: an ``Applying`` notice is the keeper's alone, so
    one the call sent becomes a message the supervisor refuses as malformed, as it would refuse it
    from a worker without a keeper (the call cannot buy itself time)."""
    if Applying.OP.encode() in frame:  # cheap test first: the reply is usually the only frame
        obj = _decode(frame)
        if isinstance(obj, dict) and obj.get("op") == Applying.OP:
            return framing.pack({"op": f"{Applying.OP} (sent by the call, not its keeper)"})
    return frame


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
        self.cap = reply_cap(max_result_kb)  # a call's own limits never change it
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
            with contextlib.suppress(ValueError):  # ChannelError
                self.request = CallRequest.from_wire(_decode(frame))
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
        self.chan.sendall(b"".join(map(_as_the_calls, self.held)) + bytes(self.from_child.buf))
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
                problem = commit(self.upper, self.workspace, self.quota, self.tally,
                                 announce=lambda: self._announce(reply.seq), within=APPLY_GRACE - APPLY_MARGIN)
            except OSError as e:
                problem = f"the call's changes to the workspace could not be applied: {e}"
            if problem is not None:
                reply.ok, reply.value, reply.value_is_repr = False, None, False
                reply.error = {"kind": "output_limit", "message": problem}
                self.held = [framing.pack(reply.to_wire())]
        with contextlib.suppress(OSError):
            self.chan.sendall(b"".join(map(_as_the_calls, self.held)) + bytes(self.from_child.buf))

    def _announce(self, seq: int) -> None:
        """Tell the supervisor the call answered and its writes are being applied (``Applying``): it
        gives the call ``APPLY_GRACE`` more, so its deadline does not kill us halfway."""
        with contextlib.suppress(OSError):
            self.chan.sendall(framing.pack(Applying(seq=seq).to_wire()))

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

