"""The constants fitted to published runs, and the validation that predicts each source with them refitted without it.

``roofline.devices.SUSTAINED`` holds one constant per die (A100; H100, which the H200 shares). ``fit``
fits them on a table of runs: for each die, the value at which the weighted median of the signed errors
of that die's scored rows is zero, each source's rows weighing 1/n (n: that source's rows on the die), so
that one long table does not outvote the others. The rule was set before any error was looked at and is not
tuned to a target. A larger value predicts every run faster, so the error rises with it: bisection finds it.

Two validations, labelled apart wherever they are shown:

* ``out_of_sample`` (the headline): leave one source out. For each source, every die's constant is
  refitted on every other source's rows, and that source's rows are predicted with those constants: no row
  is predicted by a constant it helped to fit. A die with no row left once a source is out (the source was its
  only one) takes the mean of the dies that could be fitted, and the fold says so (``Fold.borrowed``).
* ``in_sample``: the constants fitted on every row, every row predicted with them (what the committed values
  in ``roofline.devices`` are; ``python -m dtlab.cost.planner.validate --fit`` prints them).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtlab.cost.planner.prediction import predict
from dtlab.cost.planner.runs import Run
from dtlab.cost.roofline import devices

__all__ = ["Fold", "die_of", "fit", "in_sample", "out_of_sample", "source_of", "sustained", "weighted_median"]

BRACKET = (0.3, 1.3)  # the values a fit searches: a GEMM keeps between 30 % and 130 % of its MAMF
STEPS = 12  # bisection steps: the bracket cut to 1/4096, below the 0.001 the values are rounded to


@dataclass(frozen=True)
class Fold:
    """The constants one prediction used: ``held_out`` the source left out of the fit ("" in-sample), the value
    per die, the rows each was fitted on, and the dies that had no row to fit on (``borrowed``)."""

    held_out: str
    constants: dict[str, float]
    fitted_on: dict[str, tuple[int, ...]] = field(default_factory=dict)
    borrowed: tuple[str, ...] = ()


def source_of(run: Run) -> str:
    """The source's short name: what its citation says before the first comma (a paper, a repository)."""
    return run.source.split(",")[0].strip()


def die_of(run: Run) -> str:
    return devices.DIES[run.gpu]


@contextlib.contextmanager
def sustained(values: Mapping[str, float]) -> Iterator[None]:
    """``roofline.devices.SUSTAINED`` set to ``values`` (per die) for the duration: what-if questions, the fits."""
    before = dict(devices.SUSTAINED)
    devices.SUSTAINED.update(values)
    try:
        yield
    finally:
        devices.SUSTAINED.clear()
        devices.SUSTAINED.update(before)


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The smallest value at which the weights of the values up to it reach half of all the weights."""
    if not values:
        raise ValueError("weighted_median of nothing")
    pairs = sorted(zip(values, weights, strict=True))
    half, total = sum(weights) / 2, 0.0
    for value, weight in pairs:
        total += weight
        if total >= half - 1e-12:
            return value
    return pairs[-1][0]


def _scored_errors(runs: Sequence[Run]) -> list[tuple[Run, float]]:
    out = []
    for run in runs:
        p = predict(run)
        if p["scored"]:
            out.append((run, p["error"]))
    return out


def _fit_die(runs: Sequence[Run], die: str) -> tuple[float, tuple[int, ...]] | None:
    """The die's constant fitted on ``runs`` (those on the die), and the rows it was fitted on; None if none scores."""
    mine = [run for run in runs if die_of(run) == die]
    low, high = BRACKET
    rows: tuple[int, ...] = ()
    for _ in range(STEPS):
        middle = (low + high) / 2
        with sustained({die: middle}):
            scored = _scored_errors(mine)
        if not scored:
            return None
        count = {s: sum(1 for r, _ in scored if source_of(r) == s) for s in {source_of(r) for r, _ in scored}}
        error = weighted_median([e for _, e in scored], [1 / count[source_of(r)] for r, _ in scored])
        rows = tuple(r.index for r, _ in scored)
        low, high = (middle, high) if error < 0 else (low, middle)
    value = round((low + high) / 2, 3)
    if not BRACKET[0] + 0.001 < value < BRACKET[1] - 0.001:  # pinned at an end: no value explains these rows
        raise ValueError(f"{die}: no value in {BRACKET} zeroes the median error of rows {list(rows)}")
    return value, rows


def fit(runs: Sequence[Run], held_out: str = "") -> Fold:
    """Every die's constant fitted on ``runs`` less the rows of the source ``held_out`` (none if empty)."""
    kept = [run for run in runs if source_of(run) != held_out]
    constants: dict[str, float] = {}
    fitted_on: dict[str, tuple[int, ...]] = {}
    for die in devices.SUSTAINED:
        got = _fit_die(kept, die)
        if got is not None:
            constants[die], fitted_on[die] = got
    if not constants:
        raise ValueError(f"nothing to fit on: no scored row {'is left without ' + held_out if held_out else 'at all'}")
    borrowed = tuple(die for die in devices.SUSTAINED if die not in constants)
    mean = round(statistics.mean(constants.values()), 3)
    return Fold(held_out, {**constants, **dict.fromkeys(borrowed, mean)}, fitted_on, borrowed)


def _predicted(runs: Sequence[Run], fold: Fold) -> list[dict[str, Any]]:
    with sustained(fold.constants):
        return [{**predict(run), "run": run, "fold": fold} for run in runs]


def in_sample(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """``predict`` for every run with the constants fitted on all of them (``fold`` in each row)."""
    return _predicted(runs, fit(runs))


def out_of_sample(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """``predict`` for every run with the constants fitted on every other source's rows (leave one source out),
    in the runs' order; each row's ``fold`` says which constants, fitted on which rows."""
    by_source: dict[str, list[Run]] = {}
    for run in runs:
        by_source.setdefault(source_of(run), []).append(run)
    if len(by_source) < 2:
        raise ValueError("leaving one source out needs at least two sources")
    rows = {}
    for source, mine in by_source.items():
        for run, row in zip(mine, _predicted(mine, fit(runs, held_out=source)), strict=True):
            rows[run.index] = row
    return [rows[run.index] for run in runs]
