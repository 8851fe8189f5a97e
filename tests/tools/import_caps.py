"""Tools for tests/test_template_fork.py: the capabilities a tool module holds while it is imported
(in the template) and while a call runs (in a worker)."""

from __future__ import annotations

from executor import tool


def _cap_eff() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return -1


AT_IMPORT = _cap_eff()


@tool
def caps() -> dict[str, int]:
    """Effective capability masks: at this module's import and now."""
    return {"import": AT_IMPORT, "call": _cap_eff()}
