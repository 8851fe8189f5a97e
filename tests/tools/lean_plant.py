"""Tools for tests/test_lean_template_redteam.py: write a file in the workspace (the worker's working
directory), as any file tool lets a model do, and say which process runs the call."""

from __future__ import annotations

import os

from executor import tool


@tool
def write_here(name: str, text: str) -> int:
    """Write ``text`` to ``name`` in the working directory; the bytes written."""
    with open(name, "w") as f:
        return f.write(text)


@tool
def whoami() -> int:
    """The worker's pid."""
    return os.getpid()
