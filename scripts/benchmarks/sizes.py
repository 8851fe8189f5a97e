"""How much each benchmark does: ``FULL`` for ``scripts/bench`` (under 5 minutes on 2 cores, set-up
included), ``TINY`` for the test suite (every code path, numbers meaningless)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    rounds: int  # interleaved rounds of the round-trip figure
    block_s: float  # seconds each contestant gets per round (its block is sized from a warm-up)
    max_block: int  # ... but at most this many calls
    path_rounds: int  # interleaved rounds of the call-path breakdown
    path_block_s: float
    microbench_repeat: int  # timed batches per codec step / CIAYN stage
    crash_rounds: int  # crash -> next call rounds
    kernel_restarts: int  # Jupyter restart-and-answer rounds
    hung_calls: int  # hung calls for the timeout distribution
    hung_timeout_s: float
    pool_workers: tuple[int, ...]
    pool_controllers: tuple[int, ...]
    pool_window_s: float  # measured seconds per pool point
    pool_warmup_s: float
    memory_calls: int

    def block(self, per_call_s: float) -> int:
        """Calls in one block of a contestant that takes ``per_call_s`` per call."""
        return max(1, min(self.max_block, int(self.block_s / max(per_call_s, 1e-9))))


FULL = Sizes(rounds=16, block_s=0.12, max_block=200, path_rounds=10, path_block_s=0.12, microbench_repeat=60,
             crash_rounds=20, kernel_restarts=3, hung_calls=30, hung_timeout_s=0.2, pool_workers=(1, 2, 4, 8, 16),
             pool_controllers=(1, 4, 8), pool_window_s=0.4, pool_warmup_s=0.15, memory_calls=300)

TINY = Sizes(rounds=2, block_s=0.01, max_block=10, path_rounds=2, path_block_s=0.01, microbench_repeat=3,
             crash_rounds=2, kernel_restarts=1, hung_calls=2, hung_timeout_s=0.2, pool_workers=(1, 2),
             pool_controllers=(1, 2), pool_window_s=0.1, pool_warmup_s=0.05, memory_calls=20)
