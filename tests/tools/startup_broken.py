"""Tools for tests/test_startup_redteam.py: this module cannot be imported (it raises at import,
after leaving ``importing`` in the working directory, the executor's workspace)."""

from __future__ import annotations

import os

from executor import tool

with open("importing", "a") as _f:
    _f.write(f"{os.getpid()}\n")

raise RuntimeError("startup_broken refuses to be imported (marker 7c1f)")


@tool
def never() -> None:
    """Never served."""
