"""An exercise checked in the notebook's own process: no ranks to launch, because what it judges is arithmetic.

``exercises.check`` runs a ``LocalExercise``'s ``judge`` on the learner's function directly; the judge returns
what is wrong (None: nothing) and the exercise's ``summary`` says what was verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtlab.exercises._check import CheckResult

__all__ = ["LocalExercise"]


@dataclass(frozen=True)
class LocalExercise:
    """One exercise whose function runs here, once per test case: ``judge(fn)`` says what is wrong or None."""

    name: str
    description: str
    judge: Callable[[Callable[..., Any]], str | None]
    summary: str
    solution: Callable[..., Any]
    stub: Callable[..., Any]
    hints: tuple[str, str, str] = ("", "", "")

    def run(self, fn: Callable[..., Any]) -> CheckResult:
        problem = self.judge(fn)
        return CheckResult(self.name, problem is None, problem or self.summary)
