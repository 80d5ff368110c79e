"""Checking the step model against real DDP runs: the code that starts runs, and the validation of them.

    python -m dtlab.experiments.ddp_steps [--world-sizes 1,2] [--rounds 3] [--quick]

``measure`` (loopback) and ``measure_links`` (simulated hosts behind capped
links) run every point, interleaved round after round, and keep each run as
plain numbers (``run_numbers``); ``validate`` and ``validate_links`` predict
each point from those numbers and compare; ``summary`` says whether the
errors meet the targets.

Bucket sizes travel as lists of ints (``run_numbers``'s ``bucket_sizes_bytes``,
as the ddp tier's ``describe()`` reports them); only ``read_runs``, which
reads a runs frame back from a CSV file, parses them from text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dtlab.core.config import RunConfig, shared_threads
from dtlab.cost.estimate.calibration import calibrate_link
from dtlab.cost.estimate.probe import TIMED_STEPS, loop_phases
from dtlab.cost.links.alpha_beta import LinkModel, capped, check_world_size
from dtlab.cost.links.buckets import COMPUTE_PHASES, predict_ddp_step, spare_cores
from dtlab.experiments import simlinks
from dtlab.train import run

__all__ = ["MAX_TARGET", "MEDIAN_TARGET", "WARMUP_STEPS", "ddp_overhead", "measure", "measure_links",
           "overhead_batch", "overhead_from", "read_runs", "run_numbers", "summary", "summary_line", "validate",
           "validate_links", "validate_rounds"]

MEDIAN_TARGET, MAX_TARGET = 0.15, 0.30  # validation targets: median and worst relative error
# More warm-up than RunResult.steady's default (1), on purpose: step 0 builds DDP's buckets and the next steps
# still warm caches, which a few-ms step measured against a prediction feels; the cost model's validated errors
# (docs/measurement.md, benchmarks/costmodel_error.py) were measured with 3.
WARMUP_STEPS = 3


# -- measured runs as plain numbers -----------------------------------------------------------------------
def run_numbers(result: Any, warmup_steps: int = WARMUP_STEPS) -> dict[str, Any]:
    """What the cost model needs from one RunResult: step and phase medians, gradient bytes, buckets.

    A step's time is its slowest rank's; phases are the slowest rank's per step.
    ``bucket_sizes_bytes`` is a list of ints (empty for a run without DDP).
    """
    per_step = result.steady(warmup_steps).groupby("step")[["total", *COMPUTE_PHASES]].max()
    cfg = result.config
    sizes = [int(s) for s in result.ranks[0].strategy.get("bucket_sizes_bytes", [])]
    return {"tier": cfg.tier, "world_size": cfg.world_size, "per_rank_batch": cfg.per_rank_batch,
            "global_batch": cfg.global_batch_size, "threads_per_rank": cfg.resolved_threads,
            "bucket_cap_mb": float(getattr(cfg.tier_options, "bucket_cap_mb", float("nan"))),
            "step_s": float(per_step["total"].median()),
            **{p: float(per_step[p].median()) for p in COMPUTE_PHASES},
            "gradient_bytes": int(result.ranks[0].memory.get("gradients", 0)),
            "buckets": len(sizes), "bucket_sizes_bytes": sizes,
            "steps_measured": int(len(per_step))}


def _bucket_sizes(value: Any) -> list[int]:
    if isinstance(value, str):
        raise ValueError(f"bucket_sizes_bytes={value!r} is text, not a list of ints: read a runs CSV with "
                         "ddp_steps.read_runs(path)")
    return [int(v) for v in value]


def ddp_overhead(single: Mapping[str, Any], ddp_world1: Mapping[str, Any]) -> float:
    """DDP's own per-step cost per gradient byte (s/byte), from two world-size-1 runs of the same job.

    ``single`` and ``ddp_world1`` are ``run_numbers`` of a ``single`` run and a
    ``ddp`` run at world size 1 (no communication), same model and batch: the
    difference is what DDP adds locally. Clipped at 0: noise may make it negative.
    """
    if int(ddp_world1["world_size"]) != 1 or int(single["world_size"]) != 1:
        raise ValueError("ddp_overhead needs two world-size-1 runs: the single run and a ddp run without peers")
    grad = sum(_bucket_sizes(ddp_world1["bucket_sizes_bytes"])) or int(single["gradient_bytes"])
    if grad <= 0:
        raise ValueError("ddp_overhead: the runs report no gradient bytes")
    return max(0.0, float(ddp_world1["step_s"]) - float(single["step_s"])) / grad


def _sizes_from_text(cell: Any) -> list[int]:
    if not isinstance(cell, str) or not cell.strip():  # NaN: a run without DDP buckets
        return []
    if cell.lstrip().startswith("["):  # written from a list: "[4000, 4000, 2000]"
        return [int(v) for v in json.loads(cell)]
    return [int(v) for v in cell.split()]  # CSVs written before the sizes were typed: "4000 4000 2000"


def read_runs(path: str | os.PathLike[str]) -> pd.DataFrame:
    """A runs frame (``measure``'s, as ``benchmarks/costmodel_error.py`` writes it) read back from a CSV file.

    The one place that parses bucket sizes from text: a CSV cell holds the list
    as ``[4000, 4000, 2000]``, or, in files written before the sizes were
    typed, as ``4000 4000 2000``; either becomes a list of ints again.
    """
    runs = pd.read_csv(Path(path))
    if "bucket_sizes_bytes" in runs.columns:
        runs["bucket_sizes_bytes"] = [_sizes_from_text(cell) for cell in runs["bucket_sizes_bytes"]]
    return runs


# -- measuring the validation points ------------------------------------------------------------------------
def measure(cfg: Any, world_sizes: Sequence[int] = (1, 2, 4), rounds: int = 3, *,
            bucket_caps_mb: Sequence[float] | None = None, warmup_steps: int = WARMUP_STEPS,
            log: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Run everything ``validate`` needs, interleaved round after round, and return it as plain numbers.

    ``cfg``: a ``ddp`` RunConfig at the global batch every validation point
    keeps (its world_size is ignored). ``bucket_caps_mb``: the DDP bucket caps
    to validate (default: ``cfg``'s). Per round: for each world size n, a
    ``single`` run at the per-rank batch global/n (the compute that n ranks each
    do), timed in n processes at once as the n ranks share the machine
    (``compute_together``), and, per cap, the ``ddp`` run at n; and the overhead calibration -- a
    ``single`` and, per cap, a ``ddp`` run at world size 1 with a batch no
    validation point uses. Rows: round, role (compute, ddp, overhead_single,
    overhead_ddp), bucket_cap_mb and ``run_numbers``.
    """
    if cfg.tier != "ddp":
        raise ValueError(f"measure needs a ddp RunConfig, got tier {cfg.tier!r}")
    for n in world_sizes:
        check_world_size(n, "world_sizes entry")
        if cfg.global_batch_size % n:
            raise ValueError(f"global_batch_size={cfg.global_batch_size} is not divisible by world size {n}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    caps = tuple(bucket_caps_mb) if bucket_caps_mb is not None else (cfg.tier_options.bucket_cap_mb,)
    if not caps or any(not c > 0 for c in caps):
        raise ValueError(f"bucket_caps_mb={bucket_caps_mb!r} is invalid: give one or more caps > 0 MB")
    plan = _measure_plan(cfg, tuple(world_sizes), caps)
    rows = []
    for r in range(rounds):
        for role, run_cfg, copies in plan:
            rows.append({"round": r, "role": role, **_run(run_cfg, warmup_steps, copies)})
        if log is not None:
            log(f"round {r + 1}/{rounds} done ({len(plan)} runs)")
    return pd.DataFrame(rows)


def overhead_batch(cfg: Any, world_sizes: Sequence[int]) -> int:
    """The batch of the overhead calibration: half the smallest per-rank batch, so no validation point uses it."""
    return max(1, cfg.global_batch_size // (2 * max(world_sizes)))


def _measure_plan(cfg: Any, world_sizes: tuple[int, ...], caps: tuple[float, ...]) -> list[tuple[str, Any, int]]:
    """``(role, RunConfig, copies)``: the compute of world size n is timed in n copies at once (``_run``)."""
    single = {"tier": "single", "world_size": 1}
    with_cap = {c: cfg.replace(tier_options=dataclasses.replace(cfg.tier_options, bucket_cap_mb=c)) for c in caps}
    batch = overhead_batch(cfg, world_sizes)
    plan = []
    for n in world_sizes:  # each point's ddp runs right after its compute: this machine's speed drifts within minutes
        # each rank's threads, as the ddp run at n gets them
        plan.append(("compute", cfg.replace(**single, global_batch_size=cfg.global_batch_size // n,
                                            threads_per_rank=cfg.threads_per_rank or shared_threads(n)), n))
        plan += [("ddp", with_cap[c].replace(world_size=n), 1) for c in caps]
    plan.append(("overhead_single", cfg.replace(**single, global_batch_size=batch), 1))
    plan += [("overhead_ddp", with_cap[c].replace(world_size=1, global_batch_size=batch), 1) for c in caps]
    return plan


def _run(cfg: Any, warmup_steps: int, copies: int = 1) -> dict[str, Any]:
    """One run's numbers, unrecorded (the model predicts training, not dtlab's instrumentation of it);
    ``copies > 1``: the compute of one of ``copies`` ranks, timed while the others run beside it (they
    share the cores, caches and memory bandwidth; ``compute_together``)."""
    if copies == 1:
        return run_numbers(run(cfg, progress=False, record=False), warmup_steps)
    return compute_together(cfg, copies)


def compute_together(cfg: Any, copies: int) -> dict[str, Any]:
    """``run_numbers``' columns for a ``single`` RunConfig timed in ``copies`` processes at once: dtlab's loop
    in each (``estimate.probe.loop_phases``), the slowest copy's phases. On two cores two ranks' compute
    side by side takes longer than one alone, and a DDP step at n is n ranks computing side by side."""

    phases = loop_phases(cfg, copies)
    return {"tier": cfg.tier, "world_size": cfg.world_size, "per_rank_batch": cfg.per_rank_batch,
            "global_batch": cfg.global_batch_size, "threads_per_rank": cfg.resolved_threads,
            "bucket_cap_mb": float("nan"), "step_s": sum(phases[p] for p in COMPUTE_PHASES),
            **{p: phases[p] for p in COMPUTE_PHASES}, "gradient_bytes": 0, "buckets": 0, "bucket_sizes_bytes": [],
            "steps_measured": TIMED_STEPS, "copies": copies}


def measure_links(cfg: Any, caps_mbit: Sequence[float], rounds: int = 3, *, nnodes: int = 2,
                  warmup_steps: int = WARMUP_STEPS, log: Callable[[str], None] | None = None) -> pd.DataFrame:
    """``measure`` for DDP across simulated hosts: one multinode run per link cap, interleaved per round.

    ``cfg``: a ``ddp`` RunConfig (its world_size is ignored; one rank per node).
    Besides the multinode runs (role ddp, column link_mbit), each round runs
    the same compute and overhead calibration as ``measure``, all on this
    machine without a network. Needs root (see ``dtlab.experiments.simlinks``).
    """
    if cfg.tier != "ddp":
        raise ValueError(f"measure_links needs a ddp RunConfig, got tier {cfg.tier!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    multinode = simlinks.link_configs(cfg.replace(world_size=nnodes), caps_mbit, ("allreduce",), nnodes=nnodes)
    plan = [entry for entry in _measure_plan(cfg, (nnodes,), (cfg.tier_options.bucket_cap_mb,))
            if entry[0] != "ddp"]
    plan[1:1] = [("ddp", c, 1) for c in multinode]  # right after the compute they are predicted from
    rows = []
    for r in range(rounds):
        for role, run_cfg, copies in plan:
            mbit = float(getattr(run_cfg.tier_options, "link_mbit", float("nan")))
            rows.append({"round": r, "role": role, "link_mbit": mbit if role == "ddp" else float("nan"),
                         **_run(run_cfg, warmup_steps, copies)})
        if log is not None:
            log(f"round {r + 1}/{rounds} done ({len(plan)} runs)")
    return pd.DataFrame(rows)


# -- validation ----------------------------------------------------------------------------------------------
def _medians(frame: pd.DataFrame) -> dict[str, float]:
    return {c: float(frame[c].median()) for c in ("step_s", *COMPUTE_PHASES)}


def _same_cap(runs: pd.DataFrame, cap: float | None) -> pd.Series:
    if cap is None or "bucket_cap_mb" not in runs.columns:
        return pd.Series(True, index=runs.index)
    return runs["bucket_cap_mb"] == cap


def overhead_from(runs: pd.DataFrame, bucket_cap_mb: float | None = None) -> float:
    """DDP's per-gradient-byte overhead from ``measure``'s overhead rows (median over rounds) at one cap."""
    single = runs[runs["role"] == "overhead_single"]
    ddp = runs[(runs["role"] == "overhead_ddp") & _same_cap(runs, bucket_cap_mb)]
    if single.empty or ddp.empty:
        raise ValueError(f"the runs have no overhead_single/overhead_ddp rows (bucket_cap_mb={bucket_cap_mb!r}): "
                         "make them with ddp_steps.measure")
    return ddp_overhead({**single.iloc[0].to_dict(), **_medians(single)}, {**ddp.iloc[0].to_dict(), **_medians(ddp)})


def validate(link: LinkModel, runs: pd.DataFrame, *, cores: int | None = None,
             overhead_s_per_byte: float | None = None, overhead_runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Predicted against measured DDP step time, one row per (world size, bucket cap) in ``measure``'s frame.

    Each prediction uses only the ``single`` run at that point's per-rank batch
    (its compute), the ddp run's bucket sizes (a layout, not a time), the link
    and DDP's overhead measured at world size 1 on another batch (or
    ``overhead_s_per_byte``; from ``overhead_runs`` where given, e.g. every round
    while ``runs`` is one); the measured DDP times are never used to predict.
    A point with more threads than ``cores`` (default: this machine's) is
    marked oversubscribed: the model assumes each rank has its own cores, so it
    is reported but not counted. Columns: label, world_size, bucket_cap_mb,
    predicted_s, measured_s, error (|relative|), signed_error, oversubscribed,
    counted and the predicted parts.
    """
    if not isinstance(runs, pd.DataFrame) or runs.empty:
        raise ValueError("validate: the runs frame is empty: make it with ddp_steps.measure(...)")
    cores = cores or os.cpu_count() or 1
    ddp = runs[runs["role"] == "ddp"]
    if ddp.empty:
        raise ValueError("validate: the runs frame has no ddp rows: make it with ddp_steps.measure(...)")
    caps = ddp["bucket_cap_mb"] if "bucket_cap_mb" in ddp.columns else pd.Series(np.nan, index=ddp.index)
    rows = []
    for cap in pd.unique(caps):
        cap = None if pd.isna(cap) else float(cap)
        gamma = (overhead_from(runs if overhead_runs is None else overhead_runs, cap)
                 if overhead_s_per_byte is None else float(overhead_s_per_byte))
        for n in sorted(set(ddp.loc[_same_cap(ddp, cap), "world_size"])):
            rows.append(_validation_row(link, runs, int(n), cap, gamma, cores))
    return pd.DataFrame(rows)


def _label(n: int, buckets: int, over: bool) -> str:
    return f"n={n}, {buckets} bucket{'s' if buckets != 1 else ''}" + (" (oversubscribed)" if over else "")


def _validation_row(link: LinkModel, runs: pd.DataFrame, n: int, cap: float | None, gamma: float,
                    cores: int) -> dict[str, Any]:
    ddp = runs[(runs["role"] == "ddp") & (runs["world_size"] == n) & _same_cap(runs, cap)]
    batch = int(ddp["per_rank_batch"].iloc[0])
    compute = runs[(runs["role"] == "compute") & (runs["per_rank_batch"] == batch)]
    if compute.empty:
        raise ValueError(f"validate: no single run at the per-rank batch {batch} of world size {n}")
    sizes = _bucket_sizes(ddp["bucket_sizes_bytes"].iloc[0])
    threads = int(ddp["threads_per_rank"].iloc[0])
    pred = predict_ddp_step(_medians(compute), sizes, link, n, overhead_s=gamma * sum(sizes),
                            overlap=spare_cores(n, threads, cores))
    measured = float(ddp["step_s"].median())
    over = n * threads > cores
    return {"label": _label(n, len(sizes), over), "world_size": n,
            "bucket_cap_mb": float("nan") if cap is None else cap,
            "predicted_s": pred.step_s, "measured_s": measured, "error": abs(pred.step_s / measured - 1),
            "signed_error": pred.step_s / measured - 1, "oversubscribed": over, "counted": not over,
            "compute_s": pred.compute_s, "comm_s": pred.comm_s, "exposed_comm_s": pred.exposed_comm_s,
            "overhead_s": pred.overhead_s, "buckets": len(sizes), "gradient_bytes": sum(sizes),
            "per_rank_batch": batch, "threads_per_rank": threads, "rounds": int(ddp["round"].nunique()),
            "measured_spread_s": float(ddp["step_s"].max() - ddp["step_s"].min())}


def validate_links(link: LinkModel, runs: pd.DataFrame, *, cores: int | None = None,
                   overhead_runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """``validate`` for ``measure_links``' frame: each cap predicted with ``capped(link, cap)``.

    The link is the loopback calibration; the cap enters only through ``capped``
    -- nothing is fitted on the multinode runs.
    """
    if "link_mbit" not in runs.columns:
        raise ValueError("validate_links: the runs have no link_mbit column: make them with measure_links")
    ddp = runs[runs["role"] == "ddp"]
    if ddp.empty:
        raise ValueError("validate_links: the runs frame has no multinode (ddp) rows")
    cores = cores or os.cpu_count() or 1
    cap_mb = float(ddp["bucket_cap_mb"].iloc[0])
    gamma = overhead_from(runs if overhead_runs is None else overhead_runs, cap_mb)
    rows = []
    for mbit in sorted(ddp["link_mbit"].unique(), reverse=True):
        keep = (runs["role"] != "ddp") | (runs["link_mbit"] == mbit)
        n = int(ddp.loc[ddp["link_mbit"] == mbit, "world_size"].iloc[0])
        row = _validation_row(capped(link, float(mbit)), runs[keep], n, cap_mb, gamma, cores)
        label = f"n={n}, {simlinks.mbit_label(mbit)} simulated hosts" + (" (oversubscribed)" if row["oversubscribed"]
                                                                           else "")
        rows.append({**row, "label": label, "link_mbit": float(mbit)})
    return pd.DataFrame(rows)


_ROUND_MEDIANS = ("predicted_s", "measured_s", "signed_error", "compute_s", "comm_s", "exposed_comm_s",
                  "overhead_s")


def validate_rounds(check: Callable[..., pd.DataFrame], links: Mapping[int, LinkModel], runs: pd.DataFrame,
                    **kwargs: Any) -> pd.DataFrame:
    """``check`` (``validate`` or ``validate_links``) round by round: each round's runs predicted with that
    round's link (``links[round]``, e.g. its own ``busy_s``), DDP's overhead from every round. A point's
    predicted_s, measured_s and signed_error are then the medians over rounds, the error of each round
    being its prediction against the same round's measurement: a machine whose speed drifts from round to
    round moves both. ``error`` is the median's magnitude, ``rounds`` how many rounds had the point."""
    if "round" not in runs.columns or runs.empty:
        raise ValueError("validate_rounds: the runs need a round column: make them with ddp_steps.measure")
    missing = sorted(set(runs["round"]) - set(links))
    if missing:
        raise ValueError(f"validate_rounds: no link for round(s) {missing}")
    per = pd.concat([check(links[r], runs[runs["round"] == r], overhead_runs=runs, **kwargs)
                     for r in sorted(runs["round"].unique())], ignore_index=True)
    by_point = per.groupby("label", sort=False)
    out = by_point.first()
    out[list(_ROUND_MEDIANS)] = by_point[list(_ROUND_MEDIANS)].median()
    out["error"] = out["signed_error"].abs()
    out["rounds"] = by_point.size()
    out["measured_spread_s"] = by_point["measured_s"].max() - by_point["measured_s"].min()
    return out.reset_index()


def summary(df: pd.DataFrame, median_target: float = MEDIAN_TARGET, max_target: float = MAX_TARGET) -> dict[str, Any]:
    """Median and worst error over the counted points, and whether they meet the targets."""
    for col in ("error", "counted"):
        if col not in df.columns:
            raise ValueError(f"summary: missing column {col!r}: pass validate()'s frame")
    counted = df[df["counted"].astype(bool)]
    if counted.empty:
        raise ValueError("summary: no counted points (every point is oversubscribed)")
    med, worst = float(counted["error"].median()), float(counted["error"].max())
    return {"median_error": med, "max_error": worst, "counted": len(counted), "reported": len(df),
            "median_target": median_target, "max_target": max_target,
            "median_ok": med <= median_target, "max_ok": worst <= max_target,
            "passed": med <= median_target and worst <= max_target}


def summary_line(df: pd.DataFrame) -> str:
    """The summary in one sentence, with the numbers of this run."""
    s = summary(df)
    verdict = "meets" if s["passed"] else "misses"
    return (f"median error {s['median_error']:.1%} (target <= {s['median_target']:.0%}), worst "
            f"{s['max_error']:.1%} (target <= {s['max_target']:.0%}) over {s['counted']} counted of "
            f"{s['reported']} points: {verdict} the targets")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.ddp_steps", description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a quick link sweep: a smoke test")
    args = p.parse_args(argv)
    sizes = tuple(int(w) for w in args.world_sizes.split(",") if w.strip())
    cfg = RunConfig(tier="ddp", world_size=max(sizes), model_size=256, steps=12, global_batch_size=128,
                    threads_per_rank=1)
    link = calibrate_link(2, ("all_reduce",), quick=args.quick).default
    runs = measure(cfg, sizes, rounds=args.rounds, log=print)
    df = validate(link, runs)
    with pd.option_context("display.width", 200):
        print(df.to_string(index=False))
    print(summary_line(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
