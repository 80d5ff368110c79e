"""The texts the pages quote, each written from the committed result file it comes from.

One function per quote, named in ``QUOTES``: it reads files under ``docs/figures/`` (relative to the checkout's
root it is given) and returns the text that goes between the page's markers (``dtlab.app.quotes``), one line
for a quote inside a sentence or a table's cell, a table for a block. Where a result has a target, the verdict
is computed here too: met, not met, or unresolved where the interval holds the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.app.quoted_docs import DOCS, span
from dtlab.app.quoted_faults import FAULTS
from dtlab.app.quoted_measure import MEASURE
from dtlab.app.quoted_more import MORE
from dtlab.app.quoted_parity import PARITY_QUOTES
from dtlab.app.quoted_rest import REST
from dtlab.cost.planner.validate import TARGETS
from dtlab.experiments.ddp_steps import summary
from dtlab.read import multinode
from dtlab.read.diloco import BOUND as DILOCO_BOUND
from dtlab.read.diloco import best_h, verdict
from dtlab.read.recovery import FT_TARGET, ft_against_elastic
from dtlab.read.rounds import median, median_interval, per_round, ratios
from dtlab.read.speedup import TOLERANCE, crossover

FIGURES = Path("docs/figures")

__all__ = ["QUOTES", "recording_costs"]


def _interval_text(values: Sequence[float]) -> str:
    interval = median_interval(values)
    if interval.label == "no interval":
        return "one round: no interval"
    rounds = "" if interval.label.startswith("min-max") else f" of {len(values)} rounds"
    return f"{interval.label.replace('min-max', 'min–max')}{rounds} {interval.lo:.3f}–{interval.hi:.3f}"


OVERHEAD = FIGURES / "instrument_overhead_training.csv"
FT_RECOVERY = FIGURES / "ft_recovery.csv"
DILOCO = FIGURES / "diloco_link.csv"
COSTMODEL = FIGURES / "costmodel_error.csv"
PLANNER = FIGURES / "planner_validation.csv"
DEMO = FIGURES / "demo_compare.csv"
LINK_SWEEP = FIGURES / "link_sweep_runs.csv"
SWEEPS = FIGURES / "width_sweep_runs.csv"


def recording_costs(root: Path) -> pd.DataFrame:
    """Per tier and job: the median step without recording, and each round's recorded / not recorded ratio."""
    runs = pd.read_csv(root / OVERHEAD)
    runs = runs[runs["round"] >= 0]  # listed in the order of the first measured round
    out = []
    for (tier, size), job in runs.groupby(["tier", "size"], sort=False):
        rows, key = job.to_dict("records"), f"{tier}:{size}"
        per = ratios(rows, f"{key}:instrumented", f"{key}:plain", "median_step_s")
        model = "charformer" if size == "charformer" else f"MLP {job['model_size'].iloc[0]}"
        out.append({"tier": tier, "job": f"{model}, global batch {job['global_batch'].iloc[0]}",
                    "plain_ms": 1e3 * median(per_round(rows, f"{key}:plain", "median_step_s").values()),
                    "ratio": median(per), "ratios": per})
    return pd.DataFrame(out)


def recording_cost(root: Path) -> str:
    """The table of what recording every collective adds to a step, per tier, from ``instrument_overhead``."""
    costs = recording_costs(root)
    lines = ["| tier | job (world 2) | step, not recorded | recorded / not recorded | interval |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{c.tier}` | {c.job} | {c.plain_ms:.1f} ms | {c.ratio:.3f} | {_interval_text(c.ratios)} |"
              for c in costs.itertuples()]
    return ("\n".join(lines) + "\n\n"
            "The median over interleaved rounds of each round's ratio of median step times "
            f"(`{OVERHEAD}`, from `python benchmarks/instrument_overhead.py`). Every run records by "
            "default; `dtlab.run(cfg, record=False)` runs without the recorder. Where the interval spans 1.02, a "
            "2 % cost cannot be told from this machine's noise.")


def recording_cost_line(root: Path) -> str:
    """The same, in one line (a table's cell)."""
    costs = recording_costs(root)
    return "; ".join(f"`{c.tier}` {c.job}: {c.ratio:.3f} [{_interval_text(c.ratios)}]" for c in costs.itertuples())


def _sweeps(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / SWEEPS)


def _runs_text(runs: pd.DataFrame) -> str:
    days = sorted({str(s)[:10] for s in runs["started"]})
    return f"{runs['run'].nunique()} runs of the sweep, {', '.join(days)}"


def width_sweep(root: Path) -> str:
    """One line: what the committed runs of the width sweep measured (best ddp speedup, crossover on 1 thread)."""
    runs = _sweeps(root)
    best = runs.loc[runs.groupby("run")["speedup"].idxmax()]
    one_thread = [crossover(run, "speedup_vs_1t") for _, run in runs.groupby("run")]
    paid = [round(w) for w in one_thread if w is not None]
    against_1t = (f"from a width of about {span(paid, '{:.0f}')}" if len(paid) == len(one_thread)
                  else f"from a width of about {span(paid, '{:.0f}')} in {len(paid)} of {len(one_thread)} runs"
                  if paid else "at no width")
    return (f"{_runs_text(runs)}: ddp reached at most {span(best['speedup'], '{:.2f}')}× of one 2-thread process "
            f"(at width {span(best['width'], '{:.0f}')}); against single on one thread it pays {against_1t}")


def width_sweep_predictions(root: Path) -> str:
    """One line: how many of the committed runs' points each prediction got within the target."""
    runs = _sweeps(root)
    parts = []
    for column, name in (("prediction_error", "with the compute on this machine's roofline"),
                         ("retimed_error", "with the compute re-timed")):
        inside = int((runs[column].abs() <= TOLERANCE).sum())
        parts.append(f"{name} {inside} of {len(runs)} points within {TOLERANCE * 100:.0f} % "
                     f"(errors {_pct(runs[column].min())} to {_pct(runs[column].max())})")
    return f"the estimator's predicted speedup, over the {_runs_text(runs)}: " + "; ".join(parts)


def width_sweep_runs(root: Path) -> str:
    """Per width and run: the prediction's error on the roofline and re-timed, and the measured speedup."""
    runs = _sweeps(root)
    numbers = sorted(runs["run"].unique())
    head = "| width | " + " | ".join(f"run {n}: roofline / re-timed (speedup)" for n in numbers) + " |"
    lines = [head, "|" + " --- |" * (len(numbers) + 1)]
    for width, rows in runs.groupby("width"):
        cells = [f"{_pct(r.prediction_error)} / {_pct(r.retimed_error)} ({r.speedup:.2f})"
                 for r in rows.sort_values("run").itertuples()]
        lines.append(f"| {width} | " + " | ".join(cells) + " |")
    for column, name in (("prediction_error", "roofline"), ("retimed_error", "re-timed")):
        cells = []
        for _, run in runs.groupby("run"):
            inside = (run[column].abs() <= TOLERANCE).sum()
            worst = run.loc[run[column].abs().idxmax()]
            cells.append(f"{inside} of {len(run)} (worst {worst.width}: {_pct(worst[column])})")
        lines.append(f"| within {TOLERANCE * 100:.0f} %, {name} | " + " | ".join(cells) + " |")
    starts = "; ".join(f"run {r.run} started {r.started}, load {r.load}"
                       for r in runs.drop_duplicates("run").itertuples())
    return ("\n".join(lines) + f"\n\n{_runs_text(runs)} (`{SWEEPS}`); the load average at the start and after "
            f"each round: {starts}.")


def _ft(root: Path) -> tuple[pd.DataFrame, dict]:
    rows = pd.read_csv(root / FT_RECOVERY)
    return rows, ft_against_elastic(rows.to_dict("records"))


def _verdict(values: Sequence[float], target: float) -> str:
    """met / not met against an upper target, or unresolved where the interval holds the target."""
    interval = median_interval(values)
    if interval.lo <= target <= interval.hi:
        return "unresolved: the target lies inside the interval"
    return "met" if median(values) <= target else "not met"


def _ratio(values: Sequence[float]) -> str:
    return f"{median(values):.3f} [{_interval_text(values)}]"


def ft_recovery(root: Path) -> str:
    """One line: ft against elastic per SIGKILL under both timeout settings, and what ft costs without faults."""
    _, s = _ft(root)
    tuned, torchft, e = s["tuned"], s["torchft"], s["elastic"]
    return (f"`ft` loses {_ratio(tuned['ratios'])} of `elastic`'s time per SIGKILL ({tuned['lost_s']:.2f} s "
            f"against {e['lost_s']:.2f} s; target ≤ {FT_TARGET:g}: {_verdict(tuned['ratios'], FT_TARGET)}); with "
            f"torchft's default timeouts {_ratio(torchft['ratios'])} ({torchft['lost_s']:.2f} s): "
            f"{_verdict(torchft['ratios'], FT_TARGET)}. Without faults `ft`'s training span per step is "
            f"{median(s['span_ratios']):.2f}× `elastic`'s (elastic's snapshots included; the step alone "
            f"{median(s['step_ratios']['elastic']):.2f}×), so with tuned timeouts it finishes first only while faults "
            f"come more often than every {tuned['break_even_steps']:,.0f} steps; each fault drops "
            f"{tuned['samples_lost']:g} samples")


def ft_recovery_table(root: Path) -> str:
    """Per tier and setting: time lost per SIGKILL, steps redone, samples lost and the ratio to elastic."""
    rows, s = _ft(root)
    rows = rows[rows["round"] >= 0]

    def lost(variant: str) -> str:
        v = rows.loc[rows["variant"] == variant]
        return f"{v['lost_s'].median():.2f} s ({v['lost_s'].min():.2f}–{v['lost_s'].max():.2f})"

    def redone(variant: str) -> str:
        v = rows.loc[rows["variant"] == variant, "redone_steps"]
        return span(v, "{:.0f}").replace("–", " to ")

    lines = [f"| | time lost per SIGKILL: median (min–max of {s['rounds']} rounds) | steps redone | samples lost | "
             f"`ft` / `elastic`, per round | target ≤ {FT_TARGET:g} |", "| --- | --- | --- | --- | --- | --- |",
             f"| `elastic` (the world restarts from its snapshot) | {lost('elastic_killed')} | "
             f"{redone('elastic_killed')} | 0 (redone at the full batch) | | |"]
    for setting, name in (("torchft", "torchft's timeouts"), ("tuned", "tuned timeouts")):
        f = s[setting]
        lines.append(f"| `ft`, {name} | {lost(f'ft_{setting}_killed')} | {redone(f'ft_{setting}_killed')} | "
                     f"{f['samples_lost']:g} | **{median(f['ratios']):.3f}** [{_interval_text(f['ratios'])}] | "
                     f"{_verdict(f['ratios'], FT_TARGET)} |")
    return "\n".join(lines)


def ft_without_faults(root: Path) -> str:
    """One line: the clean runs' steps and ft's ratios to ddp and elastic."""
    _, s = _ft(root)
    step = {k: s[k]["step_s"] * 1e3 for k in ("ddp", "elastic", "tuned", "torchft")}
    return (f"`ddp` {step['ddp']:.2f} ms, `elastic` {step['elastic']:.2f} ms, `ft` {step['tuned']:.2f} ms (tuned; "
            f"{step['torchft']:.2f} ms torchft's); per round `ft` / `ddp` {_ratio(s['step_ratios']['ddp'])} and "
            f"`ft` / `elastic` {_ratio(s['step_ratios']['elastic'])}; measured as the training span per step, which "
            f"includes `elastic`'s snapshots, `ft` / `elastic` is {_ratio(s['span_ratios'])} "
            f"({s['tuned']['span_step_s'] * 1e3:.2f} ms against {s['elastic']['span_step_s'] * 1e3:.2f} ms)")


def ft_break_even(root: Path) -> str:
    """One line: the break-even arithmetic with tuned timeouts."""
    _, s = _ft(root)
    t, e = s["tuned"], s["elastic"]
    return (f"({e['lost_s']:.2f} − {t['lost_s']:.2f}) s / ({t['span_step_s'] * 1e3:.2f} − "
            f"{e['span_step_s'] * 1e3:.2f}) ms = **{t['break_even_steps']:,.0f} steps**")


def _diloco_label(r: Any) -> str:
    name = "DDP" if not r.h else f"DiLoCo H = {r.h}"
    if r.fragments > 1:
        name += f", streaming ({r.fragments} fragments)"
    if r.comm_dtype != "fp32":
        name += f", {r.comm_dtype} pseudo-gradients"
    link = f"{r.link_mbit / 1000:g} Gbit/s" if r.link_mbit >= 1000 else f"{r.link_mbit:g} Mbit/s"
    return f"{name}, {link}"


def diloco_link_table(root: Path) -> str:
    """Per run of ``benchmarks/diloco_link.py``: bytes per step, held-out loss and time to DDP's, per seed."""
    rows = pd.read_csv(root / DILOCO)
    seeds = sorted(rows["seed"].unique())
    per_seed = " / ".join(str(s) for s in seeds)
    lines = [f"| run | outer lr | bytes per step (recorded) | / DDP's (arithmetic) | held-out loss after "
             f"{rows['samples'].iloc[0]:,} samples, seeds {per_seed} | time to DDP's held-out loss (s), seeds "
             f"{per_seed} | / DDP's time |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for variant in rows.sort_values(["seed", "round", "order"])["variant"].drop_duplicates():
        v = rows[rows["variant"] == variant].sort_values("seed")
        r = v.iloc[0]
        times = ["not reached" if pd.isna(t) else f"{t:.2f}" for t in v["time_to_target_s"]]
        ratios = ["—" if pd.isna(t) else f"{t:.3g}" for t in v["time_ratio"]]
        lines.append(f"| {_diloco_label(r)} | {'—' if pd.isna(r.outer_lr) else f'{r.outer_lr:g}'} | "
                     f"{r.payload_bytes_per_step / 1e6:.4g} MB | {r.bytes_ratio:.4g} ({r.bytes_ratio_arithmetic:.4g})"
                     f" | {' / '.join(f'{x:.3f}' for x in v['heldout_final'])} | "
                     f"{'not reached on any seed' if set(times) == {'not reached'} else ' / '.join(times)} | "
                     f"{'—' if set(ratios) == {'—'} else ' / '.join(ratios)} |")
    return "\n".join(lines)


def diloco_link(root: Path) -> str:
    """One line: whether DiLoCo at its best H reached DDP's held-out loss in time, seed by seed, and the codes."""
    rows = pd.read_csv(root / DILOCO)
    slow = rows["link_mbit"].min()  # the benchmark's slow link, where DiLoCo is meant to pay
    best = best_h(rows.to_dict("records"), slow)
    v = rows[rows["variant"] == best].sort_values("seed")
    met = verdict(list(v["time_ratio"]), DILOCO_BOUND)["met"]
    reached = v.dropna(subset=["time_ratio"])
    missed = v[v["time_ratio"].isna()]
    fp32 = rows[(rows["h"] == v["h"].iloc[0]) & (rows["fragments"] == 1) & (rows["link_mbit"] == slow)]
    quantised = fp32[fp32["comm_dtype"].isin(["int8", "fp8"])]
    base = fp32[fp32["comm_dtype"] == "fp32"].set_index("seed")["heldout_final"]
    gap = (quantised.set_index("seed")["heldout_final"] - base).abs().max()
    above = " and ".join(f"{x:.3f}" for x in missed["heldout_final"] - missed["target_heldout"])
    seeds = f"{len(reached)} seed{'' if len(reached) == 1 else 's'} of {len(v)}"
    return (f"DiLoCo (H = {v['h'].iloc[0]}) reaches DDP's final held-out loss on {seeds}"
            + (f", there in {span(reached['time_ratio'], '{:.3f}')} of the time DDP takes to first reach it"
               if len(reached) else "")
            + (f"; on the others it ends {above} above it" if len(missed) else "")
            + f" (target ≤ {DILOCO_BOUND:g} of DDP's time on every seed: {'met' if met else 'not met'}). Bytes per "
            f"step 1/H of DDP's (arithmetic); int8 or fp8 pseudo-gradients send 1/"
            f"{1 / quantised['bytes_ratio'].iloc[0] * v['bytes_ratio'].iloc[0]:.1f} of fp32's, held-out loss within "
            f"{gap:.4f}")


def costmodel_error(root: Path) -> str:
    """One line: the cost model's median and worst error over the counted points, against its targets."""
    s = summary(pd.read_csv(root / COSTMODEL))
    return (f"median error {100 * s['median_error']:.1f} %, worst {100 * s['max_error']:.1f} % over "
            f"{s['counted']} counted points (targets ≤ {100 * s['median_target']:.0f} % and "
            f"≤ {100 * s['max_target']:.0f} %: {'met' if s['passed'] else 'not met'})")


def costmodel_error_table(root: Path) -> str:
    """Per point: the bucket cap, the predicted and measured step, the error and whether it is counted."""
    lines = ["| point | bucket cap (MB) | predicted (ms) | measured (ms) | error | counted |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in pd.read_csv(root / COSTMODEL).itertuples():
        counted = "yes" if r.counted else f"no: {r.world_size} ranks on 2 cores" if r.oversubscribed else "no"
        lines.append(f"| {r.label.replace(' (oversubscribed)', '')} | {r.bucket_cap_mb:g} | "
                     f"{1e3 * r.predicted_s:.1f} | {1e3 * r.measured_s:.1f} | {_pct(r.signed_error, 1)} | {counted} |")
    return "\n".join(lines)


def planner_validation(root: Path) -> str:
    """One line: the planner against published runs, out of sample (leave one source out) and in-sample."""
    rows = pd.read_csv(root / PLANNER)
    scored = rows[rows["scored"].astype(bool)]

    def errors(column: str) -> tuple[float, float]:
        e = scored[column]
        return float(e.abs().median()), float(e.loc[e.abs().idxmax()])

    (med, worst), (med_in, worst_in) = errors("error"), errors("error_in_sample")
    met = med <= TARGETS[0] and abs(worst) <= TARGETS[1]
    return (f"{len(rows)} runs on {rows['gpus'].min():,} to {rows['gpus'].max():,} GPUs from "
            f"{rows['source'].nunique()} sources, each at its published layout, {len(scored)} scored; each source "
            f"predicted with the constants (one per GPU die) refitted without it: median error {100 * med:.1f} %, "
            f"worst {_pct(worst, 1)} (targets ≤ {100 * TARGETS[0]:.0f} %, ≤ {100 * TARGETS[1]:.0f} %: "
            f"{'met' if met else 'not met'}; in-sample {100 * med_in:.1f} %, {_pct(worst_in, 1)})")


def demo_compare_table(root: Path) -> str:
    """The demo's comparison, one row per tier (``python -m dtlab compare``'s compare.csv)."""
    lines = ["| tier | world | median step (ms) | samples/s | final loss | test acc. | max \\|Δparam\\| vs single | "
             "collectives/step |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in pd.read_csv(root / DEMO).itertuples():
        diff = "0" if r.max_param_diff_vs_single == 0 else f"{r.max_param_diff_vs_single:.1e}".replace("e-0", "e-")
        lines.append(f"| {r.tier} | {r.world_size} | {r.median_step_ms:.2f} | {r.samples_per_s:,.0f} | "
                     f"{r.final_loss:.4f} | {r.test_accuracy:.3f} | {diff} | {r.collectives_per_step:.3g} |")
    return "\n".join(lines)


def demo_compare(root: Path) -> str:
    """One line: the demo's parallel tiers against one process, and ddp-naive against ddp."""
    d = pd.read_csv(root / DEMO).set_index("tier")
    parallel = d[d["world_size"] > 1]
    slower = (parallel["speedup"] < 1).sum()
    who = "every parallel tier" if slower == len(parallel) else f"{slower} of {len(parallel)} parallel tiers"
    ms = d["median_step_ms"]
    return (f"{who} slower than one process (`ddp` {ms['ddp']:.2f} ms, `single` {ms['single']:.2f} ms a step, "
            f"one run; `ddp-naive` {ms['ddp-naive'] / ms['ddp']:.1f}× `ddp`'s step)")


def link_sweep(root: Path) -> str:
    """One line: what a slow link costs DDP, and what PowerSGD and fp16 compression win back, per round."""
    runs = pd.read_csv(root / LINK_SWEEP)
    slow, delay = runs["link_mbit"].min(), runs["link_delay_ms"].max()
    slowdown = multinode.slowdown(runs, slow)
    psgd, psgd_delayed = (multinode.step_ratios(runs, "powersgd", slow, d) for d in (0.0, delay))
    fp16_delayed = multinode.step_ratios(runs, "fp16", slow, delay)
    held = runs[(runs["link_mbit"] == slow) & (runs["link_delay_ms"] == 0)].pivot(
        index="seed", columns="comm_hook", values="eval_loss")
    worse = (held["powersgd"] > held["allreduce"]).sum()
    return (f"{median(slowdown):.1f}× slower at {slow:g} Mbit/s than at 10 Gbit/s; PowerSGD takes the step to "
            f"{_ratio(psgd)} of the all-reduce's, but with {delay:g} ms of delay each way only to "
            f"{median(psgd_delayed):.2f} (its chained all-reduces pay the delay each time; fp16 "
            f"{median(fp16_delayed):.2f}), and its held-out loss is worse on "
            f"{'every seed' if worse == len(held) else f'{worse} of {len(held)} seeds'} (fp16's within "
            f"{(held['fp16'] - held['allreduce']).abs().max():.3f})")


def _pct(x: float, digits: int = 0) -> str:
    value = round(100 * x, digits) + 0  # + 0: no "-0 %"
    return f"{value:+.{digits}f} %".replace("-", "−")



QUOTES: dict[str, Callable[[Path], str]] = {
    "recording-cost": recording_cost,
    "recording-cost-line": recording_cost_line,
    "costmodel-error": costmodel_error,
    "costmodel-error-table": costmodel_error_table,
    "demo-compare": demo_compare,
    "demo-compare-table": demo_compare_table,
    "diloco-link": diloco_link,
    "diloco-link-table": diloco_link_table,
    "ft-recovery": ft_recovery,
    "ft-recovery-table": ft_recovery_table,
    "ft-without-faults": ft_without_faults,
    "ft-break-even": ft_break_even,
    "link-sweep": link_sweep,
    "planner-validation": planner_validation,
    "width-sweep": width_sweep,
    "width-sweep-predictions": width_sweep_predictions,
    "width-sweep-runs": width_sweep_runs,
}
QUOTES.update(MORE)  # goodput's quotes, kept in their own module
QUOTES.update(DOCS)  # the tiers page's, in theirs
QUOTES.update(MEASURE)  # the measurement page's
QUOTES.update(FAULTS)  # and its faults' and slow links'
QUOTES.update(PARITY_QUOTES)  # parity, per tier and per job
QUOTES.update(REST)  # the measurement page's smaller figures beside its tables
