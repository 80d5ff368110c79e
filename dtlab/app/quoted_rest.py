"""Texts ``docs/measurement.md`` quotes beside its larger tables (``dtlab.app.quoted`` registers them in
``QUOTES``): the cost model's fitted link and how closely DiLoCo's benchmark replays DDP's curve.

Each function reads a result under ``docs/figures/`` beneath the checkout's root it is given and returns the
text between a page's markers (``dtlab.app.quotes``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dtlab.app.quoted_docs import FIGURES
from dtlab.read.diloco import REPLAY_TOLERANCE

COSTMODEL = FIGURES / "costmodel_error.csv"
DILOCO_RUNS = FIGURES / "diloco_link.csv"

__all__ = ["REST"]


def _exp(x: float) -> str:
    """``6.5e-5``, not Python's ``6.5e-05``: the pages write exponents without a leading zero."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def costmodel_link_fit(root: Path) -> str:
    """The link the cost model's run fitted: α and bandwidth, each with the interval the fit gives."""
    row = pd.read_csv(root / COSTMODEL).iloc[0]  # one fit per run: every point carries the same link
    # a bandwidth is 1/β, so its low end comes from β's high end
    rate = [1e-9 / row[c] for c in ("beta_s_per_byte", "beta_hi_s_per_byte", "beta_lo_s_per_byte")]
    return (f"α {1e6 * row['alpha_s']:.0f} µs [{1e6 * row['alpha_lo_s']:.0f}–{1e6 * row['alpha_hi_s']:.0f}], "
            f"{rate[0]:.2f} GB/s [{rate[1]:.2f}–{rate[2]:.2f}]")


def diloco_replay_gap(root: Path) -> str:
    """How far DDP's replayed curve ended from each run's own final evaluation, at worst, and the tolerance."""
    gap = pd.read_csv(root / DILOCO_RUNS)["replay_gap"].abs().max()
    return f"it ended within {_exp(gap)} of each run's own final evaluation, tolerance {REPLAY_TOLERANCE:g}"


REST: dict[str, Callable[[Path], str]] = {
    "costmodel-link-fit": costmodel_link_fit,
    "diloco-replay-gap": diloco_replay_gap,
}
