"""Texts ``docs/measurement.md`` quotes (``dtlab.app.quoted`` registers them in ``QUOTES``): the link sweep, the
planner's validation against published runs, this machine's roofline (faults and DiLoCo: ``quoted_faults``).

Each function reads a result under ``docs/figures/`` beneath the checkout's root it is given and returns the
text between a page's markers (``dtlab.app.quotes``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dtlab.app.quoted_docs import FIGURES, table_row
from dtlab.cost.planner import validate
from dtlab.cost.roofline import cpu as roofline_cpu
from dtlab.cost.roofline.__main__ import gemm_errors
from dtlab.cost.roofline.devices import SUSTAINED
from dtlab.read import multinode
from dtlab.read.rounds import median

LINK_SWEEP_RUNS = FIGURES / "link_sweep_runs.csv"
PLANNER = FIGURES / "planner_validation.csv"
ROOFLINE = FIGURES / "roofline.csv"
DEMO = FIGURES / "demo_compare.csv"
FRONT_DOOR = FIGURES / "front_door.csv"
FRONT_DOOR_TARGET_S = 1.0  # benchmarks/front_door.py's TARGET_S: its aim for a command line that needs no torch

__all__ = ["MEASURE"]


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
    lines = [table_row(["link", "all-reduce step", "fp16 step (/ all-reduce)", "PowerSGD rank 1 step (/ all-reduce)"]),
             table_row(["---"] * 4)]
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
        lines.append(table_row(cells))
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
    lines = [table_row(["source", "runs", "leave-one-source-out", "in-sample"]), "| --- | ---: | ---: | ---: |"]
    for source, runs in rows.groupby("source", sort=False):
        scored = runs[runs["scored"]]
        cells = ([f"{100 * scored[c].abs().median():.1f} %" for c in ("error", "error_in_sample")]
                 if len(scored) else ["not scored"] * 2)
        lines.append(table_row([source, str(len(runs)), *cells]))
    return "\n".join(lines)


def _signed(x: float) -> str:
    return f"{100 * x + 0:+.1f} %".replace("-", "−")  # + 0: no "−0.0 %"


def _mosaic(root: Path) -> pd.DataFrame:
    """MosaicML's scored rows, with their die, recomputation (from the layout) and model size."""
    rows = _planner(root)
    rows = rows[rows["scored"] & (rows["source"] == "MosaicML llm-foundry")]
    return rows.assign(die=rows["gpu"].str.split("_").str[0], recompute=rows["layout"].str.split().str[4],
                       size=rows["model"].str.split().str[0].str.removeprefix("MPT-"))


def planner_h100(root: Path) -> str:
    """MosaicML's H100 runs: the median error out of sample (and its worst), and in-sample."""
    h100 = _mosaic(root).query("die == 'H100'")
    out, inside = h100["error"], h100["error_in_sample"]
    same = "signed and unsigned" if (out > 0).all() else f"unsigned; signed {_signed(out.median())}"
    return (f"{100 * out.abs().median():.1f} % too fast out of sample (the median, {same}; worst "
            f"{_signed(out.loc[out.abs().idxmax()])}), {100 * inside.abs().median():.1f} % in-sample (signed median "
            f"{_signed(inside.median())})")


def planner_sustained(root: Path) -> str:
    """The H100's and the A100's fitted constants as committed (``roofline.devices.SUSTAINED``); ``root`` unused:
    the constants are the code's, refitted by ``validate --fit``."""
    return f"({SUSTAINED['H100']:g} against {SUSTAINED['A100']:g})"


def planner_scale(root: Path) -> str:
    """MosaicML's large-scale H100 table: how far the published and the predicted rate per GPU fall from the
    fewest GPUs to the most, per model."""
    big = _mosaic(root).query("die == 'H100' and gpus >= 128")
    lo, hi = big["gpus"].min(), big["gpus"].max()
    falls, moves = {}, []
    for size, runs in big.groupby("size"):
        at = runs.set_index("gpus")
        if lo in at.index and hi in at.index:
            falls[size] = 1 - at.loc[hi, "published"] / at.loc[lo, "published"]
            moves.append(abs(at.loc[hi, "predicted"] / at.loc[lo, "predicted"] - 1))
    least, most = min(falls, key=falls.get), max(falls, key=falls.get)
    return (f"fall from {lo} to {hi} GPUs by {100 * falls[least]:.1f} % ({least}) to {100 * falls[most]:.1f} % "
            f"({most}), and the prediction moves by at most {100 * max(moves):.1f} %")


def planner_small(root: Path) -> str:
    """MosaicML's A100 models below 1B parameters, in-sample: each size's median error, and every run without
    recomputation."""
    a100 = _mosaic(root).query("die == 'A100'")
    small = a100[a100["size"].str.endswith("M")]
    medians = small.groupby("size", sort=False)["error_in_sample"].median()
    medians = medians.loc[sorted(medians.index, key=lambda s: float(s[:-1]))]
    return (f"{100 * medians.min():.0f}–{100 * medians.max():.0f} % too fast in-sample (medians: "
            f"{', '.join(f'{size} {_signed(m)}' for size, m in medians.items())}), all of MosaicML's A100 runs "
            f"without recomputation {_signed(a100.loc[a100['recompute'] == 'none', 'error_in_sample'].median())}")


def planner_recompute(root: Path) -> str:
    """MosaicML's signed median error in-sample per die, with full recomputation and without."""
    rows = _mosaic(root)
    med = rows.groupby(["recompute", "die"])["error_in_sample"].median()
    return (f"in-sample {_signed(med['full', 'A100'])} (A100) and {_signed(med['full', 'H100'])} (H100) signed "
            f"medians, against {_signed(med['none', 'A100'])} and {_signed(med['none', 'H100'])} without it")


# The placements as the page names them, in its order
_PLACEMENTS = {(1, 1): "1 thread", (2, 1): "2 threads", (1, 2): "1 thread in each of 2 processes"}


def _roofline(root: Path) -> tuple[pd.DataFrame, roofline_cpu.Roofline]:
    path = root / ROOFLINE
    return _fitted(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _fitted(path: Path, mtime_ns: int) -> tuple[pd.DataFrame, roofline_cpu.Roofline]:
    """The file and its fit, once per version of the file: three quotes read it, and the fit takes seconds."""
    frame = pd.read_csv(path)
    return frame, roofline_cpu.fit(frame, machine={})  # the machine's description is not in the file


def roofline_table(root: Path) -> str:
    """Per placement, the fitted roofline: peak, triad bandwidth, ridge point and eager PyTorch's costs."""
    _, roof = _roofline(root)
    header = ["placement", "peak fp32 (best shape)", "triad, 16 MiB arrays", "ridge point",
              "eager cost per op: forward / backward / optimizer", "per step"]
    lines = [table_row(header), table_row(["---"] * len(header))]
    order = [k for k in _PLACEMENTS if k in roof.placements] + [k for k in roof.placements if k not in _PLACEMENTS]
    for key in order:
        place = roof.placements[key]
        peak, bandwidth, over = place.device.peak("fp32"), place.device.memory_bandwidth, place.overhead
        per_op = " / ".join(f"{over.per_op_s[p] * 1e6:.1f}" for p in ("forward", "backward", "optimizer"))
        name = _PLACEMENTS.get(key, f"{key[0]} thread(s) × {key[1]} copies")
        lines.append(table_row([name, f"{peak / 1e9:.0f} GFLOP/s", f"{bandwidth / 1e9:.1f} GB/s",
                                f"{peak / bandwidth:.1f} FLOP/B", f"{per_op} µs",
                                f"{sum(over.fixed_s.values()) * 1e6:.0f} µs"]))
    return "\n".join(lines)


def roofline_fit(root: Path) -> str:
    """How far the roofline is from the GEMMs it was fitted on, at the median and the 90th percentile."""
    frame, roof = _roofline(root)
    errors = gemm_errors(frame, roof).assign(error=lambda e: e["error"].abs()).groupby(["threads", "copies"])["error"]
    medians, p90 = errors.median(), errors.quantile(0.9)
    at_median = "exact" if medians.max() < 0.005 else f"within {100 * medians.max():.0f} %"
    return f"{at_median} at the median and {100 * p90.min():.0f}–{100 * p90.max():.0f} %"


def roofline_triads(root: Path) -> str:
    """The triads well above their placement's memory roof (cache-resident), and the largest arrays'."""
    frame, roof = _roofline(root)
    triads = frame[frame["kind"] == "triad"]
    rates = triads["bytes"] / triads["seconds"]
    roofs = [roof.placements[(int(t), int(c))].device.memory_bandwidth
             for t, c in zip(triads["threads"], triads["copies"], strict=True)]
    cached = triads[rates > [1.5 * r for r in roofs]]  # half again the roof: no bandwidth from memory does that
    largest = triads["array_mib"] == triads["array_mib"].max()
    fast, slow = rates[cached.index] / 1e9, rates[largest] / 1e9
    return (f"The cache-resident triads ({cached['array_mib'].min():g}–{cached['array_mib'].max():g} MiB arrays: "
            f"{fast.min():.0f}–{fast.max():.0f} GB/s) sit above the memory roof in the figure for the same reason, "
            f"and the {triads['array_mib'].max():g} MiB ones ({slow.min():.0f}–{slow.max():.0f} GB/s, from memory) "
            f"below it")


def demo_collectives(root: Path) -> str:
    """DDP's and ZeRO's collectives per step in the demo's run."""
    per = pd.read_csv(root / DEMO).set_index("tier")["collectives_per_step"]
    return f"DDP's and ZeRO's {per['ddp']:.2f} and {per['zero']:.2f} collectives per step"


def front_door(root: Path) -> str:
    """The slowest command line that needs no torch against the aim and an empty interpreter, and a bad
    ``--opt``, which imports torch and its tier: medians over the rounds (round -1 is the warm-up)."""
    rows = pd.read_csv(root / FRONT_DOOR)
    medians = rows[rows["round"] >= 0].groupby("variant")["seconds"].median()
    bare, bad = medians["python -c pass"], medians["a bad --opt (imports the tier)"]
    torch_free = medians.drop(["python -c pass", "a bad --opt (imports the tier)"])
    # the line break stays where the page had it, inside the sentence
    return (f"the slowest of them, `{torch_free.idxmax()}`, answered in a median of {torch_free.max():.3f} s "
            f"(target ≤ {FRONT_DOOR_TARGET_S:g} s; `python -c pass`\n{bare:.3f} s). A bad `--opt` needs its tier's "
            f"options, so torch and that tier: {bad:.2f} s.")


MEASURE: dict[str, Callable[[Path], str]] = {
    "front-door": front_door,
    "demo-collectives": demo_collectives,
    "link-sweep-bandwidth": link_sweep_bandwidth,
    "link-sweep-delay": link_sweep_delay,
    "link-sweep-order": link_sweep_order,
    "link-sweep-powersgd-delay": link_sweep_powersgd_delay,
    "link-sweep-quality": link_sweep_quality,
    "link-sweep-table": link_sweep_table,
    "planner-h100": planner_h100,
    "planner-headline": planner_headline,
    "planner-recompute": planner_recompute,
    "planner-scale": planner_scale,
    "planner-small": planner_small,
    "planner-sustained": planner_sustained,
    "planner-in-sample": planner_in_sample,
    "planner-output": planner_output,
    "planner-sources": planner_sources,
    "roofline-fit": roofline_fit,
    "roofline-table": roofline_table,
    "roofline-triads": roofline_triads,
}
