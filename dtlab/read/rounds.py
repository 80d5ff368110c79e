"""Interleaved rounds read back: one variant's value per round, two variants' per-round ratios, their median
and the interval quoted beside it, named for what it is.

Benchmarks, figures and the pages that quote them all read their rows through here, so a "90 %" is always a
bootstrap from enough rounds to mean it and fewer rounds are called what they are: a min-max.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["BOOTSTRAP_MIN_ROUNDS", "Interval", "median", "median_interval", "per_round", "ratios"]

BOOTSTRAP_MIN_ROUNDS = 10


class Interval(NamedTuple):
    """An interval for the median of per-round values, with the name it may be quoted under."""

    lo: float
    hi: float
    label: str  # "90 % bootstrap" (>= BOOTSTRAP_MIN_ROUNDS rounds), "min-max of N rounds", or "no interval"

    def text(self) -> str:
        """``LABEL LO-HI`` for a result line's detail ("" with fewer than two rounds)."""
        return "" if math.isnan(self.lo) else f"{self.label} {self.lo:.3f}-{self.hi:.3f}"


def median_interval(values: Iterable[float], level: float = 0.9, resamples: int = 2000,
                    seed: int = 0) -> Interval:
    """The interval quoted beside a median of per-round values: what it is depends on the rounds.

    With at least ``BOOTSTRAP_MIN_ROUNDS`` rounds, a bootstrap percentile
    interval at ``level`` (0.9 is 90 %): the rounds resampled with replacement
    ``resamples`` times, with a fixed seed (the same rows give the same
    interval). With fewer, the min-max of the rounds. Either way it says how far
    the median could move with other rounds of the same noise: a target inside
    it is not resolved by the run.
    """
    values = sorted(v for v in values if not math.isnan(v))  # the same rounds in any order: the same interval
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} is invalid: must be between 0 and 1")
    if len(values) < 2:
        return Interval(float("nan"), float("nan"), "no interval")
    if len(values) < BOOTSTRAP_MIN_ROUNDS:
        return Interval(min(values), max(values), f"min-max of {len(values)} rounds")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return Interval(medians[int(tail * (resamples - 1))], medians[int(round((1 - tail) * (resamples - 1)))],
                    f"{100 * level:g} % bootstrap")


def per_round(rows: Iterable[Mapping[str, Any]], variant: str, key: str) -> dict[int, float]:
    """``{round: value}`` of one variant's measurement, measured rounds only (warm-up rounds are negative)."""
    return {int(r["round"]): float(r[key]) for r in rows if r["variant"] == variant and r["round"] >= 0}


def ratios(rows: Iterable[Mapping[str, Any]], numerator: str, denominator: str, key: str) -> list[float]:
    """Per-round ``numerator / denominator`` of ``key``: the two ran in the same round."""
    rows = list(rows)
    num, den = per_round(rows, numerator, key), per_round(rows, denominator, key)
    return [num[r] / den[r] for r in sorted(num.keys() & den.keys()) if den[r] > 0]


def median(values: Iterable[float]) -> float:
    """The median, NaNs left out (NaN where nothing is left)."""
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")
