"""Texts the pages quote on parity (``dtlab.app.quoted`` registers them in ``QUOTES``): how far each tier ends
from ``single`` in float64 and float32, per tier and per job.

Each function reads ``docs/figures/parity.csv`` (``python -m dtlab.experiments.parity --csv FILE --by-tier``,
one row per case and dtype) and its sidecar ``parity.json`` (date, machine, torch) beneath the checkout's root
it is given; the per-tier table is the experiment's own ``by_tier``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dtlab.app.quoted_docs import FIGURES, sci, table_row
from dtlab.experiments.parity import by_tier

PARITY = FIGURES / "parity.csv"
PARITY_META = FIGURES / "parity.json"
FLOAT32_BOUND = 1e-5  # the float32 parity tests' bound (tests/test_parity.py), set before measuring
WIDE_BOUND = 1e-4  # the bound of the float32 tests on the jobs below
PIPELINE_JOB = "mlp-8"  # the 8-layer pipeline job's cases are named "... mlp-8 <optimizer>"

# What each tier's cases run (``dtlab.experiments.parity.CASES``); configuration, not measurement.
TIER_CASES: dict[str, str] = {
    "dp": "world 2, the mlp",
    "ddp-naive": "world 2, the mlp",
    "ddp": "world 2 and 4; the moe model (width 32 and 64); Muon at world 2",
    "zero": "world 2, with and without `parameters_as_bucket_view`; Muon at world 4",
    "rpc": "2 trainers, `mode=\"sync\"`",
    "pipeline": "all 7 schedules on an 8-layer mlp (6 steps), 4 micro-batches, world 2; GPipe on the charformer",
    "fsdp": "world 2 (mlp, charformer, moe); HSDP 2 × 2; Muon at world 2 and 4",
    "multinode": "2 agents on loopback",
    "ft": "2 groups × 1 rank",
    "diloco": "2 groups × 1 rank, `sync_every=4`, against `dtlab.experiments.parity.diloco_reference`",
    "tp": "world 2: mlp; charformer, with `sequence_parallel` + `loss_parallel`, and at width 64, batch 16, "
          "12 steps; Adam also `decomposed_mlp` on the mlp and the charformer",
    "fsdp-tp": "2 × 2, charformer",
    "cp": "world 2, charformer; Adam also `zigzag` and `ulysses` at world 2, `zigzag` at world 4, `ulysses` + "
          "`zigzag` at world 4 (4 heads)",
    "ep": "moe at world 2 (width 32 and 64) and 4",
    "nd": "`pp=2, tp=2` and `dp=2, tp=2` (`1f1b`), charformer",
    "elastic": "world 2; Adam with an exception at step 6, resumed from the step-4 snapshot",
}
# The float32 jobs tested against ``WIDE_BOUND``: (what the page calls them, a part of their cases' names).
WIDE_JOBS: tuple[tuple[str, str], ...] = (
    ("every pipeline schedule on the 8-layer mlp", f"{PIPELINE_JOB} adam"),
    ("`tp` on the charformer of width 64 at batch 16 for 12 steps", "b16 12 steps adam"),
    ("the moe model of width 64 on `ep` and `ddp`", "moe-64 adam"),
)
OPTIMIZERS = (("sgd", "SGD"), ("adam", "Adam"), ("muon", "Muon"))

__all__ = ["PARITY", "PARITY_QUOTES", "parity_by_tier_table"]


def _runs(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / PARITY)


def _short(case: str) -> str:
    """A case's name without its optimizer, which the column already says."""
    return case.rsplit(" ", 1)[0]


def _largest(runs: pd.DataFrame, tier: str, dtype: str, optimizer: str) -> str:
    """Which of a tier's cases of ``optimizer`` has the largest gap ('' where they are one, or all alike)."""
    rows = runs[(runs["tier"] == tier) & (runs["dtype"] == dtype) & (runs["optimizer"] == optimizer)]
    top = rows.loc[rows["gap"] == rows["gap"].max(), "case"]
    if len(top) == len(rows):  # one case, or every case alike: nothing to name
        return ""
    alike = f" and {len(top) - 1} more alike" if len(top) > 1 else ""
    return f" (`{_short(top.iloc[0])}`{alike})"


def parity_by_tier_table(root: Path) -> str:
    """Per tier (``by_tier``): its cases and the largest gap per dtype and optimizer; float32 Adam's case named."""
    runs = _runs(root)
    table = by_tier(runs)
    columns = [(d, o, n) for d in ("float64", "float32") for o, n in OPTIMIZERS if f"{d} {o}" in table.columns]
    lines = [table_row(["tier", "cases", *(f"{d}, {n}" for d, _, n in columns)]),
             table_row(["---"] * (len(columns) + 2))]
    for tier, row in table.iterrows():
        cells = [f"`{tier}`", f"{int(row['cases'])}: {TIER_CASES.get(tier, '')}".rstrip(": ")]
        for dtype, opt, _ in columns:
            gap = row[f"{dtype} {opt}"]
            cells.append("—" if pd.isna(gap) else
                         sci(gap) + (_largest(runs, tier, dtype, opt) if (dtype, opt) == ("float32", "adam") else ""))
        lines.append(table_row(cells))
    return "\n".join(lines)


def parity_machine(root: Path) -> str:
    """One line: when, where and with which torch the committed run was measured, and its command."""
    meta = json.loads((root / PARITY_META).read_text())
    return (f"measured {meta['date']} on {meta['machine']} ({meta['cores']} cores, torch {meta['torch']}): "
            f"[figures/parity.csv](figures/parity.csv), from `{meta['command']}`")


def _ulps(x: float) -> str:
    return sci(x) if x >= 100 else f"{x:.2g}"


def parity_ulps(root: Path) -> str:
    """One line: float32 gaps in ulps of the largest parameter, SGD's largest and Adam's range, and the 8-layer
    pipeline job's apart."""
    f32 = _runs(root).query("dtype == 'float32'")
    sgd, adam = f32[f32["optimizer"] == "sgd"]["ulps"], f32[f32["optimizer"] == "adam"]
    pipe = adam["case"].str.contains(PIPELINE_JOB)
    rest, job = adam.loc[~pipe, "ulps"], adam.loc[pipe, "ulps"]
    return (f"SGD stays within {_ulps(sgd.max())} ulp everywhere, Adam at lr 0.01 reaches "
            f"{_ulps(rest.min())}–{_ulps(rest.max())} ulps, and {_ulps(job.max())} on the 8-layer pipeline job")


def parity_diloco(root: Path) -> str:
    """One line: how close ``diloco`` ends to its one-process reference, per dtype and optimizer ("bitwise" only
    where the gap is 0)."""
    runs = _runs(root).query("tier == 'diloco'")
    parts = []
    for dtype, rows in runs.groupby("dtype"):
        gaps = rows.groupby("optimizer", sort=False)["gap"].max()
        if (gaps == 0).all():
            parts.append(f"bitwise in {dtype}")
            continue
        each = " and ".join(f"{'bitwise' if g == 0 else f'within {sci(g)}'} with {dict(OPTIMIZERS)[o]}"
                            for o, g in gaps.items())
        parts.append(f"in {dtype} {each}")
    return ", ".join(sorted(parts, key=lambda p: "float64" not in p))  # float64 first


def parity_float32(root: Path) -> str:
    """One line: the largest float32 gap with SGD and with Adam at lr 0.01 over the committed run's jobs."""
    f32 = _runs(root).query("dtype == 'float32'").groupby("optimizer")["gap"].max()
    return f"≤ {sci(f32['sgd'])} with SGD, up to {sci(f32['adam'])} with Adam at lr 0.01"


def parity_over_bound(root: Path) -> str:
    """One line: how many float32 jobs end past the float32 tests' bound, and the largest."""
    f32 = _runs(root).query("dtype == 'float32'")
    over = f32[f32["gap"] > FLOAT32_BOUND]
    if over.empty:
        return f"none of the {len(f32)} float32 jobs of the committed run"
    return (f"{len(over)} of the {len(f32)} float32 jobs of the committed run, all Adam at lr 0.01"
            if set(over["optimizer"]) == {"adam"} else f"{len(over)} of the {len(f32)} float32 jobs") + \
        f" (up to {sci(over['gap'].max())})"


def parity_wide_jobs(root: Path) -> str:
    """One line: the jobs tested against ``WIDE_BOUND`` in float32, each with its largest gap in the run."""
    f32 = _runs(root).query("dtype == 'float32'")
    parts = []
    for name, part in WIDE_JOBS:
        gaps = f32.loc[f32["case"].str.contains(part, regex=False), "gap"]
        parts.append(f"{name} ({sci(gaps.max())})")
    return ", ".join(parts)


PARITY_QUOTES: dict[str, Callable[[Path], str]] = {
    "parity-by-tier": parity_by_tier_table,
    "parity-diloco": parity_diloco,
    "parity-float32": parity_float32,
    "parity-machine": parity_machine,
    "parity-over-bound": parity_over_bound,
    "parity-ulps": parity_ulps,
    "parity-wide-jobs": parity_wide_jobs,
}
