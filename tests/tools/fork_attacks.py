"""Tools for tests/test_fork_redteam.py: attacks on the template's bare ``fork()``
(``executor.workers.quickfork``), on the rights it drops before importing tool modules, and on what a call
can do with the rights it keeps. Each tool returns what it saw, so the test judges from outside.

At import this module does two things in the template, as libraries do:

- a thread not started by ``threading`` (a C library's callback thread, here ``_thread``) asks
  ``threading.current_thread()`` (logging does, for ``threadName``) and ends: ``threading`` keeps a
  ``_DummyThread`` for it, which only ``os.fork()``'s after-fork hook clears;
- a background "warm-up" thread, still running when the import returns, registers an after-fork
  hook once the import is over (a lazily imported dependency that reseeds its generator, say) and
  ends: ``quickfork.watch_hooks`` was watching only while the module was imported.
"""

from __future__ import annotations

import _thread
import ctypes
import os
import subprocess
import sys
import threading
import time
from typing import Any

from executor import tool

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NAME = 15
CLONE_NEWUSER = 0x10000000
PTRACE_ATTACH = 16

# ---------------------------------------------------------------- an after-fork hook registered after import

_HOOK: dict[str, Any] = {"registered": False, "child": 0}


_IMPORTED = threading.Event()  # set as this module's import ends


def _warm_up() -> None:
    _IMPORTED.wait(20)  # the import (and load_tools, which an early watch of hooks covered) ends first
    time.sleep(0.2)  # (an attack's delay, not a wait for a condition)
    os.register_at_fork(after_in_child=lambda: _HOOK.update(child=os.getpid()))
    _HOOK["registered"] = True


threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()


# ---------------------------------------------------------------- a foreign thread, ended at import
# (after the warm-up thread started: a thread made later could get the same ident, and its entry
# in threading._active would replace the dummy's)

_foreign_done = _thread.allocate_lock()
_foreign_done.acquire()


def _foreign() -> None:
    threading.current_thread()  # registers a _DummyThread for this (non-threading) thread
    _foreign_done.release()


_thread.start_new_thread(_foreign, ())
_foreign_done.acquire(timeout=10)


@tool
def late_hook() -> dict[str, Any]:
    """Whether the hook registered after import had been registered before this worker was forked,
    and whether it ran in this worker."""
    return {"registered": _HOOK["registered"], "ran": _HOOK["child"] == os.getpid(), "bare": _bare()}


# ---------------------------------------------------------------- threading state of a worker


_LIMBO_LOCK = threading._active_limbo_lock  # type: ignore[attr-defined]


def _bare() -> bool:
    """Whether this worker came from the bare fork: ``os.fork()`` runs ``threading._after_fork``,
    which replaces ``threading._active_limbo_lock`` with a new lock."""
    return threading._active_limbo_lock is _LIMBO_LOCK  # type: ignore[attr-defined]


@tool
def threading_state() -> dict[str, Any]:
    """What this worker's ``threading`` module believes, against what the kernel says."""
    main = threading.main_thread()
    return {"names": sorted(t.name for t in threading.enumerate()),
            "dummies": sum(isinstance(t, threading._DummyThread) for t in threading.enumerate()),  # type: ignore[attr-defined]
            "main_is_current": threading.current_thread() is main,
            "tasks": len(os.listdir("/proc/self/task")), "bare": _bare()}


# ---------------------------------------------------------------- process accounting (CAP_SYS_PACCT)


@tool
def acct_on(path: str) -> str:
    """Turn BSD process accounting on for this PID namespace (the template's: every later worker's),
    writing to ``path``. Returns "" or the error."""
    open(path, "ab").close()
    if _libc.acct(os.fsencode(path)) != 0:
        return os.strerror(ctypes.get_errno())
    return ""


@tool
def acct_off() -> str:
    return "" if _libc.acct(None) == 0 else os.strerror(ctypes.get_errno())


@tool
def name_a_process(name: str) -> int:
    """The victim: a call whose tool runs a short-lived process named ``name`` (a command name
    holding something of the call: a file, a customer, a token)."""
    pid = os.fork()
    if pid == 0:
        _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@tool
def read_acct(path: str) -> list[str]:
    """The command names in an accounting file (acct_v3 records: 64 bytes, ``ac_comm`` at 48)."""
    with open(path, "rb") as f:
        data = f.read()
    return [data[i + 48:i + 64].split(b"\0", 1)[0].decode(errors="replace") for i in range(0, len(data) - 63, 64)]


# ---------------------------------------------------------------- capabilities


def _status_caps(text: str) -> dict[str, int]:
    return {line.split(":")[0]: int(line.split()[1], 16) for line in text.splitlines()
            if line.startswith(("CapEff:", "CapPrm:", "CapBnd:", "CapInh:", "CapAmb:"))}


@tool
def exec_caps() -> dict[str, int]:
    """The capabilities of a program this call execs as root (the kernel gives root all of its
    bounding set back at exec)."""
    out = subprocess.run(["/bin/cat", "/proc/self/status"], capture_output=True, text=True, timeout=10, check=True)
    return _status_caps(out.stdout)


@tool
def user_namespace_reach() -> dict[str, Any]:
    """In a child: make a user namespace (full capabilities *in it*), then try to reach the template
    (PID 1 here) with them: ptrace it, open its memory."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        seen: dict[str, Any] = {}
        seen["unshare"] = os.strerror(ctypes.get_errno()) if _libc.unshare(CLONE_NEWUSER) != 0 else ""
        with open("/proc/self/status") as f:
            seen["caps"] = _status_caps(f.read())
        seen["ptrace"] = (os.strerror(ctypes.get_errno()) if _libc.ptrace(PTRACE_ATTACH, 1, None, None) != 0
                          else "attached")
        try:
            with open("/proc/1/mem", "rb"):
                seen["mem"] = "opened"
        except OSError as e:
            seen["mem"] = e.strerror
        os.write(w, repr(seen).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    import ast

    result: dict[str, Any] = ast.literal_eval(data.decode())
    return result


@tool
def plant(path: str, text: str) -> str:
    """Append ``text`` to the file at ``path``, as the user the executor runs as (root: any file)."""
    with open(path, "a") as f:
        f.write(text)
    return path


@tool
def executor_source() -> str:
    """Where this worker's ``executor`` package was imported from."""
    return os.path.dirname(sys.modules["executor"].__file__ or "")


@tool
def whoami() -> int:
    return os.getpid()


_IMPORTED.set()
