"""Tools for tests/test_quickfork.py: a tool module that leaves a thread running in the template
(started at import, as some client libraries do)."""

from __future__ import annotations

import threading
import time

from executor import tool


def _spin() -> None:
    while True:
        time.sleep(0.005)


threading.Thread(target=_spin, name="left-by-import", daemon=True).start()


@tool
def thread_names() -> list[str]:
    """The threads this worker's ``threading`` module lists."""
    return sorted(t.name for t in threading.enumerate())
