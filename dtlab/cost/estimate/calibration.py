"""The link a step-time estimate is priced on, calibrated on this machine in the run that uses it.

Every caller that predicts steps from a fresh calibration and checks them against runs of its own
(``benchmarks/estimate_error.py``, the width sweep of ``dtlab.experiments.speedup`` that ``make demo`` and
notebook 11 run) calibrates here, so they price collectives alike and cannot disagree on the link:

* ``calibrate_link``: a sweep of each collective at world size n, each rank on its share of the cores
  as a training rank (``collectives.sweep``), one alpha-beta link fitted per op (``costmodel.calibrate_ops``);
* ``RoundLinks``: that link with ``busy_s`` and ``busy_short_s`` (``costmodel.with_busy``: what a collective
  costs beyond its price between a step's compute, slow wake-ups included) measured again as each round
  starts. This machine's speed drifts within minutes, so a round's prediction is priced with what the
  same round measured.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import pandas as pd

from dtlab.cost.links import sweep as collectives
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.links.bound import BOUND_NOTE, bounding_links
from dtlab.cost.links.busy import BUSY_ROUNDS, with_busy
from dtlab.cost.links.linkset import LinkSet, calibrate_ops

__all__ = ["LINK_OPS", "QUICK_BUSY_ROUNDS", "SWEEP_REPEATS", "RoundLinks", "calibrate_link", "fitted_sweep"]

LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
SWEEP_REPEATS = 7  # per size: the outlier rule and the per-size medians need a handful
QUICK_BUSY_ROUNDS = 3  # a smoke run: enough to exercise the code, not a measurement
Fit = TypeVar("Fit")


def fitted_sweep(sweep: Callable[[], pd.DataFrame], fit: Callable[[pd.DataFrame], Fit],
                 fallback: Callable[[pd.DataFrame], Fit] | None = None) -> tuple[Fit, pd.DataFrame]:
    """``fit(sweep())`` and the sweep it fitted. A sweep that cannot be fitted (``fit`` raises ValueError: no
    positive per-byte cost, as when other work on the machine stalls it) is swept once more, with a warning.
    Where the second cannot be fitted either, ``fallback`` (a ``bound.bounding_link``, say) gives the answer,
    said in one line; without one, the second's error is raised."""
    frame = sweep()
    try:
        return fit(frame), frame
    except ValueError as err:
        warnings.warn(f"calibration: sweep 1 could not be fitted ({err}); sweeping again", stacklevel=2)
    frame = sweep()
    if fallback is None:
        return fit(frame), frame
    try:
        return fit(frame), frame
    except ValueError as err:
        warnings.warn(f"calibration: sweep 2 could not be fitted either ({err}); going on with the {BOUND_NOTE}",
                      stacklevel=2)
    return fallback(frame), frame


def calibrate_link(world_size: int = 2, ops: Sequence[str] = LINK_OPS, *, quick: bool = False) -> LinkSet:
    """One link per op in ``ops``, fitted on a sweep of those ops at ``world_size`` (``quick``: a few sizes
    and repeats, a smoke test). ``busy_s`` is not measured here: ``RoundLinks`` adds it per round. A sweep that
    cannot be fitted is swept once more, then bounded (``fitted_sweep``)."""
    sizes, repeats = ((collectives.QUICK_CALIBRATION_SIZES, collectives.QUICK_CALIBRATION_REPEATS) if quick
                      else (collectives.CALIBRATION_SIZES, SWEEP_REPEATS))
    label = f"gloo loopback, calibrated at n={world_size}"
    link, _ = fitted_sweep(
        lambda: collectives.sweep(world_size, ops=tuple(ops), sizes=sizes, repeats=repeats, per_repeat=True),
        lambda sweep: calibrate_ops(sweep, tuple(ops), label=label),
        lambda sweep: bounding_links(sweep, tuple(ops), label=label))
    return link


class RoundLinks:
    """``links(round)``: ``link`` with both busy figures measured on first use in that round (round -1: a
    warm-up round), each on a synthetic job at ``world_size``, never on a point it prices."""

    def __init__(self, link: LinkModel | LinkSet, world_size: int = 2, *, quick: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        self.link, self.world_size, self.log = link, world_size, log
        self.busy_rounds = QUICK_BUSY_ROUNDS if quick else BUSY_ROUNDS
        self.links: dict[int, LinkModel | LinkSet] = {}

    def __call__(self, round_: int) -> LinkModel | LinkSet:
        if round_ not in self.links:
            self.links[round_] = with_busy(self.link, self.world_size, rounds=self.busy_rounds)
            if self.log is not None:
                what = "warm-up round" if round_ < 0 else f"round {round_ + 1}"
                self.log(f"{what}: busy_s {self.links[round_].busy_s * 1e3:.2f} ms per collective after 5 ms "
                         f"of compute, {self.links[round_].busy_short_s * 1e3:.2f} ms after 0.5 ms")
        return self.links[round_]

    def busy_text(self, field: str = "busy_s") -> str:
        """One busy figure of every measured round, in ms: ``1.97/0.76/...`` (the warm-up round left out)."""
        return "/".join(f"{getattr(self.links[r], field) * 1e3:.2f}" for r in sorted(self.links) if r >= 0)
