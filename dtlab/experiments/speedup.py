"""When does data parallelism pay? DDP at world size n against one process, swept over model width.

``compare`` (notebook 01, ``make demo``) shows every parallel tier slower than
one process on the width-64 MLP: its step is a millisecond of compute and a
fixed cost of communication. ``speedup_sweep`` asks the follow-up question:
at which width does ``ddp`` on n ranks beat ``single``?

**The fair baseline.** Both sides get the same cores and the same global
batch. ``single`` runs one process with every core (``threads_per_rank =
cores``); ``ddp`` runs n processes with ``cores // n`` threads each, so each
rank computes ``global_batch / n`` samples. On a 2-core machine that is
single on 2 threads against 2 DDP ranks on 1 thread each. A second reference,
``single`` on one thread (``single_1t_ms``), shows what DDP gains over a
process that leaves cores idle -- the comparison that flatters DDP.

**What grows with width.** For an MLP of width w the work per step (about
6 x batch x parameters FLOP) and the bytes all-reduced (4 x parameters) both
grow like w**2, so the compute per communicated byte is fixed by the batch,
not the width. What width changes is everything that does *not* grow like
w**2: the all-reduce's latency (alpha), DDP's per-step bookkeeping, Python and
kernel-launch overheads, and the poor FLOP rate of small matrices. The sweep
measures this as ``compute_ns_per_byte`` (one rank's compute time per
gradient byte: a ``single`` run at the per-rank batch on a rank's threads)
next to the link's ``beta`` (its time per byte): DDP can only pay where the
compute saved per byte is larger than the time the link takes per byte -- and
where one process on all cores leaves compute on the table.

**The prediction** is ``dtlab.estimate``'s step time, the one
``benchmarks/estimate_error.py`` checks: for each width it predicts the step of
the ``single`` job and of the ``ddp`` job (``predict_step_s``), and the
predicted speedup is their ratio. Its compute is *predicted*, not run: the ops
of a step at a rank's batch, counted on fake tensors (``roofline.ops``), on this
machine's measured roofline at the ranks' placement (``roofline.cpu``: 2
threads x 1 process for ``single``, 1 thread x 2 processes for ``ddp``), plus
eager PyTorch's measured cost per op. The roofline is measured once
(``python -m dtlab.cost.roofline``, saved in ``results/roofline``) and
reused; the sweep measures and saves it first if there is none for this
machine. The estimator then prices DDP's bucket all-reduces on the link, one
after another (none overlaps backward where the ranks' threads take every core:
``costmodel.spare_cores``), adds DDP's gradient copies and, once per step, the
link's ``busy_s``: what an all-reduce costs beyond its price when the ranks
compute between collectives, slow wake-ups included. The link is calibrated in
the same run with the estimator's own calibration (``estimate.calibration``:
an all_reduce sweep at world size n, then ``busy_s`` measured again as each
round starts). No measured step time enters a prediction.

**The re-timed comparison** (``retimed_*`` columns, the dashed line): the same
rule with the estimator's ``compute="timed"``, which runs a rank's compute here
(dtlab's loop at a rank's batch, in n processes at once for ddp) instead of
predicting it, so only communication is modelled there.

Runs are interleaved: each round runs every width (ascending, then
descending the next round) and, per width, every role -- the four measured
runs and the two predictions -- in a rotating order, so a burst of load from
elsewhere slows one round, not one width. A run's time is its median steady
step (``ddp_steps.WARMUP_STEPS`` steps left out). Per width, the measured
speedup is the median of the rounds' speedups (their min and max are the
spread); the prediction's error is the median of the rounds' errors, each
round's predicted speedup against the same round's measured one (this
machine's speed drifts between rounds and moves both alike). The target:
every width within ``TOLERANCE`` (``accuracy``).

``python -m dtlab.experiments.speedup --out DIR`` runs the sweep and writes
``crossover.csv`` and ``crossover.png`` there (``make demo`` does: not ``speedup.*``, which ``compare``
writes into the same folder). Reading the curve (crossover, verdict, the table) is ``speedup_read``'s.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.core.config import RunConfig
from dtlab.cost.estimate import estimate
from dtlab.cost.estimate.calibration import RoundLinks, calibrate_link
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.links.linkset import LinkSet
from dtlab.cost.roofline.cpu import DEFAULT_PATH, Roofline
from dtlab.cost.roofline.saved import machine_roofline
from dtlab.experiments import ddp_steps
from dtlab.plots import save
from dtlab.plots.crossover import speedup_curve
from dtlab.read.speedup import TOLERANCE, accuracy, closest_approach, crossover, format_table, verdict
from dtlab.train import run

__all__ = ["COLUMNS", "DEFAULT_WIDTHS", "QUICK_WIDTHS", "TOLERANCE", "accuracy", "baseline_text",
           "closest_approach", "crossover", "format_table", "main", "predict_step_s", "speedup_sweep", "verdict"]

DEFAULT_WIDTHS = (64, 128, 256, 512, 1024, 2048)
QUICK_WIDTHS = (64, 256, 1024)
GLOBAL_BATCH = 512  # large enough that compute dominates a width-2048 step, small enough for a few-minute sweep
STEPS, ROUNDS = 15, 3
QUICK_STEPS, QUICK_ROUNDS = 6, 1
# single and ddp make only all-reduces; calibrate_ops fits each op on its own rows, so other ops would add time only
LINK_OPS = ("all_reduce",)
# a prediction's role -> the run it predicts and how its compute is had: on the roofline, or re-timed here
PREDICTED = {"predicted_single": ("single", "roofline"), "predicted_ddp": ("ddp", "roofline"),
             "retimed_single": ("single", "timed"), "retimed_ddp": ("ddp", "timed")}
ROLES = ("single", "single_1t", "ddp", "compute", *PREDICTED)
COLUMNS = ("width", "params", "gradient_bytes", "buckets", "single_ms", "single_1t_ms", "ddp_ms", "speedup",
           "speedup_min", "speedup_max", "speedup_vs_1t", "compute_ms", "compute_ns_per_byte",
           "predicted_single_ms", "predicted_ddp_ms", "predicted_speedup", "prediction_error",
           "retimed_single_ms", "retimed_ddp_ms", "retimed_speedup", "retimed_error", "rounds")
Link = LinkModel | LinkSet


def _cores(cores: int | None) -> int:
    return int(cores or os.cpu_count() or 1)


def baseline_text(world_size: int, global_batch: int, cores: int | None = None) -> str:
    """The comparison in words, for titles and tables."""
    c = _cores(cores)
    per_rank = max(1, c // world_size)
    return (f"ddp: {world_size} ranks × {per_rank} thread{'s' if per_rank > 1 else ''} vs single: 1 process × "
            f"{c} thread{'s' if c > 1 else ''} ({c} cores), global batch {global_batch}")


def _plan(base: RunConfig, width: int, world_size: int, cores: int) -> dict[str, RunConfig]:
    cfg = base.replace(model_size=width)
    per_rank_threads = max(1, cores // world_size)
    return {
        "single": cfg.replace(tier="single", world_size=1, threads_per_rank=cores),
        "single_1t": cfg.replace(tier="single", world_size=1, threads_per_rank=1),
        "ddp": cfg.replace(tier="ddp", world_size=world_size, threads_per_rank=per_rank_threads),
        "compute": cfg.replace(tier="single", world_size=1, threads_per_rank=per_rank_threads,
                               global_batch_size=base.global_batch_size // world_size),
    }


def _say(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(progress):
        return progress
    return (lambda line: print(line, flush=True)) if progress else (lambda line: None)


def _check(widths: Sequence[int], world_size: int, global_batch: int, steps: int, rounds: int) -> list[int]:
    """The widths, sorted; ValueError naming a bad argument, before any process starts."""
    ws = sorted({int(w) for w in widths})
    if not ws or ws[0] < 1:
        raise ValueError(f"widths={ws!r} is invalid: give one or more widths >= 1")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size={world_size!r} is invalid: data parallelism needs at least 2 ranks")
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size={world_size} "
                         "(each rank computes an equal share)")
    warmup = ddp_steps.WARMUP_STEPS
    if not isinstance(steps, int) or steps < warmup + 2:
        raise ValueError(f"steps={steps!r} is invalid: need at least {warmup + 2} ({warmup} warm-up steps are "
                         "left out of every median)")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    return ws


def _links(link: Link | None, world_size: int, quick: bool, say: Callable[[str], None]) -> Callable[[int], Link]:
    """Each round's link: ``link`` as given (its busy_s included), else the estimator's, busy_s measured per round."""
    if link is not None:
        return lambda _round: link
    calibrated = calibrate_link(world_size, LINK_OPS, quick=quick)
    say(f"link: {calibrated.label}")
    return RoundLinks(calibrated, world_size, quick=quick, log=say)


def speedup_sweep(widths: Sequence[int] = DEFAULT_WIDTHS, *, world_size: int = 2, global_batch: int = GLOBAL_BATCH,
                  steps: int = STEPS, rounds: int = ROUNDS, depth: int = 2, optimizer: str = "sgd",
                  cores: int | None = None, link: Link | None = None, quick_link: bool = False,
                  roofline: Roofline | str | Path | None = None,
                  progress: bool | Callable[[str], None] = False) -> pd.DataFrame:
    """Measured and predicted speedup of ``ddp`` at ``world_size`` over ``single``, one row per MLP width.

    Columns (``COLUMNS``; times in ms, medians over ``rounds``): width, params,
    gradient_bytes, buckets; single_ms (one process on all ``cores``),
    single_1t_ms (one process, one thread), ddp_ms (``world_size`` ranks,
    ``cores // world_size`` threads each); speedup (single / ddp, the median of
    the rounds'), speedup_min and speedup_max (the rounds' spread),
    speedup_vs_1t (single_1t / ddp); compute_ms (one rank's compute: a single
    run at the per-rank batch on a rank's threads) and compute_ns_per_byte (that
    per gradient byte); predicted_single_ms and predicted_ddp_ms
    (``predict_step_s``), predicted_speedup (their ratio, the median of the
    rounds') and prediction_error (the median of the rounds' predicted /
    measured speedup - 1), with the compute predicted on this machine's roofline;
    retimed_single_ms, retimed_ddp_ms, retimed_speedup and retimed_error: the same
    with the compute re-timed (``compute="timed"``). ``frame.attrs`` holds the
    baseline in words, the link, busy_s per round, the roofline's date and load,
    the batch, cores, steps, rounds and the wall time.

    ``link``: a ``LinkModel`` or ``LinkSet`` to use in every round as it is,
    instead of calibrating one and measuring its ``busy_s`` per round;
    ``frame.attrs["load"]``: the load average at the start and after each round.
    ``quick_link``: a quick calibration, and a quick roofline where one must be
    measured (a smoke test, not a measurement). ``roofline``: a ``Roofline`` or
    the path of a saved one (``machine_roofline`` says what None does).
    ``progress``: True prints a line per round, a callable receives them. The
    MLP reads the synthetic 8x8 data set (64 inputs, 10 classes), ``depth``
    hidden layers of ``width`` units.
    """
    widths = _check(widths, world_size, global_batch, steps, rounds)
    c = _cores(cores)
    say = _say(progress)
    t0 = time.perf_counter()
    base = RunConfig(tier="single", model="mlp", model_depth=depth, dataset="synthetic",
                     dataset_size=max(4096, 4 * global_batch), global_batch_size=global_batch, steps=steps,
                     optimizer=optimizer)
    # every RunConfig is built (and so validated) before the first process starts
    plans = {w: _plan(base, w, world_size, c) for w in widths}
    roof = machine_roofline(roofline, quick_link, say)
    links = _links(link, world_size, quick_link, say)
    rows: list[dict[str, Any]] = []
    loads = [_load()]  # other work on the machine stalls a 2-thread process: say how much there was
    for r in range(rounds):
        round_link = links(r)
        order = widths if r % 2 == 0 else widths[::-1]
        for i, w in enumerate(order):
            k = (r + i) % len(ROLES)
            for role in ROLES[k:] + ROLES[:k]:
                rows.append({"round": r, "width": w, "role": role, **_one(role, plans[w], round_link, roof)})
        loads.append(_load())
        say(f"round {r + 1}/{rounds}: {len(widths)} widths × {len(ROLES)} runs and predictions, "
            f"{time.perf_counter() - t0:.0f} s, load average {loads[-1]:.2f}")
    frame = _frame(pd.DataFrame(rows), widths)
    first = links(0)
    busy = links.busy_text() if isinstance(links, RoundLinks) else f"{first.busy_s * 1e3:.2f}"
    frame.attrs.update({"baseline": baseline_text(world_size, global_batch, c), "link": first.label,
                        "busy_ms": busy, "beta_ns_per_byte": _all_reduce(first).beta_s_per_byte * 1e9,
                        "world_size": world_size, "global_batch": global_batch, "cores": c, "steps": steps,
                        "rounds": rounds, "optimizer": optimizer, "depth": depth,
                        "roofline": f"measured {roof.machine.get('measured', '?')}, load "
                                    f"{roof.machine.get('load_1min', '?')}",
                        "load": "/".join(f"{x:.2f}" for x in loads), "wall_s": time.perf_counter() - t0})
    return frame


def _load() -> float:
    """The 1-minute load average (NaN where the system has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def _all_reduce(link: Link) -> LinkModel:
    return link.links.get("all_reduce", link.default) if isinstance(link, LinkSet) else link


def predict_step_s(cfg: RunConfig, link: Link, compute: str | Roofline = "timed") -> float:
    """Seconds per step of ``cfg`` as ``dtlab.estimate`` predicts it on ``link``, its compute ``compute``: the
    estimator's own step rule (``estimate.step.predict``), so the sweep, notebook 11 and
    ``benchmarks/estimate_error.py`` agree."""
    step_ms = estimate(cfg, link, compute).step_ms
    if step_ms is None:
        raise ValueError(f"dtlab.estimate predicted no step time for tier {cfg.tier!r}")
    return step_ms / 1e3


def _one(role: str, plan: dict[str, RunConfig], link: Link, roof: Roofline) -> dict[str, Any]:
    if role in PREDICTED:
        job, compute = PREDICTED[role]
        return {"step_s": predict_step_s(plan[job], link, roof if compute == "roofline" else "timed")}
    return _numbers(plan[role])


def _numbers(cfg: RunConfig) -> dict[str, Any]:
    # record=False: DDP keeps its own C++ all-reduce (a recording hook would add Python per bucket)
    result = run(cfg, progress=False, record=False)
    numbers = ddp_steps.run_numbers(result, ddp_steps.WARMUP_STEPS)
    numbers["params"] = sum(int(t.numel()) for t in result.params().values() if t.is_floating_point())
    return numbers


def _frame(runs: pd.DataFrame, widths: list[int]) -> pd.DataFrame:
    steps = runs.pivot_table(index=["width", "round"], columns="role", values="step_s")
    out = []
    for w in widths:
        per = steps.loc[w]  # one row per round, one column per role
        measured = per["single"] / per["ddp"]
        predicted = per["predicted_single"] / per["predicted_ddp"]
        retimed = per["retimed_single"] / per["retimed_ddp"]
        error = predicted / measured - 1  # each round's prediction against the same round's measurement
        ddp = runs[(runs["width"] == w) & (runs["role"] == "ddp")]
        sizes = [int(s) for s in ddp["bucket_sizes_bytes"].iloc[0]]
        grad, compute_s = sum(sizes), float(per["compute"].median())
        ms = {role: float(per[role].median()) * 1e3 for role in ROLES}
        out.append({
            "width": w, "params": int(runs.loc[(runs["width"] == w) & (runs["role"] == "single"), "params"].iloc[0]),
            "gradient_bytes": grad, "buckets": len(sizes),
            "single_ms": ms["single"], "single_1t_ms": ms["single_1t"], "ddp_ms": ms["ddp"],
            "speedup": float(measured.median()), "speedup_min": float(measured.min()),
            "speedup_max": float(measured.max()), "speedup_vs_1t": float((per["single_1t"] / per["ddp"]).median()),
            "compute_ms": compute_s * 1e3, "compute_ns_per_byte": compute_s / grad * 1e9 if grad else math.nan,
            "predicted_single_ms": ms["predicted_single"], "predicted_ddp_ms": ms["predicted_ddp"],
            "predicted_speedup": float(predicted.median()), "prediction_error": float(error.median()),
            "retimed_single_ms": ms["retimed_single"], "retimed_ddp_ms": ms["retimed_ddp"],
            "retimed_speedup": float(retimed.median()), "retimed_error": float((retimed / measured - 1).median()),
            "rounds": len(per),
        })
    return pd.DataFrame(out, columns=list(COLUMNS))


# -- python -m dtlab.experiments.speedup -------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.experiments.speedup",
                                     description="Measure where ddp starts to beat one process, against MLP width.")
    parser.add_argument("--out", type=Path, default=Path("results/speedup"),
                        help="folder for crossover.csv and crossover.png")
    parser.add_argument("--widths", default="", help="comma-separated MLP widths (default: "
                        f"{','.join(map(str, DEFAULT_WIDTHS))}; quick: {','.join(map(str, QUICK_WIDTHS))})")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--steps", type=int, default=0, help=f"steps per run (default {STEPS}; quick {QUICK_STEPS})")
    parser.add_argument("--rounds", type=int, default=0, help=f"interleaved rounds (default {ROUNDS}; quick "
                        f"{QUICK_ROUNDS})")
    parser.add_argument("--roofline", type=Path, default=None, help="a saved roofline.json to predict the compute on "
                        f"(default: {DEFAULT_PATH} if measured on this machine, else measured first and saved there)")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("DTLAB_QUICK") == "1",
                        help="few widths, steps and rounds, a quick link calibration and, if one must be measured, "
                        "a quick roofline (also DTLAB_QUICK=1)")
    parser.add_argument("--runs", type=int, default=1, help="whole sweeps, one after the other, each calibrating "
                        "its own link (default 1); every run's table goes into crossover_runs.csv, the last one's "
                        "into crossover.csv and the figure")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1")
    widths = [int(w) for w in args.widths.split(",") if w.strip()] or list(QUICK_WIDTHS if args.quick
                                                                           else DEFAULT_WIDTHS)
    t0 = time.perf_counter()
    runs = []
    for run_no in range(1, args.runs + 1):
        started = datetime.datetime.now().isoformat(timespec="seconds")
        frame = speedup_sweep(widths, world_size=args.world_size, global_batch=args.global_batch,
                              steps=args.steps or (QUICK_STEPS if args.quick else STEPS),
                              rounds=args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS), quick_link=args.quick,
                              roofline=args.roofline, progress=True)
        runs.append(frame.assign(run=run_no, started=started, load=frame.attrs["load"]))
        if run_no < args.runs:
            print(f"run {run_no}/{args.runs}:\n{format_table(frame)}\n{verdict(frame)}\n", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "crossover.csv", index=False)
    pd.concat(runs).to_csv(args.out / "crossover_runs.csv", index=False)  # every run a row per width
    png = save(speedup_curve(frame), args.out / "crossover.png")
    a = frame.attrs
    print(f"\n{a['baseline']}; MLP depth {a['depth']}, {a['optimizer']}, {a['steps']} steps × {a['rounds']} "
          "rounds; times are medians over rounds in ms per step; speedup = single / ddp, the median of the rounds' "
          "(rounds_min-max: their spread); predicted by dtlab.estimate with the compute predicted on this machine's "
          "roofline (retimed_*: with the compute re-timed instead), error = predicted / measured speedup - 1")
    print(format_table(frame))
    print(f"load average at the start and after each round {a['load']}; roofline {a['roofline']}; "
          f"link: {a['link']}, beta {a['beta_ns_per_byte']:.2f} ns/B, busy_s per round "
          f"{a['busy_ms']} ms; "
          f"wrote {args.out / 'crossover.csv'}, {args.out / 'crossover_runs.csv'} and {png} in "
          f"{time.perf_counter() - t0:.0f} s")
    print(verdict(frame))
    return 0


if __name__ == "__main__":
    sys.exit(main())
