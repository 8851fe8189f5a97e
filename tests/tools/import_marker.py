"""Tools for tests/test_template_fork.py: importing this module leaves a file in the working
directory (the executor's workspace), so a test can tell whether a template ever imported it."""

from __future__ import annotations

import os

from executor import tool

with open("imported-by", "a") as f:
    f.write(f"{os.getpid()}\n")


@tool
def present() -> bool:
    """Whether the mark is there."""
    return os.path.exists("imported-by")
