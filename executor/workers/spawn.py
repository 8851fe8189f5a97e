"""Starting the template process (``fork_template``): always a new interpreter
(``executor.workers.template``), never a fork of the supervisor's memory, which holds its imports,
its keys and other clients' calls and results. The forked child makes its PID namespace, says so
(``Isolated``) before any tool code runs, drops what no default-profile worker may hold and execs
``python -P``; the supervisor is a subreaper of whatever a dead template leaves. ``serve`` starts the first template
while it opens its endpoint; no template reads a tool module before its ``Configure``.
Why and how: docs/executor.md#the-templates-start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from typing import NoReturn

from executor.workers import framing, pidns, procfs
from executor.workers.channel import Isolated, LoadFailed
from executor.workers.privacy import (
    CAP_SYS_PTRACE,
    CAP_SYS_RESOURCE,
    HOST_ADMIN_CAPS,
    drop_capabilities,
)
from executor.workers.processes import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, close_fds_except, prctl


def enter_workspace(workspace: str | None) -> None:
    """Make this process's place the workspace (absolute ``workspace``, or the working directory),
    as the template and its workers see it: working directory, ``CIAYN_WORKSPACE``, and never
    ``sys.path``. ``python -m`` put the start directory first on the path; tools may write the
    workspace, and a file there named like a module that we, a template or a tool module import
    later would run in that process, outside any sandbox. Tool modules in the workspace are loaded
    by their path (``--tools ./tools.py``), never found there by name. Safe to call again."""
    if workspace:
        os.environ["CIAYN_WORKSPACE"] = workspace
        os.chdir(workspace)
    here = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != here]


def fork_template(confined: bool = False) -> tuple[int, socket.socket]:
    """Fork the template: PID 1 of a namespace of its own where the machine allows it
    (``executor.workers.pidns``), then a new interpreter (``executor.workers.template``). It first reports its
    namespace (``Isolated``, or ``LoadFailed`` with ``pidns.FAILED``), then waits for its
    ``Configure``, imports the tools and reports ``ToolsLoaded`` (or ``LoadFailed``). This process
    becomes a subreaper, so whatever a dead template leaves comes back to us to be killed, never to
    init. ``confined``: its workers will be under a ``Confinement``, which needs the template's rights
    to build their sandbox (and drops them in each worker)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    supervisor = os.getpid()
    isolated = pidns.isolate_next_child()
    try:
        pid = os.fork()
    finally:
        if isolated and os.getpid() == supervisor:
            pidns.restore()
    if pid == 0:
        ours.close()
        _template_namespace(isolated, theirs, supervisor)
        _exec_template(theirs, supervisor, confined)
    theirs.close()
    return pid, ours


def _default_signals() -> None:
    """Every signal at its default and none blocked, as exec then leaves them: an ignored signal and
    the blocked mask survive exec. The first template is forked before the supervisor installs its
    handlers, a replacement after, so otherwise what the executor was started with (``nohup``
    ignores SIGHUP) would reach the first template's workers and not a replacement's."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) is not signal.SIG_DFL:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _template_namespace(isolated: bool, chan: socket.socket, supervisor: int) -> None:
    """In the child just forked to be a template: make it PID 1 of a namespace of its own
    (``executor.workers.pidns``) if the supervisor could not (``isolated``: as root it did), set that
    namespace's ``/proc`` up, and say so (``Isolated``, with why not if it is not in a namespace of
    its own). A namespace whose ``/proc`` cannot be set up is reported to the supervisor instead
    (``LoadFailed`` with ``pidns.FAILED``), which then starts templates without one."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() not in (supervisor, 0):  # it died before we could ask to die with it
        os._exit(1)
    why = ""
    if not isolated:
        why = pidns.why_not()
        if pidns.try_user_namespace():  # returns in the template only (the relay stays behind)
            note = pidns.enter_user_namespace()
            why = f"{why}; {note}" if note else ""
    if not pidns.in_own_namespace():
        _say_isolated(chan, why or "no PID namespace")
        return
    try:
        pidns.set_up_child()
    except OSError as e:
        with contextlib.suppress(OSError):
            framing.send(chan, LoadFailed(message=e.strerror or str(e)).to_wire())
        os._exit(3)
    if pidns.user_namespace:  # what it holds there (CAP_SYS_ADMIN: mounts every worker would see) goes now
        drop_capabilities(*range(int(procfs.read("/proc/sys/kernel/cap_last_cap")) + 1))
    _say_isolated(chan, "")


def _say_isolated(chan: socket.socket, why_not: str) -> None:
    """The template's first message (``Isolated``), before any tool code can write on its channel."""
    try:
        framing.send(chan, Isolated(pid_ns=why_not).to_wire())
    except OSError:
        os._exit(1)  # the supervisor is gone


def _exec_template(chan: socket.socket, supervisor: int, confined: bool) -> NoReturn:
    """In the child forked to be a fresh template: become ``python -P -m executor.workers.template``, keeping
    only the standard descriptors and ``chan``. ``-P``: our working directory is the workspace, which
    tools may write; on the new interpreter's path, a file there named like a module it imports would
    run in the template, outside any sandbox; so is a PYTHONPATH entry that is empty, relative or the
    workspace, which is dropped. It finds ``executor`` through PYTHONPATH, and then takes our
    ``sys.path`` from ``Configure``."""
    try:
        close_fds_except(0, 1, 2, chan.fileno())
        if not confined:
            # Before the new interpreter reads a line of our code: a root tool can write that code,
            # and what it plants must not run with the rights no worker holds.
            drop_capabilities(CAP_SYS_PTRACE, CAP_SYS_RESOURCE, *HOST_ADMIN_CAPS.values())
        _default_signals()
        os.set_inheritable(chan.fileno(), True)
        env = dict(os.environ)
        package = sys.modules["executor"].__file__ or ""  # executor/__init__.py: its directory's parent
        root = os.path.dirname(os.path.dirname(os.path.abspath(package)))  # is where `executor` is found
        here = os.path.realpath(os.getcwd())  # the workspace
        # Only absolute entries, and never the workspace: an empty or relative one ("$PYTHONPATH:/x"
        # when it was unset) would put it on the path before ``-P`` could keep it off.
        kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                if os.path.isabs(p) and os.path.realpath(p) != here]
        env["PYTHONPATH"] = os.pathsep.join([root, *kept])
        os.execve(sys.executable,
                  [sys.executable, "-P", "-m", "executor.workers.template", str(chan.fileno()), str(supervisor)], env)
    finally:
        os._exit(127)
