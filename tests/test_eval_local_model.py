"""scripts/eval_local_model.py's generated wordings: seeded, varied, and checked soundly.

No model is needed: each generated case's own check is run on the outcome a right run would have
(it must pass) and on wrong ones (a wrong answer, an answer naming another candidate too, a run
that did not complete, a write shape completed with nothing written: each must fail), so the
eval's figures measure the model, not a lenient or broken check.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.events import Finished

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "eval_local_model.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("eval_local_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["eval_local_model"] = module
    spec.loader.exec_module(module)
    return module


ev = _load()
CASES = 20


def finished(summary: str, status: str = "completed") -> Finished:
    return Finished(status=status, reason="", summary=summary)  # type: ignore[arg-type]


def workspace(tmp_path: Path, case: Any) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    ev.fill_workspace(ws, case.files)
    return ws


def test_the_same_seed_gives_the_same_cases_and_another_seed_others() -> None:
    for shape in ev.SHAPES:
        one, again, other = ev.generate(shape, 1, CASES), ev.generate(shape, 1, CASES), ev.generate(shape, 2, CASES)
        assert [(c.task, c.files) for c in one] == [(c.task, c.files) for c in again]
        assert [c.task for c in one] != [c.task for c in other]


@pytest.mark.parametrize("shape", ev.SHAPES)
def test_a_shape_draws_many_wordings_names_and_answers(shape: str) -> None:
    cases = ev.generate(shape, 7, CASES)
    assert len({c.template for c in cases}) >= 4, "templates"
    assert len({(c.task, tuple(c.files)) for c in cases}) == CASES
    assert len({c.task for c in cases}) >= CASES * 3 // 4
    assert len({c.answer for c in cases}) >= CASES // 3
    for case in cases:
        names = list(case.files)
        assert len(names) == len(set(names)) and case.writes not in case.files


@pytest.mark.parametrize("shape", ev.SHAPES)
def test_every_case_passes_its_right_outcome_and_fails_wrong_ones(shape: str, tmp_path: Path) -> None:
    for case in ev.generate(shape, 3, CASES):
        ws = workspace(tmp_path, case)
        if case.writes is not None:
            assert not case.check(finished("done"), ws), "completed with nothing written"
            (ws / case.writes).write_text(case.answer + "\n")
            assert case.check(finished("done"), ws), case
            assert not case.check(finished("done", "stopped"), ws)
            (ws / case.writes).write_text("something else entirely\n")
            assert not case.check(finished("done"), ws), case
            continue
        assert case.check(finished(case.answer), ws), case
        assert not case.check(finished(case.answer, "stopped"), ws)
        assert not case.check(finished("I could not find it."), ws)
        every = " ".join(case.files) + " " + " ".join(case.files.values())
        if shape in ("which-file", "read-line", "find-value"):  # naming every candidate is no answer
            assert not case.check(finished(every), ws), case


def test_the_wilson_interval() -> None:
    assert ev.wilson(7, 10) == (0.397, 0.892)
    assert ev.wilson(0, 10) == (0.0, 0.278)
    assert ev.wilson(10, 10) == (0.722, 1.0)
