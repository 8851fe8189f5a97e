"""The template process: ``python -P -m executor.workers.template CHANNEL_FD SUPERVISOR_PID``.

Every template is a new interpreter (``executor.workers.spawn``): its memory never held the
supervisor's modules, keys or other clients' calls and results, which every worker forked from it
would otherwise map. It reads its configuration (``Configure``) from the channel; a supervisor whose
start was refused before it configured us closes the channel, and then it exits quietly, having read
no tool module. Configured, it (``template_main``) applies the environment allowlist, imports the
tool modules once, reports their specs, forks a worker (``executor.workers.worker``) per ``Spawn``,
kills whatever a dead worker left (it is a child subreaper) and reports every exit.
Why and how: docs/executor.md#the-template-and-its-workers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace

from executor.registry import RegistryError, Tool, describe, find_tools, schema_checks_it
from executor.workers import confinement, framing, quickfork
from executor.workers.cgroups import CgroupSupport, Group
from executor.workers.channel import (
    ChannelError,
    Configure,
    Exited,
    LoadFailed,
    Spawn,
    Spawned,
    Sweep,
    ToolsLoaded,
    template_message,
)
from executor.workers.privacy import (
    CAP_SYS_PTRACE,
    CAP_SYS_RESOURCE,
    HOST_ADMIN_CAPS,
    drop_capabilities,
    not_dumpable,
    scrub_initial_environment,
)
from executor.workers.processes import (
    KILL_WAIT,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    SHUTDOWN_WAIT,
    close_fds_except,
    kill_children,
    prctl,
)
from executor.workers.worker import WorkerConfig, prepare_workers, worker_main
from protocol.environment import allowed_environment

CONFIGURE_TIMEOUT = 120.0  # seconds to wait for the supervisor's Configure (the first: while the supervisor starts)
SPARE_GROUPS = 16  # the most groups of dead workers kept for the next workers...
SPARE_KEEP = 1.0  # ...each for at most this many seconds, then removed


def main(argv: list[str]) -> None:
    fd, supervisor = int(argv[0]), int(argv[1])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() not in (supervisor, 0):  # it died before we could ask to die with it (0: we are
        os._exit(1)                           # PID 1 of our own namespace; then its channel says so)
    not_dumpable()  # exec made us dumpable again: no ptrace or /proc/PID/mem of us by a tool of our user
    scrub_initial_environment()
    chan = socket.socket(fileno=fd)
    chan.settimeout(CONFIGURE_TIMEOUT)
    try:
        config = Configure.from_wire(framing.recv(chan))
    except EOFError:
        os._exit(0)
    except (OSError, framing.FrameError, ChannelError) as e:
        print(f"ciayn-executor: template: no configuration from the supervisor ({e})", file=sys.stderr)
        os._exit(1)
    chan.settimeout(None)
    if config.sys_path:
        sys.path[:] = config.sys_path  # the supervisor's, for the tools it imports
    logging.basicConfig(stream=sys.stderr, level=config.log_level,
                        format=f"%(asctime)s ciayn-executor[{supervisor}] template %(levelname)s %(message)s")
    confined = confinement.from_wire(config.confinement) if config.confinement is not None else None
    template_main(chan, WorkerConfig.from_wire(config.worker, confined))


def template_main(chan: socket.socket, config: WorkerConfig) -> None:
    """Entry of the template process (never returns)."""
    code = 0
    try:
        close_fds_except(0, 1, 2, chan.fileno())  # the supervisor's pidfd, sockets, pipes: not ours
        kept = allowed_environment(os.environ, config.pass_env)
        os.environ.clear()
        os.environ.update(kept)
        pool = _Workers(CgroupSupport.detect() if config.use_cgroups else None, config)
        if pool.cgroups is not None:
            pool.cgroups.sweep()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        os.setsid()
        if config.confinement is None:
            # As root, what no worker of the default profile may hold goes here, once, before any
            # tool module is imported (its import-time code runs in this process): no tracing the
            # executor's processes, no lifting hard limits, no host administration. A hardened
            # worker needs the template's rights to build its sandbox, and drops them there.
            drop_capabilities(CAP_SYS_PTRACE, CAP_SYS_RESOURCE, *HOST_ADMIN_CAPS.values())
        quickfork.watch_hooks()
        try:
            tools = find_tools(config.targets)
        except RegistryError as e:
            framing.send(chan, LoadFailed(message=str(e)).to_wire())
            os._exit(3)
        if not _describe(chan, tools, pool.cgroups.describe() if pool.cgroups else ""):
            os._exit(3)
        prepare_workers(config)
        gc.freeze()  # a worker's garbage collections never walk (and so copy) the template's objects
        _template_loop(chan, tools, pool)
    except BaseException:
        traceback.print_exc()
        code = 1
    # The workers die with us (PDEATHSIG); what they left must not go to init. Quickly: what SIGKILL
    # cannot stop now (frozen, uninterruptible) is the supervisor's, as a subreaper, once we are gone.
    kill_children(wait=SHUTDOWN_WAIT)
    with contextlib.suppress(BaseException):
        pool.remove_all(wait=SHUTDOWN_WAIT)
    os._exit(code)


def _describe(chan: socket.socket, tools: dict[str, Tool], cgroups: str) -> bool:
    """Send the supervisor the tools' specs (``ToolsLoaded``), or why they cannot be served
    (``LoadFailed``); whether they can. The specs are built by reflection with pydantic. Where the
    schema says all every annotation checks (``schema_checks_it``), that happens in a child that
    exits once it has sent them: the template never maps pydantic, so no fork copies it. Otherwise
    here: such tools keep their spec, and their workers check arguments with it (``run_call``)."""
    checked = [name for name, t in tools.items() if not schema_checks_it(t)]
    if checked:
        return _send_specs(chan, tools, cgroups, checked)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _send_specs(chan, tools, cgroups, checked) else 3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _send_specs(chan: socket.socket, tools: dict[str, Tool], cgroups: str, checked: Sequence[str]) -> bool:
    """Describe the tools and send ``ToolsLoaded``, the ``checked`` ones keeping their spec for their
    workers' checks; or send ``LoadFailed``. Whether the tools can be served."""
    try:
        specs = {name: describe(t) for name, t in tools.items()}
        framing.send(chan, ToolsLoaded(specs=[spec.model_dump() for spec in specs.values()], cgroups=cgroups,
                                       checked=list(checked)).to_wire())
    except RegistryError as e:
        framing.send(chan, LoadFailed(message=str(e)).to_wire())
        return False
    except BaseException:
        traceback.print_exc()
        return False
    for name in checked:
        tools[name] = replace(tools[name], spec=specs[name])
    return True


class _Workers:
    """The template's live workers and their control groups. A dead worker's groups that are found
    clean (``Group.reusable``) are the next worker's: making and removing them costs more than a
    fork. Those no worker takes within ``SPARE_KEEP`` are removed."""

    def __init__(self, cgroups: CgroupSupport | None, config: WorkerConfig) -> None:
        self.cgroups = cgroups
        self.config = config
        self.groups: dict[int, Group | None] = {}
        self.dying: list[Group] = []
        self.spare: list[tuple[float, Group]] = []  # (when its worker was gone, the groups), oldest first
        self.count = 0

    def new_group(self, worker: int) -> Group | None:
        if self.cgroups is None:
            return None
        limits = self.config.limits
        while self.spare:
            group = self.spare.pop(0)[1]  # the oldest: every kept group goes round before one expires
            try:
                group.limit(limits.memory_mb, limits.processes, again=True)
                return group
            except OSError:
                self.dying.append(group)
        self.count += 1
        try:
            return self.cgroups.create(f"{self.config.name}-{worker}-{self.count}", limits.memory_mb,
                                       limits.processes)
        except OSError as e:
            print(f"ciayn-executor: cannot make control groups for a worker ({e}); rlimits only", file=sys.stderr)
            return None

    def gone(self, pid: int, usual: bool) -> bool:
        """A worker died: kill its group and everything it left; keep the group for the next worker
        if it died as workers do (``usual``: killed, or an exit without error; not a worker that
        could not set itself up, which its group might be the cause of) and the group is clean,
        otherwise remove it. Returns whether the kernel OOM-killed something in it."""
        group = self.groups.pop(pid, None)
        oom = group.oom_killed() if group is not None else False
        if group is not None:
            group.kill_all()
        self.sweep()
        if group is not None:
            if usual and not oom and len(self.spare) < SPARE_GROUPS and group.reusable():
                self.spare.append((time.monotonic(), group))
            else:
                self.dying.append(group)
        self.remove_dead_groups()
        return oom

    def spare_due(self, now: float) -> float | None:
        """Seconds until the oldest spare group is to be removed (None: there is none)."""
        return max(0.0, self.spare[0][0] + SPARE_KEEP - now) if self.spare else None

    def expire_spares(self, now: float) -> None:
        while self.spare and now >= self.spare[0][0] + SPARE_KEEP:
            self.dying.append(self.spare.pop(0)[1])
        self.remove_dead_groups()

    def remove_dead_groups(self) -> None:
        """Remove the groups of dead workers that are empty now; one still holding a process that
        SIGKILL has not stopped yet (frozen, uninterruptible sleep) is tried again later."""
        self.dying = [g for g in self.dying if not g.remove(wait=0.05)]

    def sweep(self) -> None:
        """Kill every child of the template that is not a live worker: orphans of dead workers
        (reparented to us, the subreaper) and processes a tool started with ``CLONE_PARENT``."""
        kill_children(keep=frozenset(self.groups))

    def remove_all(self, wait: float = KILL_WAIT) -> None:
        for group in [*self.groups.values(), *self.dying, *(g for _, g in self.spare)]:
            if group is not None:
                group.kill_all()
                group.remove(wait)
        self.groups.clear()
        self.dying.clear()
        self.spare.clear()


def _template_loop(chan: socket.socket, tools: dict[str, Tool], pool: _Workers) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        ready, _, _ = select.select([chan.fileno(), wake_r], [], [], pool.spare_due(time.monotonic()))
        if pool.spare:
            pool.expire_spares(time.monotonic())
        if wake_r in ready:
            os.read(wake_r, 4096)
            if not _reap(chan, pool):
                return  # the supervisor is gone: so are the workers and all they left
        if chan.fileno() in ready:
            try:
                req = template_message(framing.recv(chan))
            except (EOFError, OSError, framing.FrameError):  # the supervisor closed the channel: shutting down
                return
            except ChannelError as e:
                print(f"ciayn-executor: template: ignoring a malformed request ({e})", file=sys.stderr)
                continue
            if isinstance(req, Spawn):
                group = pool.new_group(req.worker)
                try:
                    pid = _spawn_worker(chan, req.worker, tools, pool.config, group, rehearsal=req.rehearse)
                except (BrokenPipeError, ConnectionResetError):  # the supervisor closed the channel: shutting down
                    if group is not None:
                        pool.dying.append(group)  # removed on the way out, with the worker it was made for
                    return
                pool.groups[pid] = group
            elif isinstance(req, Sweep):
                pool.sweep()


def _reap(chan: socket.socket, pool: _Workers) -> bool:
    """Reap dead children, report dead workers with what the kernel measured of them; False when
    the supervisor can no longer be told (it closed the channel: shutting down)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if pid in pool.groups:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            oom = pool.gone(pid, usual=sig == signal.SIGKILL or code == 0)
            try:
                exited = Exited(pid=pid, signal=sig, code=code, oom=oom, cpu_s=usage.ru_utime + usage.ru_stime,
                                peak_rss_kb=usage.ru_maxrss)
                framing.send(chan, exited.to_wire())
            except OSError:
                return False


def _spawn_worker(chan: socket.socket, worker: int, tools: dict[str, Tool], config: WorkerConfig,
                  group: Group | None, rehearsal: bool = False) -> int:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sandbox = config.confinement  # --profile hardened: the worker is PID 1 of a namespace of its own
    if sandbox is not None:
        sandbox.before_fork()
    template = os.getpid() if sandbox is None else 0  # a hardened worker cannot see (nor signal) us
    pid = quickfork.fork()
    if pid == 0:
        try:
            worker_main(child_end, out_w, err_w, tools, config, group, template=template, rehearsal=rehearsal)
        finally:
            os._exit(70)  # never reached: but a child that went on here would be a second template
    if sandbox is not None:
        sandbox.after_fork(pid)
    child_end.close()
    os.close(out_w)
    os.close(err_w)
    fds = [parent_end.fileno(), out_r, err_r]
    try:  # the supervisor signals the worker through it: never another process that reuses the pid
        fds.append(os.pidfd_open(pid))
    except OSError:  # Linux < 5.3: it signals by pid
        pass
    try:
        framing.send_with_fds(chan, Spawned(worker=worker, pid=pid).to_wire(), fds)
    finally:
        parent_end.close()
        for fd in fds[1:]:
            os.close(fd)
    return pid


if __name__ == "__main__":
    main(sys.argv[1:])
