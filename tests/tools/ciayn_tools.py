"""Tools for the CIAYN loop tests. They run in the executor's workers, never in the test process:
side effects go to files in the workspace, so a test can prove where and in which order calls ran."""

# No ``from __future__ import annotations``: the signatures shown to the model stay plain.

import os
import signal
import time

from executor import signals, tool, workspace


def _log(line: str) -> None:
    with open(workspace() / "calls.log", "a", encoding="utf-8") as f:
        f.write(line + "\n")


@tool(bundleable=True)
def append_line(text: str) -> str:
    """Append one line to calls.log in the workspace; return the worker's pid and the line."""
    _log(text)
    return f"appended {text!r} in pid {os.getpid()}"


@tool(no_repeat=True)
def lookup(key: str) -> str:
    """Look a key up (a no-repeat tool)."""
    _log(f"lookup {key}")
    return f"value of {key}"


@tool(no_repeat=True)
def flaky_lookup(key: str) -> str:
    """Look a key up; the first call for a key crashes its worker (os._exit), later calls work."""
    marker = workspace() / f"flaky-{key}"
    if not marker.exists():
        marker.write_text("crashed once")
        os._exit(3)
    _log(f"flaky_lookup {key}")
    return f"value of {key}"


@tool(timeout=1)
def nap(seconds: float) -> str:
    """Sleep for some seconds (this tool's time limit is 1 s)."""
    time.sleep(seconds)
    return "rested"


@tool(timeout=120)
def slow(seconds: float) -> str:
    """Log 'slow started', sleep, then log 'slow finished' (for Ctrl-C tests: a long call)."""
    _log("slow started")
    time.sleep(seconds)
    _log("slow finished")
    return "slept"


@tool
def repr_only() -> object:
    """Return an object that is not plain data (it comes back as its repr)."""
    return {1, 2, 3}


@tool
def typed(count: int, name: str = "x") -> str:
    """Take an int and a str."""
    return f"{name} x{count}"


@tool
def tick() -> int:
    """Count this call in ticks.log in the workspace; return how many calls there have been."""
    path = workspace() / "ticks.log"
    with open(path, "a", encoding="utf-8") as f:
        f.write("tick\n")
    return len(path.read_text().splitlines())


@tool(no_repeat=True)
def deploy(target: str, count: int = 1) -> str:
    """Deploy (a no-repeat tool with a default argument)."""
    _log(f"deploy {target} {count}")
    return f"deployed {target} x{count}"


@tool
def env_value(name: str) -> str:
    """The value of an environment variable in the worker, or '(unset)'."""
    return os.environ.get(name, "(unset)")


@tool
def same() -> str:
    """Return the same text every time."""
    return "the same"


@tool
def segfault() -> None:
    """Kill this worker with SIGSEGV."""
    os.kill(os.getpid(), signal.SIGSEGV)


@tool
def remember(value: str) -> str:
    """Keep a value in the worker's memory (lost when the worker is replaced)."""
    global _memory
    _memory = value
    return "remembered"


_memory = ""


@tool
def recall() -> str:
    """The value kept by remember(), or '' after the worker was replaced."""
    return _memory


@tool
def fail(message: str) -> None:
    """Raise a ValueError with the message."""
    raise ValueError(message)


@tool(bundleable=True)
def tell(text: str) -> str:
    """Send a note to the user."""
    signals.note(text)
    return "told"


@tool
def complete_task(summary: str) -> str:
    """Report the task done, with a one-line summary."""
    _log(f"complete {summary}")
    signals.complete(summary)
    return "ok"


@tool
def give_up(reason: str) -> str:
    """Stop the run without success."""
    signals.exit(reason)
    return "stopping"
