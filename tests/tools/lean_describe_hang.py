"""Tools for tests/test_lean_template_redteam.py: a parameter type whose pydantic schema hook runs
only where the tool is described (the template's describe child, ``executor.workers.template._describe``),
never at import: there it leaves ``describing`` (its pid) in the working directory and never returns
(bounded at 60 s, past any bound the test sets)."""

from __future__ import annotations

import os
import time
from typing import Any

from executor import tool


class Stuck:
    """An annotation whose schema never comes."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        with open("describing", "a") as f:
            f.write(f"{os.getpid()}\n")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("gave up hanging")


@tool
def hang(x: Stuck) -> None:
    """Never described."""
