"""Rows of the reliability report (tests/reliability/conftest.py prints and writes it)."""

from __future__ import annotations

import os

import attrs

AREAS = ("Load", "Faults", "Bad input", "Security")
SIZE = int(os.environ.get("ORCHESTRION_LOAD_REQUESTS", "3000"))
"""Requests per load test: a CI-sized default; ``ORCHESTRION_LOAD_REQUESTS=20000`` for the
full size the reliability report is made with."""


def examples(base: int) -> int:
    """Hypothesis examples for a fuzz test: ``base`` at CI size, more at the full size."""
    return base * max(1, SIZE // 3000)


@attrs.define
class Trial:
    """One row of the report."""

    area: str
    tried: str
    amount: str
    happened: str
    test: str
    outcome: str = "not run"


TRIALS: list[Trial] = []


def record(area: str, tried: str, amount: str, happened: str) -> None:
    """A row of the report for the running test: what it ``tried``, the ``amount`` of it and
    what ``happened``. Recording the same ``tried`` again (a Hypothesis test counting its
    examples) replaces the row."""
    assert area in AREAS, area
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    for trial in TRIALS:
        if trial.test == test and trial.tried == tried:
            trial.amount, trial.happened = amount, happened
            return
    TRIALS.append(Trial(area, tried, amount, happened, test))
