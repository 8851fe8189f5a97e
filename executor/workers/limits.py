"""Applying limits to a worker: the one place rlimits are set (``apply_process_limits`` once per
worker, ``apply_call_limits`` before each call), ``WorkerLimits`` (the limits as plain numbers, as
the far side of the fork holds them: never the pydantic ``protocol.Limits``) and ``TABLE``, every
``Limits`` field with its mechanism and the code that applies it. A fresh worker's hard limits equal
its soft ones (the CPU's one second above); a reused worker keeps soft limits only. The wall-clock
timeout is not an rlimit: the supervisor kills the worker. Why and how: docs/executor.md#limits.
"""

from __future__ import annotations

import math
import resource
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol import Limits

_INF = resource.RLIM_INFINITY
_RLIM_MAX = 2**63 - 1  # setrlimit refuses larger values (OverflowError), which would kill the worker


@dataclass(frozen=True)
class Mechanism:
    """How one ``Limits`` field is enforced: the mechanism, and the function or method (dotted, as
    ``module:qualname``) that applies it."""

    how: str
    where: str


# Every field of ``protocol.Limits`` -> how it is enforced -> where. Each ``where`` names code that
# exists (tests/test_limits_table.py resolves them), and every field has a row. The defaults live only
# in ``protocol.Limits``.
TABLE: dict[str, tuple[Mechanism, ...]] = {
    "timeout_s": (Mechanism("wall clock: the supervisor kills the worker at the call's deadline",
                            "executor.pool:WorkerPool._run_expired"),),
    "cpu_s": (Mechanism("RLIMIT_CPU, soft (SIGXCPU: a timeout) and hard one second above",
                        "executor.workers.limits:apply_call_limits"),),
    "memory_mb": (Mechanism("RLIMIT_DATA", "executor.workers.limits:apply_call_limits"),
                  Mechanism("control group memory.max (v2) or memory.limit_in_bytes (v1), swap off",
                            "executor.workers.cgroups:CgroupSupport.create")),
    "processes": (Mechanism("control group pids.max (where a pids controller is delegated)",
                            "executor.workers.cgroups:CgroupSupport.create"),),
    "open_files": (Mechanism("RLIMIT_NOFILE", "executor.workers.limits:apply_process_limits"),),
    "file_size_mb": (Mechanism("RLIMIT_FSIZE", "executor.workers.limits:apply_process_limits"),),
    "max_output_kb": (Mechanism("output cap: stdout and stderr read up to it, then the worker is killed",
                                "executor.slot:Worker.read_output"),),
    "max_result_kb": (Mechanism("the worker refuses to send a larger value", "executor.workers.worker:_encode_value"),
                      Mechanism("reply cap: a larger frame is cut off before it is read",
                                "executor.workers.channel:reply_cap")),
}


@dataclass(frozen=True)
class WorkerLimits:
    """What the template and its workers apply of a ``protocol.Limits``: ``cpu_s`` is the CPU
    allowance of a call that asks for no timeout of its own (``Limits.effective_cpu_s``)."""

    cpu_s: int
    memory_mb: int
    processes: int
    open_files: int
    file_size_mb: int
    max_result_kb: int

    @classmethod
    def of(cls, limits: Limits) -> WorkerLimits:
        return cls(cpu_s=limits.effective_cpu_s(), memory_mb=limits.memory_mb, processes=limits.processes,
                   open_files=limits.open_files, file_size_mb=limits.file_size_mb, max_result_kb=limits.max_result_kb)

    def to_wire(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> WorkerLimits:
        """From our own supervisor's ``Configure`` (a template's first message, before any tool code
        runs); a field that is not a positive int is a ``ValueError``."""
        names = cls.__dataclass_fields__
        if not isinstance(obj, dict) or set(obj) != set(names):
            raise ValueError(f"limits must be a map of exactly {', '.join(names)}")
        if not all(type(v) is int and v > 0 for v in obj.values()):
            raise ValueError("every limit must be a positive integer")
        return cls(**obj)


def _set(which: int, value: int, hard: bool, slack: int = 0) -> None:
    """Set the soft limit to ``value`` (never above the current hard limit) and, with ``hard``, the
    hard limit to ``value + slack``."""
    _, cur_hard = resource.getrlimit(which)
    value = min(value, _RLIM_MAX)  # a huge (finite) call timeout gives a huge CPU allowance
    if cur_hard != _INF and value > cur_hard:
        value = cur_hard
    new_hard = cur_hard
    if hard:
        new_hard = min(value + slack, _RLIM_MAX)
        if cur_hard != _INF:
            new_hard = min(new_hard, cur_hard)
    resource.setrlimit(which, (value, new_hard))


def apply_process_limits(limits: WorkerLimits, hard: bool = True) -> None:
    """Once per worker: core dumps off, open files, file size."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _set(resource.RLIMIT_NOFILE, limits.open_files, hard)
    _set(resource.RLIMIT_FSIZE, limits.file_size_mb * 1024 * 1024, hard)


def apply_call_limits(limits: WorkerLimits, cpu_s: int, hard: bool = True) -> None:
    """Before a call: ``cpu_s`` CPU seconds and memory. RLIMIT_CPU counts the whole process, so the
    soft limit is the time used so far plus this call's allowance. A fresh worker (``hard``) has used
    only its set-up, well under a second, and its limit is the allowance itself. Rounding that up
    made the limit depend on whether the set-up had reached a millisecond of CPU (the allowance in
    one worker, a second more in the next, under load). A reused worker's time so far is rounded
    up, so each of its calls gets at least its allowance."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    spent = usage.ru_utime + usage.ru_stime
    used = int(spent) if hard else math.ceil(spent)
    _set(resource.RLIMIT_CPU, used + cpu_s, hard, slack=1)
    _set(resource.RLIMIT_DATA, limits.memory_mb * 1024 * 1024, hard)
