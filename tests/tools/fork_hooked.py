"""Tools for tests/test_quickfork.py: a tool module that registers an after-fork hook at import, as
libraries holding connections or seeds do."""

from __future__ import annotations

import os

from executor import tool

_SEEN: dict[str, int] = {}
os.register_at_fork(after_in_child=lambda: _SEEN.update(child=os.getpid()))


@tool
def hook_ran() -> bool:
    """Whether the after-fork hook ran in this very process."""
    return _SEEN.get("child") == os.getpid()
