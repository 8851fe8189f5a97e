"""``CiaynError``: the one base of every public exception of ciayn-sandbox.

Each error a user can meet, from either side (a rejected call text, a bad frame, an executor that
cannot start or cannot be reached, a model that fails, a bad setting), is a ``CiaynError``, so a
program that embeds the controller or the executor can catch the project's own errors in one
``except`` and let everything else (bugs) through. Each subclass also keeps the built-in base it had
(``ValueError``, ``RuntimeError``), so existing ``except ValueError`` code is unchanged. Errors of
the internal channels between our own processes are not public and do not derive from it.
"""

from __future__ import annotations


class CiaynError(Exception):
    """Base of every public exception of ciayn-sandbox (``protocol``, ``executor``, ``controller``)."""


class BindError(CiaynError, ValueError):
    """Arguments that do not fit a tool's signature; the message names the parameter (defined here,
    with no pydantic, for the executor's workers: ``protocol.spec`` raises it)."""
