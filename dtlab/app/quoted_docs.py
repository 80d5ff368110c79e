"""Texts ``docs/tiers.md`` and ``docs/measurement.md`` quote (``dtlab.app.quoted`` registers them in ``QUOTES``):
the pipeline's bubble, the overlap of communication with compute, Muon's parity.

Each function reads a result under ``docs/figures/`` beneath the checkout's root it is given and returns the
text between a page's markers (``dtlab.app.quotes``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dtlab.cost.planner import validate
from dtlab.read import multinode
from dtlab.read.rounds import median

FIGURES = Path("docs/figures")
PIPELINE_BUBBLE = FIGURES / "pipeline_bubble.csv"
OVERLAP = FIGURES / "overlap.csv"
PARITY_MUON = FIGURES / "parity_muon.csv"
LINK_SWEEP_RUNS = FIGURES / "link_sweep_runs.csv"
PLANNER = FIGURES / "planner_validation.csv"

__all__ = ["DOCS", "sci"]


def sci(x: float, digits: int = 1) -> str:
    """``x`` as the pages write a gap: ``1.6e-7``, no padded exponent; 0 as ``0``."""
    if x == 0:
        return "0"
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m[1] == '-' else ''}{m[2]}", f"{x:.{digits}e}")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def pipeline_bubble_table(root: Path) -> str:
    """Per schedule: the idle share measured, by formula and in the equal-times layout, the transfers' shares,
    the median step and the largest rank's activations (``python -m dtlab.experiments.schedules``)."""
    runs = pd.read_csv(root / PIPELINE_BUBBLE)
    lines = [_row(["schedule", "v", "measured idle", "formula", "equal-times layout", "transfer in flight (of step)",
                   "idle with one posted", "idle receiving sent data", "median step (ms)",
                   "activations, largest rank (MiB), measured = predicted"]),
             _row(["---"] * 10)]
    for r in runs.itertuples():
        # the activations are measured and predicted both; the column says so only where they agree
        same = math.isclose(r.activations_MiB, r.predicted_MiB, rel_tol=1e-9)
        activations = f"{r.activations_MiB:.3f}" + ("" if same else f" (predicted {r.predicted_MiB:.3f})")
        formula = "—" if pd.isna(r.formula) else f"{r.formula:.3f}"
        lines.append(_row([f"`{r.schedule}`", str(r.v), f"{r.measured:.3f}", formula, f"{r.simulated:.3f}",
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
    lines = [_row(["run", *(f"rank {r}" for r in shares.columns)]), _row(["---"] * (1 + len(shares.columns)))]
    for run, row in shares.iterrows():
        lines.append(_row([_OVERLAP_RUNS.get(run, f"`{run}`"), *(f"{v:.1f} %" for v in row)]))
    return "\n".join(lines)


def overlap_control(root: Path) -> str:
    """The control's shares against the overlapping ring's, rank by rank."""
    shares = _overlap(root)
    control, ring = shares.loc["tp decomposed_mlp, control"], shares.loc["tp decomposed_mlp"]
    return (f"gave the control {' and '.join(f'{v:.1f} %' for v in control)} (ranks 0 and 1) against the "
            f"overlapping ring's {' and '.join(f'{v:.1f} %' for v in ring)}")


def parity_muon(root: Path, dtype: str) -> str:
    """The largest gap from ``single`` over Muon's cases in ``dtype``."""
    runs = pd.read_csv(root / PARITY_MUON)
    return sci(runs.loc[runs["dtype"] == dtype, "gap"].max())


def _links(root: Path) -> tuple[pd.DataFrame, float, float, float]:
    """The sweep's runs, its slow and fast links (Mbit/s) and its delay (ms)."""
    runs = pd.read_csv(root / LINK_SWEEP_RUNS)
    return runs, runs["link_mbit"].min(), runs["link_mbit"].max(), runs["link_delay_ms"].max()


def _within(values: list[float]) -> str:
    """A median of per-round ratios and their min–max; three places below 1, where the savings are."""
    digits = 3 if median(values) < 1 else 2
    return f"{median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def _link_name(mbit: float, delay: float) -> str:
    link = f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"
    return link + (f" + {delay:g} ms" if delay else "")


def _step_gain(runs: pd.DataFrame, hook: str, mbit: float, delay: float) -> pd.Series:
    """Per round, what ``delay`` adds to ``hook``'s step on ``mbit`` (ms)."""
    at = runs[(runs["link_mbit"] == mbit) & (runs["comm_hook"] == hook)].pivot(
        index="round", columns="link_delay_ms", values="step_ms")
    return at[delay] - at[0.0]


def link_sweep_table(root: Path) -> str:
    """Per link: the all-reduce's step and each compression hook's, with its per-round ratio to the all-reduce."""
    runs, _, _, _ = _links(root)
    lines = [_row(["link", "all-reduce step", "fp16 step (/ all-reduce)", "PowerSGD rank 1 step (/ all-reduce)"]),
             _row(["---"] * 4)]
    points = runs[["link_mbit", "link_delay_ms"]].drop_duplicates().sort_values(
        ["link_mbit", "link_delay_ms"], ascending=[False, True])
    for mbit, delay in points.itertuples(index=False):
        at = runs[(runs["link_mbit"] == mbit) & (runs["link_delay_ms"] == delay)]
        cells = [_link_name(mbit, delay)]
        for hook in ("allreduce", "fp16", "powersgd"):
            steps = at.loc[at["comm_hook"] == hook, "step_ms"]
            step = f"{steps.median():.1f} ms"
            if hook == "allreduce":
                cells.append(f"{step} ({steps.min():.1f}–{steps.max():.1f})")
            else:
                cells.append(f"{step} ({_within(multinode.step_ratios(runs, hook, mbit, delay))})")
        lines.append(_row(cells))
    return "\n".join(lines)


def link_sweep_bandwidth(root: Path) -> str:
    """The slow link's cost to the all-reduce, and what each hook sends and takes of its step there and on the
    fast link."""
    runs, slow, fast, _ = _links(root)
    slowdown = multinode.slowdown(runs, slow, fast)
    sent = runs.groupby("comm_hook")["comm_mb_per_step"].median()
    fp16, psgd = (median(multinode.step_ratios(runs, h, slow, 0.0)) for h in ("fp16", "powersgd"))
    fast_fp16, fast_psgd = (median(multinode.step_ratios(runs, h, fast, 0.0)) for h in ("fp16", "powersgd"))
    return (f"at {_link_name(slow, 0)} the plain all-reduce makes the step {median(slowdown):.1f}× slower than at "
            f"{_link_name(fast, 0)} [{min(slowdown):.1f}–{max(slowdown):.1f}]; fp16 sends half the bytes "
            f"({sent['fp16']:.2f} MB) and takes {fp16:.2f} of its step; PowerSGD sends "
            f"{100 * sent['powersgd'] / sent['allreduce']:.0f} % ({sent['powersgd']:.3f} MB) and takes {psgd:.2f}; "
            f"on the fast link neither pays (fp16 {fast_fp16:.2f}, PowerSGD {fast_psgd:.2f}")


def link_sweep_delay(root: Path) -> str:
    """What the delay adds to one all-reduce per step, per link, min–max over the rounds."""
    runs, slow, fast, delay = _links(root)
    fast_gain, slow_gain = (_step_gain(runs, "allreduce", m, delay) for m in (fast, slow))
    return (f"which the delay costs {fast_gain.min():.1f}–{fast_gain.max():.1f} ms at {_link_name(fast, 0)} and "
            f"{slow_gain.min():.1f}–{slow_gain.max():.1f} ms at {_link_name(slow, 0)}")


def link_sweep_powersgd_delay(root: Path) -> str:
    """What the delay adds to PowerSGD's step, per link, min–max over the rounds."""
    runs, slow, fast, delay = _links(root)
    gains = [_step_gain(runs, "powersgd", m, delay) for m in (slow, fast)]
    return (f"its step grows by {gains[0].min():.0f}–{gains[0].max():.0f} ms at {_link_name(slow, 0)} and "
            f"{gains[1].min():.0f}–{gains[1].max():.0f} ms at {_link_name(fast, 0)}")


def link_sweep_order(root: Path) -> str:
    """PowerSGD against fp16 on the slow delayed link, and PowerSGD on the fast delayed one."""
    runs, slow, fast, delay = _links(root)
    psgd, fp16 = (median(multinode.step_ratios(runs, h, slow, delay)) for h in ("powersgd", "fp16"))
    fast_psgd = median(multinode.step_ratios(runs, "powersgd", fast, delay))
    return (f"({psgd:.2f} of the all-reduce against {fp16:.2f}); at {_link_name(fast, delay)} it is the slowest "
            f"({fast_psgd:.1f}× the all-reduce)")


def link_sweep_quality(root: Path) -> str:
    """The held-out loss per seed and hook on the slow link, and how far each hook ends from the all-reduce."""
    runs, slow, _, _ = _links(root)
    held = runs[(runs["link_mbit"] == slow) & (runs["link_delay_ms"] == 0)].pivot(
        index="seed", columns="comm_hook", values="eval_loss")
    seeds = ", ".join(str(s) for s in held.index)
    per = "; ".join(f"{name} {', '.join(f'{v:.3f}' for v in held[hook])}"
                    for hook, name in (("allreduce", "all-reduce"), ("fp16", "fp16"), ("powersgd", "PowerSGD")))
    fp16 = (held["fp16"] - held["allreduce"]).abs()
    psgd = held["powersgd"] - held["allreduce"]
    worse = "on every seed" if (psgd > 0).all() else f"on {(psgd > 0).sum()} of {len(psgd)} seeds"
    return (f"per seed {seeds}, {per}. fp16 is within {fp16.max():.3f} of the all-reduce on every seed; PowerSGD "
            f"at rank 1 is worse {worse}, by {psgd.min():.4f} to {psgd.max():.3f}")


def _planner(root: Path) -> pd.DataFrame:
    """The validation's rows, labelled as ``validate`` labels a run."""
    rows = pd.read_csv(root / PLANNER)
    rows["scored"] = rows["scored"].astype(bool)
    return rows.assign(label=[f"row {r.row}: {r.model}, {r.gpus} x {r.gpu}" for r in rows.itertuples()])


def planner_output(root: Path) -> str:
    """The validation's summary lines, as ``python -m dtlab.cost.planner.validate`` prints them."""
    rows = _planner(root)
    lines = [f"{validate.LOSO}: {validate.summary(rows)}",
             f"{validate.IN_SAMPLE}: {validate.summary(rows, 'error_in_sample')}"]
    unscored = rows[~rows["scored"]]
    if len(unscored):
        lines.append(f"not scored (unpublished choices, none fits by the planner's memory model): rows "
                     f"{validate.compact(unscored['row'])}")
    return "\n".join(["```text", *lines, "```"])


def _median_worst(rows: pd.DataFrame, column: str) -> str:
    errors = rows.loc[rows["scored"], column]
    worst = errors.loc[errors.abs().idxmax()]
    return f"the median error is {100 * errors.abs().median():.1f} % and the worst {100 * worst:+.1f} %"


def planner_headline(root: Path) -> str:
    """Out of sample over the scored runs: the median and worst error, against the targets."""
    rows = _planner(root)
    errors = rows.loc[rows["scored"], "error"]
    met = errors.abs().median() <= validate.TARGETS[0] and errors.abs().max() <= validate.TARGETS[1]
    return (f"Over the {int(rows['scored'].sum())} scored runs {_median_worst(rows, 'error')}: the targets set "
            f"for it (a median of at most {100 * validate.TARGETS[0]:.0f} %, a worst of at most "
            f"{100 * validate.TARGETS[1]:.0f} %) are **{'met' if met else 'not met'}**")


def planner_in_sample(root: Path) -> str:
    """In-sample over the scored runs: the median and worst error."""
    return _median_worst(_planner(root), "error_in_sample")


def planner_sources(root: Path) -> str:
    """Per source: its runs and its median |error|, out of sample and in-sample (``not scored`` where none is)."""
    rows = _planner(root)
    lines = [_row(["source", "runs", "leave-one-source-out", "in-sample"]), "| --- | ---: | ---: | ---: |"]
    for source, runs in rows.groupby("source", sort=False):
        scored = runs[runs["scored"]]
        cells = ([f"{100 * scored[c].abs().median():.1f} %" for c in ("error", "error_in_sample")]
                 if len(scored) else ["not scored"] * 2)
        lines.append(_row([source, str(len(runs)), *cells]))
    return "\n".join(lines)


DOCS: dict[str, Callable[[Path], str]] = {
    "link-sweep-bandwidth": link_sweep_bandwidth,
    "link-sweep-delay": link_sweep_delay,
    "link-sweep-order": link_sweep_order,
    "link-sweep-powersgd-delay": link_sweep_powersgd_delay,
    "link-sweep-quality": link_sweep_quality,
    "link-sweep-table": link_sweep_table,
    "overlap-control": overlap_control,
    "overlap-table": overlap_table,
    "parity-muon-float32": lambda root: parity_muon(root, "float32"),
    "parity-muon-float64": lambda root: parity_muon(root, "float64"),
    "planner-headline": planner_headline,
    "planner-in-sample": planner_in_sample,
    "planner-output": planner_output,
    "planner-sources": planner_sources,
    "pipeline-bubble-excess": pipeline_bubble_excess,
    "pipeline-bubble-load": pipeline_bubble_load,
    "pipeline-bubble-table": pipeline_bubble_table,
}
