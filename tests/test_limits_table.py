"""The limits table (``executor.workers.limits.TABLE``) covers every field of ``protocol.Limits``
and names code that exists, so it cannot silently fall behind a new limit or a moved function."""

from __future__ import annotations

import importlib

import pytest

from executor.workers.limits import TABLE
from protocol import Limits


def _resolve(where: str) -> object:
    """The object a row's ``module:qualname`` names."""
    module, _, qualname = where.partition(":")
    target: object = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def test_every_limit_has_a_row_and_every_row_a_limit() -> None:
    assert set(TABLE) == set(Limits.model_fields)
    assert all(TABLE[name] for name in TABLE), "a limit with no mechanism"


@pytest.mark.parametrize("where", sorted({m.where for rows in TABLE.values() for m in rows}))
def test_each_row_names_code_that_exists(where: str) -> None:
    assert callable(_resolve(where)), where


@pytest.mark.parametrize("where", ["executor.workers.limits:apply_limits_gone", "executor.nowhere:f",
                                   "executor.slot:Worker.read_nothing"])
def test_a_row_naming_missing_code_is_caught(where: str) -> None:
    with pytest.raises((AttributeError, ImportError)):
        _resolve(where)
