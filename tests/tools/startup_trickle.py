"""Tools for tests/test_startup_redteam.py: at import this module writes on the template's channel
the header of a frame of 4096 bytes, then one byte of it every 0.2 s (at most 60 s in all), so
the supervisor, reading the template's first message, always has had a byte lately but never a
whole message. ``trickling`` in the working directory says it began."""

from __future__ import annotations

import os
import sys

from executor import tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import trickle

trickle("trickling", seconds=60, every=0.2)


@tool
def never() -> None:
    """Never served."""
