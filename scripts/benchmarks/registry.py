"""The figures of the benchmark harness, discovered the way asv and pyperf find benchmarks: a module
of this package declares each figure it measures with ``@figure(...)`` on the function that measures
it, and ``discover()`` imports every module of the package and returns what they declared, in report
order. The runner's ``--only``, ``--list`` and ``--help``, the charts and tables of the report and
the harness's test all read this one registry: no figure is listed by hand anywhere else.

A figure's function takes the run's ``Context`` and returns one entry of ``results.json``
(``record.measured``, ``record.not_built`` or ``record.failed``). Its ``chart`` draws the entry on a
matplotlib figure, its ``table`` writes the entry's markdown lines (both in ``report``)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .features import Features
from .sizes import TINY, Sizes

Entry = dict[str, Any]


@dataclass(frozen=True)
class Context:
    """What every figure of one run gets: the tree's features, the size, a scratch directory, the
    output directory."""

    features: Features
    sizes: Sizes
    tmp: str
    out: Path

    @property
    def tiny(self) -> bool:
        return self.sizes is TINY


Measure = Callable[[Context], Entry]


@dataclass(frozen=True)
class Figure:
    name: str  # its key in results.json, its chart's file name, what --only takes
    measures: str  # one line for --help and --list
    run: Measure
    order: int  # where it stands in the run and the report (ascending)
    chart: Callable[[Any, Entry], None] | None = None  # (matplotlib figure, entry)
    table: Callable[[Entry], list[str]] | None = None  # markdown lines; None: status line only


_FIGURES: dict[str, Figure] = {}


def figure(name: str, measures: str, *, order: int, chart: Callable[[Any, Entry], None] | None = None,
           table: Callable[[Entry], list[str]] | None = None) -> Callable[[Measure], Measure]:
    """Declare the decorated function as the one that measures figure ``name``."""

    def register(run: Measure) -> Measure:
        other = _FIGURES.get(name)
        if other is not None and other.run.__qualname__ != run.__qualname__:
            raise ValueError(f"two figures are named {name!r}: {other.run.__module__}.{other.run.__qualname__} "
                             f"and {run.__module__}.{run.__qualname__}")
        _FIGURES[name] = Figure(name, measures, run, order, chart, table)
        return run

    return register


def discover() -> list[Figure]:
    """Import every module of this package (but ``__main__`` and private ones) and return the figures
    they declare, in order."""
    package = importlib.import_module(__package__ or "scripts.benchmarks")
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
    return sorted(_FIGURES.values(), key=lambda f: (f.order, f.name))
