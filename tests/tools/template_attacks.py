"""Tools that attack a replacement template (``executor.workers.template``: a fresh interpreter started when a
tool killed the first one) and the worker's new plumbing (``procfs.dying``, the template-made std
files, bare cgroup writes). Each returns what it saw or did so the test can judge from outside."""

from __future__ import annotations

import ctypes
import difflib  # a diff tool's import: not loaded by the template before the tool modules
import os
import resource
import signal
import sys
from typing import Any

from executor import tool

_libc = ctypes.CDLL(None, use_errno=True)
PR_GET_DUMPABLE = 3
STATUS_KEYS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "SigBlk", "SigIgn",
               "Umask")
RLIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}


def _status(pid: str) -> dict[str, str]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in STATUS_KEYS:
                    out[key] = value.strip()
    except OSError as e:
        out["error"] = str(e)
    return out


def _fds() -> list[str]:
    found = []
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            found.append(f"{name}->{os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:
            continue
    return found


def _norm(text: str) -> str:
    """A descriptor's target without the inode number (pipes, sockets)."""
    return text.split("[", 1)[0] if "[" in text else text


@tool
def probe() -> dict[str, Any]:
    """The worker's (and its template's) process state that a replacement template must give its
    workers exactly as the first one did."""
    ppid = os.getppid()
    with open("/proc/self/cgroup") as f:
        cgroup = sorted(line.split(":", 2)[1] + ":" + ("ciayn" if "ciayn-" in line else line.split(":", 2)[2].strip())
                        for line in f)
    try:
        with open("/proc/self/oom_score_adj") as f:
            oom = f.read().strip()
    except OSError:
        oom = "?"
    return {
        "environ": sorted(os.environ),
        "rlimits": {name: list(resource.getrlimit(which)) for name, which in RLIMITS.items()},
        "status": _status("self"),
        "template_status": _status(str(ppid)),
        "dumpable": _libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0),
        "fds": [_norm(fd) for fd in _fds()],
        "cwd": os.getcwd(),
        "nice": os.nice(0),
        "oom_score_adj": oom,
        "affinity": sorted(os.sched_getaffinity(0)),
        "cgroup": cgroup,
        "sys_path": list(sys.path),
        "flags": [sys.flags.isolated, sys.flags.ignore_environment, sys.flags.safe_path, sys.flags.dont_write_bytecode,
                  sys.flags.utf8_mode, sys.flags.optimize, sys.flags.hash_randomization],
        "stdout": [sys.stdout.encoding, sys.stdout.errors, sys.stdout.line_buffering],
        "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                                                 signal.SIGXFSZ, signal.SIGCHLD, signal.SIGHUP,
                                                                 signal.SIGUSR1, signal.SIGQUIT)},
        "recursion": sys.getrecursionlimit(),
        "switch": sys.getswitchinterval(),
    }


@tool
def template_pid() -> str:
    """Which template forked this worker: its PID namespace (one per template where the machine
    allows) and its parent's pid, as this worker sees them."""
    return f"{os.readlink('/proc/self/ns/pid')}:{os.getppid()}"


@tool
def echo(value: object = None) -> object:
    """Return the value given (the innocent call)."""
    return value


@tool
def unflushed(text: str = "LEAK") -> str:
    """Write to stdout without a newline (not flushed by line buffering), ending with a lone surrogate
    (undecodable: a file name's escaped byte), and return."""
    sys.stdout.write(text + "\udcff")
    return "wrote"


@tool
def buffered_then_die(text: str = "LEAK") -> None:
    """Write to stdout and stderr without a newline, then die without flushing."""
    sys.stdout.write(text)
    sys.stderr.write(text)
    os._exit(3)


@tool
def plant(name: str, text: str) -> str:
    """Write ``text`` to ``name`` in the working directory (the workspace): a file tool's plain write."""
    with open(name, "w") as f:
        f.write(text)
    return os.path.abspath(name)


@tool
def diff(a: str, b: str) -> str:
    """A unified diff of two texts (the honest use of this module's difflib import)."""
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True)))


@tool
def poison_open_files() -> int:
    """In a reused worker: leave RLIMIT_NOFILE's soft limit at 3 (stdin, stdout, stderr are open), so
    the worker cannot open /proc/<template>/stat before its next call: ``procfs.dying`` says True."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
    return os.getpid()


@tool
def whoami() -> dict[str, int]:
    """This worker's pid and its parent's."""
    return {"pid": os.getpid(), "ppid": os.getppid()}
