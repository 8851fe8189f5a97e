"""Shared by the control-group tool modules (``cgroup_reuse.py``, ``group_reuse_attacks.py``): the
groups of ours the calling worker is in. Not a tool module itself. A tool module loaded by path finds
this file beside it with::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from own_groups import own_groups
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V2_ROOT = ROOT / "unified" if (ROOT / "unified" / "cgroup.procs").exists() else ROOT


def own_groups() -> dict[str, Path]:
    """This process's groups of ours, by hierarchy ("memory", "pids", "" for v2)."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "/ciayn-" not in path:
            continue
        for name in controllers.split(",") if controllers else [""]:
            found[name] = (ROOT / name if name else V2_ROOT) / path.lstrip("/")
    return found
