"""Applying a ``Limits`` value to a worker: the one place rlimits are set.

Limits arrive as one ``protocol.Limits`` value, built from the command line defaults, a tool's own
timeout and a call's own timeout (``effective_limits``). In the worker, per-process limits (open
files, file size, core dumps) are set once at start, and per-call limits (CPU seconds, memory) before
each call. The wall-clock timeout is not an rlimit: the supervisor enforces it by killing the worker.

Memory uses ``RLIMIT_DATA`` rather than ``RLIMIT_AS``: address-space limits count glibc's 64 MiB
malloc arenas and thread stacks and break threaded tools at sizes where they use little memory.
"""

from __future__ import annotations

import math
import resource

from protocol import Call, Limits, ToolSpec

_INF = resource.RLIM_INFINITY
_RLIM_MAX = 2**63 - 1  # setrlimit refuses larger values (OverflowError), which would kill the worker


def effective_limits(defaults: Limits, spec: ToolSpec | None, call: Call | None) -> Limits:
    """Command-line defaults, overridden by the tool's timeout, overridden by the call's timeout.
    A timeout that is not a positive finite number (inf, nan, 0) overrides nothing: every call has a
    deadline."""
    timeout = defaults.timeout_s
    if spec is not None and spec.timeout is not None and _usable(spec.timeout):
        timeout = spec.timeout
    if call is not None and call.timeout is not None and _usable(call.timeout):
        timeout = call.timeout
    if timeout == defaults.timeout_s:
        return defaults
    return defaults.model_copy(update={"timeout_s": float(timeout)})


def _usable(timeout: float) -> bool:
    return math.isfinite(timeout) and timeout > 0


def _soft(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    value = min(value, _RLIM_MAX)  # a huge (finite) call timeout gives a huge CPU allowance
    if hard != _INF and value > hard:
        value = hard
    resource.setrlimit(which, (value, hard))


def apply_process_limits(limits: Limits) -> None:
    """Once per worker: core dumps off, open files, file size."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _soft(resource.RLIMIT_NOFILE, limits.open_files)
    _soft(resource.RLIMIT_FSIZE, limits.file_size_mb * 1024 * 1024)


def apply_call_limits(limits: Limits) -> None:
    """Before each call: CPU seconds (counted from now; the worker's CPU time accumulates across
    calls, so the soft limit is set to the time used so far plus this call's allowance) and memory."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = int(usage.ru_utime + usage.ru_stime + 0.999)
    _soft(resource.RLIMIT_CPU, used + limits.effective_cpu_s())
    _soft(resource.RLIMIT_DATA, limits.memory_mb * 1024 * 1024)
