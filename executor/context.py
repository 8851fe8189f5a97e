"""What a tool may ask about the place it runs in."""

from __future__ import annotations

import os
from pathlib import Path

WORKSPACE_ENV = "CIAYN_WORKSPACE"


def workspace() -> Path:
    """The workspace root given to ``ciayn-executor serve --workspace`` (default: its working
    directory). Tools that touch files confine themselves to it."""
    return Path(os.environ.get(WORKSPACE_ENV) or os.getcwd()).resolve()
