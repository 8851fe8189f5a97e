"""The environment a tool sees: an allowlist, shared by the executor and the controllers that start one.

Tools run code that may be hostile, so they get only what a program needs to behave (``PATH``,
``HOME``, locale, time zone, ``TMPDIR``) plus what the operator hands on by name on purpose
(``--pass-env NAME``, or ``--pass-env 'PREFIX_*'`` for a prefix). API keys and tokens of the agent's
process never reach a tool otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

ALWAYS = ("PATH", "HOME", "LANG", "TZ", "TMPDIR")
ALWAYS_PREFIXES = ("LC_",)
_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")


def check_pass_env(patterns: Iterable[str]) -> list[str]:
    """Validate ``--pass-env`` values: a variable name, or a name prefix ending in ``*``."""
    out = []
    for p in patterns:
        if not _PATTERN.fullmatch(p):
            raise ValueError(f"--pass-env {p!r}: give a variable name (API_KEY) or a prefix ending in * (AWS_*)")
        out.append(p)
    return out


def allowed_environment(environ: Mapping[str, str], pass_env: Iterable[str] = ()) -> dict[str, str]:
    """The part of ``environ`` a tool may see."""
    names = set(ALWAYS)
    prefixes = list(ALWAYS_PREFIXES)
    for p in pass_env:
        if p.endswith("*"):
            prefixes.append(p[:-1])
        else:
            names.add(p)
    return {k: v for k, v in environ.items() if k in names or any(k.startswith(x) for x in prefixes)}
