"""Texts ``docs/tiers.md`` quotes (``dtlab.app.quoted`` registers them in ``QUOTES``): the pipeline's bubble,
the overlap of communication with compute, Muon's parity.

Each function reads a result under ``docs/figures/`` beneath the checkout's root it is given and returns the
text between a page's markers (``dtlab.app.quotes``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.cost import cp as cp_cost

FIGURES = Path("docs/figures")
PIPELINE_BUBBLE = FIGURES / "pipeline_bubble.csv"
OVERLAP = FIGURES / "overlap.csv"

# ``python -m dtlab.experiments.cp_work``'s job, as the page states it: the counts it measured equal these formulas
CP_JOB = {"batch": 64, "width": 64, "depth": 2}

__all__ = ["DOCS", "FIGURES", "sci", "span", "table_row"]


def sci(x: float, digits: int = 1) -> str:
    """``x`` as the pages write a gap: ``1.6e-7``, no padded exponent; 0 as ``0``."""
    if x == 0:
        return "0"
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m[1] == '-' else ''}{m[2]}", f"{x:.{digits}e}")


def span(values: Any, fmt: str) -> str:
    """The smallest and largest of ``values`` in ``fmt`` as ``lo–hi``; one value where they read the same."""
    values = sorted(float(v) for v in values)
    lo, hi = fmt.format(values[0]), fmt.format(values[-1])
    return lo if lo == hi else f"{lo}–{hi}"


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def pipeline_bubble_table(root: Path) -> str:
    """Per schedule: the idle share measured, by formula and in the equal-times layout, the transfers' shares,
    the median step and the largest rank's activations (``python -m dtlab.experiments.schedules``)."""
    runs = pd.read_csv(root / PIPELINE_BUBBLE)
    header = ["schedule", "v", "measured idle", "formula", "equal-times layout", "transfer in flight (of step)",
              "idle with one posted", "idle receiving sent data", "median step (ms)",
              "activations, largest rank (MiB), measured = predicted"]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for r in runs.itertuples():
        # the activations are measured and predicted both; the column says so only where they agree
        same = math.isclose(r.activations_MiB, r.predicted_MiB, rel_tol=1e-9)
        activations = f"{r.activations_MiB:.3f}" + ("" if same else f" (predicted {r.predicted_MiB:.3f})")
        formula = "—" if pd.isna(r.formula) else f"{r.formula:.3f}"
        lines.append(table_row([f"`{r.schedule}`", str(r.v), f"{r.measured:.3f}", formula, f"{r.simulated:.3f}",
                           f"{r.transfer_share:.3f}", f"{r.idle_in_transfer:.3f}", f"{r.idle_in_arrival:.3f}",
                           f"{r.step_ms:.0f}", activations]))
    return "\n".join(lines)


def pipeline_bubble_load(root: Path) -> str:
    """The machine's load average (1 min) before and after the run, from the file's first row."""
    first = pd.read_csv(root / PIPELINE_BUBBLE).iloc[0]
    before, after = (float(str(first[c]).split()[0]) for c in ("load_before", "load_after"))
    return f"load average {before:.2f} (1 min) before, {after:.2f} after"


def pipeline_bubble_excess(root: Path) -> str:
    """How much of the idle time above the equal-times layout the transfers' own cost explains, per schedule,
    and the share of idle time spent receiving sent data with one stage per rank and with two."""
    runs = pd.read_csv(root / PIPELINE_BUBBLE)
    # idle receiving sent data is a share of the idle time; the excess a share of the step
    share = runs["idle_in_arrival"] * runs["measured"] / (runs["measured"] - runs["simulated"])
    names = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B", "zero-bubble": "zero bubble",
             "zbv": "ZB-V", "dualpipev": "DualPipeV"}
    lo, hi = runs.loc[share.idxmin(), "schedule"], runs.loc[share.idxmax(), "schedule"]
    one, two = (runs.loc[runs["v"] == v, "idle_in_arrival"] for v in (1, 2))
    return (f"{100 * share.min():.0f} % ({names.get(lo, lo)}) to {100 * share.max():.0f} % ({names.get(hi, hi)}) "
            f"of that excess: {one.min():.3f}–{one.max():.3f} of the idle time with one stage per rank, "
            f"{two.min():.2f}–{two.max():.2f} with two")


# What each run of ``dtlab.experiments.overlap`` is, for the table's first column
_OVERLAP_RUNS = {
    "ddp": "`ddp` (buckets reduced while backward computes the earlier layers)",
    "fsdp": "`fsdp` (FSDP2 runs its collectives in the training thread on CPU: its prefetch overlaps nothing)",
    "tp": "`tp` (DTensor's all-reduces, issued asynchronously and waited for at the next op)",
    "tp decomposed_mlp": "`tp` with `decomposed_mlp` (ring transfers under the next chunk's GEMM)",
    "tp decomposed_mlp, control": "`tp` with `decomposed_mlp`, `ring_overlap=False`: the control, which waits "
                                  "for each transfer before computing",
}


def _overlap(root: Path) -> pd.DataFrame:
    runs = pd.read_csv(root / OVERLAP)
    return runs.pivot(index="run", columns="rank", values="overlap_pct").reindex(list(dict.fromkeys(runs["run"])))


def overlap_table(root: Path) -> str:
    """Per run and rank, the share of communication time that coincides with compute."""
    shares = _overlap(root)
    lines = [table_row(["run", *(f"rank {r}" for r in shares.columns)]), table_row(["---"] * (1 + len(shares.columns)))]
    for run, row in shares.iterrows():
        lines.append(table_row([_OVERLAP_RUNS.get(run, f"`{run}`"), *(f"{v:.1f} %" for v in row)]))
    return "\n".join(lines)


def overlap_control(root: Path) -> str:
    """The control's shares against the overlapping ring's, rank by rank."""
    shares = _overlap(root)
    control, ring = shares.loc["tp decomposed_mlp, control"], shares.loc["tp decomposed_mlp"]
    return (f"gave the control {' and '.join(f'{v:.1f} %' for v in control)} (ranks 0 and 1) against the "
            f"overlapping ring's {' and '.join(f'{v:.1f} %' for v in ring)}")


def cp_flops_table(root: Path) -> str:
    """Each rank's matrix-product FLOPs of one ring-attention block at world 4, per balance, by
    ``dtlab.cost.cp.attention_flops_formula`` (which the measured counts equal; ``root`` unused)."""
    n = 4
    lines = [table_row([f"world {n}", *(f"rank {r}" for r in range(n))]), table_row(["---"] * (n + 1))]
    for balance in ("contiguous", "zigzag"):
        flops = cp_cost.attention_flops_formula(n, balance, CP_JOB["batch"], CP_JOB["width"])
        lines.append(table_row([f"`{balance}`", *(f"{f / 1e6:.2f} MFLOP" for f in flops)]))
    return "\n".join(lines)


def cp_bytes_table(root: Path) -> str:
    """The attention's bytes per step on the busiest rank, per method at world 2 and 4, by
    ``dtlab.cost.cp.attention_bytes`` (which the recorded bytes equal; ``root`` unused)."""
    header = ["`method`", *(f"world {n}, {what}" for n in (2, 4) for what in ("counted", "leaving the rank"))]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for method in ("ring", "ulysses"):
        cells = [cp_cost.attention_bytes(method, n, **CP_JOB) for n in (2, 4)]
        lines.append(table_row([f"`{method}`", *(f"{b[k] / 1e6:.2f} MB" for b in cells for k in ("counted", "sent"))]))
    return "\n".join(lines)


DOCS: dict[str, Callable[[Path], str]] = {
    "cp-bytes-table": cp_bytes_table,
    "cp-flops-table": cp_flops_table,
    "overlap-control": overlap_control,
    "overlap-table": overlap_table,
    "pipeline-bubble-excess": pipeline_bubble_excess,
    "pipeline-bubble-load": pipeline_bubble_load,
    "pipeline-bubble-table": pipeline_bubble_table,
}
