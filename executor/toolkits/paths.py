"""Confining file tools to the workspace.

A path from the model is taken relative to ``executor.context.workspace()`` (read at call time), fully
resolved (every symlink followed, dangling ones too), and accepted only if the result lies inside the
resolved workspace. Tools then open the *resolved* path, so a symlink anywhere in what the model wrote
(the file itself, or a parent directory) cannot lead outside. What remains is the race of a symlink
swapped in between the check and the open; ``open_confined`` refuses a symlink as the last component,
and the worker's own isolation (the hardened profile) is the boundary for the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

from executor.context import workspace


def confine(path: str) -> Path:
    """The resolved absolute form of ``path``, or ``PermissionError`` if it lies outside the workspace."""
    if "\0" in path:
        raise ValueError(f"path {path!r} contains a NUL character; give a plain file path")
    root = workspace()
    target = Path(os.path.realpath(root / path))  # an absolute ``path`` replaces ``root`` here
    # realpath leaves a looping symlink unresolved (some Python versions also keep the ".." after it)
    if ".." in target.parts or target.is_symlink():
        raise OSError(f"path {path!r} goes through a symlink loop; it cannot be used")
    if not target.is_relative_to(root):
        raise PermissionError(
            f"path {path!r} is outside the workspace {root}; use a path inside it "
            "(relative paths are relative to the workspace)"
        )
    return target


def shown(target: Path) -> str:
    """How a confined path is named back to the model: relative to the workspace."""
    rel = target.relative_to(workspace())
    return str(rel) if rel.parts else "."


def open_confined(target: Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` a path that ``confine`` returned, refusing a symlink swapped in since then."""
    try:
        return os.open(target, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError:
        if target.is_symlink():
            raise PermissionError(
                f"{shown(target)!r} became a symlink while it was being opened; refusing to follow it"
            ) from None
        raise
