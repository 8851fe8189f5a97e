"""Tools for tests/test_replacement_redteam.py: the first import is honest; every later one (a
replacement template) writes on the template's channel the header of a 4096-byte frame, then one
byte of it every 0.1 s (at most 30 s), leaving ``trickling`` in the working directory first."""

from __future__ import annotations

import os
import sys

from executor import tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # template_channel.py, beside this file
from template_channel import trickle

with open("imports", "a") as _f:
    _f.write(f"{os.getpid()}\n")
with open("imports") as _f:
    _number = len(_f.read().split())


if _number >= 2:
    trickle("trickling", seconds=30, every=0.1)


@tool
def echo(x: int) -> int:
    """Return ``x``."""
    return x
