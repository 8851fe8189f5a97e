"""Where the harness and its results are, and how a benchmark starts another module of this package
as its own process: ``python -m scripts.benchmarks.NAME`` run from the project root, so that the
child imports this tree's packages as the parent does and nothing edits ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the project root: every command of this package runs from here
RESULTS = ROOT / "bench-results"
PACKAGE = __package__ or "scripts.benchmarks"


def module_command(name: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command that runs module ``name`` of this package; start it with ``cwd=ROOT``."""
    return [python, "-m", f"{PACKAGE}.{name}", *args]
