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
gradient byte) next to the link's ``beta`` (its time per byte): DDP can only
pay where the compute saved per byte is larger than the time the link takes
per byte -- and where one process on all cores leaves compute on the table.

**The prediction** uses the cost model (``dtlab.analysis.costmodel``): the
link's alpha and beta come from a short all_reduce sweep at world size n in
the same run (``collectives.sweep`` then ``costmodel.calibrate``); a DDP step
is ``predict_ddp_step`` of one rank's compute phases (a ``single`` run at the
per-rank batch on ``cores // n`` threads), DDP's bucket sizes (from the ddp
run: a layout, not a time) and DDP's own per-byte overhead (a ``ddp`` run
against a ``single`` run at world size 1, at the largest width, on a batch no
other run uses). No measured ddp step time enters a prediction. The model
assumes each rank has its cores to itself. Gloo's collectives are work for
those same cores (on loopback the kernel copies every byte too), so where the
ranks' threads take every core no all-reduce overlaps backward
(``costmodel.spare_cores``).

Runs are interleaved: each round runs every width (ascending, then
descending the next round) and, per width, every role in a rotating order,
so a burst of load from elsewhere slows one round, not one width. A width's
time is the median over rounds of each run's median steady step
(``costmodel.WARMUP_STEPS`` steps left out).

``python -m dtlab.analysis.speedup --out DIR`` runs the sweep and writes
``crossover.csv`` and ``crossover.png`` there (``make demo`` does: not ``speedup.*``, which ``compare``
writes into the same folder).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.analysis import collectives, costmodel
from dtlab.core.config import RunConfig
from dtlab.plots import save
from dtlab.plots.crossover import crossing, speedup_curve
from dtlab.train import run

__all__ = ["COLUMNS", "DEFAULT_WIDTHS", "QUICK_WIDTHS", "baseline_text", "calibrate_link", "closest_approach",
           "crossover", "format_table", "main", "speedup_sweep", "verdict"]

DEFAULT_WIDTHS = (64, 128, 256, 512, 1024, 2048)
QUICK_WIDTHS = (64, 256, 1024)
GLOBAL_BATCH = 512  # large enough that compute dominates a width-2048 step, small enough for a 2-minute sweep
STEPS, ROUNDS = 15, 3
QUICK_STEPS, QUICK_ROUNDS = 6, 1
# all_reduce sizes for the link: 4 KiB (latency-bound) to 16 MiB (a width-2048 MLP's gradients are 17 MB)
CALIBRATION_SIZES = tuple(4 ** k * 4096 for k in range(0, 7))
CALIBRATION_REPEATS = 10
ROLES = ("single", "single_1t", "ddp", "compute")
COLUMNS = ("width", "params", "gradient_bytes", "buckets", "single_ms", "single_1t_ms", "ddp_ms", "speedup",
           "speedup_vs_1t", "compute_ms", "compute_ns_per_byte", "predicted_ddp_ms", "predicted_speedup",
           "predicted_comm_ms", "predicted_exposed_comm_ms", "predicted_overhead_ms", "prediction_error", "rounds")


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


def _overhead_plan(base: RunConfig, width: int, world_size: int, cores: int) -> dict[str, RunConfig]:
    """DDP's own per-step work, at world size 1 (nothing to communicate), on a batch no other run uses."""
    batch = max(1, base.global_batch_size // (2 * world_size))
    cfg = base.replace(model_size=width, world_size=1, global_batch_size=batch,
                       threads_per_rank=max(1, cores // world_size))
    return {"overhead_single": cfg.replace(tier="single"), "overhead_ddp": cfg.replace(tier="ddp")}


def _say(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(progress):
        return progress
    return (lambda line: print(line, flush=True)) if progress else (lambda line: None)


def calibrate_link(world_size: int = 2, sizes: Sequence[int] = CALIBRATION_SIZES,
                   repeats: int = CALIBRATION_REPEATS) -> costmodel.LinkModel:
    """alpha and beta of gloo's all_reduce at ``world_size``, from a short interleaved sweep."""
    sweep = collectives.sweep(world_size=world_size, ops=("all_reduce",), sizes=tuple(sizes), repeats=repeats,
                              per_repeat=True)
    return costmodel.calibrate(sweep, "all_reduce", label=f"gloo loopback all_reduce, calibrated at n={world_size}")


def speedup_sweep(widths: Sequence[int] = DEFAULT_WIDTHS, *, world_size: int = 2, global_batch: int = GLOBAL_BATCH,
                  steps: int = STEPS, rounds: int = ROUNDS, depth: int = 2, optimizer: str = "sgd",
                  cores: int | None = None, link: costmodel.LinkModel | None = None,
                  calibration_sizes: Sequence[int] = CALIBRATION_SIZES,
                  calibration_repeats: int = CALIBRATION_REPEATS,
                  progress: bool | Callable[[str], None] = False) -> pd.DataFrame:
    """Measured and predicted speedup of ``ddp`` at ``world_size`` over ``single``, one row per MLP width.

    Columns (``COLUMNS``; times in ms, medians over ``rounds``): width, params,
    gradient_bytes, buckets; single_ms (one process on all ``cores``),
    single_1t_ms (one process, one thread), ddp_ms (``world_size`` ranks,
    ``cores // world_size`` threads each), speedup = single_ms / ddp_ms,
    speedup_vs_1t = single_1t_ms / ddp_ms; compute_ms (one rank's compute: a
    single run at the per-rank batch on a rank's threads) and
    compute_ns_per_byte (that per gradient byte); the cost model's
    predicted_ddp_ms, predicted_speedup = single_ms / predicted_ddp_ms, its
    parts (all-reduce time, the exposed part, DDP's overhead) and
    prediction_error (predicted / measured ddp step - 1). ``frame.attrs``
    holds the baseline in words, the link, the batch, cores, steps, rounds and
    the sweep's wall time.

    ``link``: a calibrated ``LinkModel`` to use instead of running the
    all_reduce sweep. ``progress``: True prints a line per round, a callable
    receives them. The MLP reads the synthetic 8x8 data set (64 inputs, 10
    classes), ``depth`` hidden layers of ``width`` units.
    """
    widths = sorted({int(w) for w in widths})
    if not widths or widths[0] < 1:
        raise ValueError(f"widths={widths!r} is invalid: give one or more widths >= 1")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size={world_size!r} is invalid: data parallelism needs at least 2 ranks")
    if global_batch % (2 * world_size):
        raise ValueError(f"global_batch={global_batch} must be divisible by 2 x world_size = {2 * world_size} "
                         "(the per-rank batch, and half of it for DDP's overhead runs)")
    warmup = costmodel.WARMUP_STEPS
    if not isinstance(steps, int) or steps < warmup + 2:
        raise ValueError(f"steps={steps!r} is invalid: need at least {warmup + 2} ({warmup} warm-up steps are "
                         "left out of every median)")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    c = _cores(cores)
    say = _say(progress)
    t0 = time.perf_counter()
    base = RunConfig(tier="single", model="mlp", model_depth=depth, dataset="synthetic",
                     dataset_size=max(4096, 4 * global_batch), global_batch_size=global_batch, steps=steps,
                     optimizer=optimizer)
    # every RunConfig is built (and so validated) before the first process starts
    plans = {w: _plan(base, w, world_size, c) for w in widths}
    overhead = _overhead_plan(base, widths[-1], world_size, c)
    if link is None:
        link = calibrate_link(world_size, calibration_sizes, calibration_repeats)
        say(f"link: {link.describe()}")
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        order = widths if r % 2 == 0 else widths[::-1]
        for i, w in enumerate(order):
            roles = ROLES[(r + i) % len(ROLES):] + ROLES[:(r + i) % len(ROLES)]
            for role in roles:
                rows.append({"round": r, "width": w, "role": role, **_numbers(plans[w][role])})
        for role, cfg in overhead.items():
            rows.append({"round": r, "width": widths[-1], "role": role, **_numbers(cfg)})
        say(f"round {r + 1}/{rounds}: {len(widths)} widths × {len(ROLES)} runs, {time.perf_counter() - t0:.0f} s")
    frame = _frame(pd.DataFrame(rows), link, widths, world_size,
                   overlap=costmodel.spare_cores(world_size, max(1, c // world_size), c))
    frame.attrs.update({"baseline": baseline_text(world_size, global_batch, c), "link": link.describe(),
                        "beta_ns_per_byte": link.beta_s_per_byte * 1e9, "world_size": world_size,
                        "global_batch": global_batch, "cores": c, "steps": steps, "rounds": rounds,
                        "optimizer": optimizer, "depth": depth, "wall_s": time.perf_counter() - t0})
    return frame


def _numbers(cfg: RunConfig) -> dict[str, Any]:
    # record=False: DDP keeps its own C++ all-reduce (a recording hook would add Python per bucket)
    result = run(cfg, progress=False, record=False)
    numbers = costmodel.run_numbers(result, costmodel.WARMUP_STEPS)
    numbers["params"] = sum(int(t.numel()) for t in result.params().values() if t.is_floating_point())
    return numbers


def _median(runs: pd.DataFrame, width: int, role: str, column: str = "step_s") -> float:
    return float(runs.loc[(runs["width"] == width) & (runs["role"] == role), column].median())


def _frame(runs: pd.DataFrame, link: costmodel.LinkModel, widths: list[int], world_size: int, *,
           overlap: bool) -> pd.DataFrame:
    single_o = runs[runs["role"] == "overhead_single"]
    ddp_o = runs[runs["role"] == "overhead_ddp"]
    gamma = costmodel.ddp_overhead({**single_o.iloc[0].to_dict(), "step_s": float(single_o["step_s"].median())},
                                   {**ddp_o.iloc[0].to_dict(), "step_s": float(ddp_o["step_s"].median())})
    out = []
    for w in widths:
        ddp_rows = runs[(runs["width"] == w) & (runs["role"] == "ddp")]
        sizes = [int(s) for s in ddp_rows["bucket_sizes_bytes"].iloc[0]]
        compute = runs[(runs["width"] == w) & (runs["role"] == "compute")]
        phases = {p: float(compute[p].median()) for p in costmodel.COMPUTE_PHASES}
        pred = costmodel.predict_ddp_step(phases, sizes, link, world_size, overhead_s=gamma * sum(sizes),
                                          overlap=overlap)
        single, single_1t, ddp = (_median(runs, w, role) for role in ("single", "single_1t", "ddp"))
        compute_s = _median(runs, w, "compute")
        grad = sum(sizes)
        params = int(runs.loc[runs["width"] == w, "params"].iloc[0])
        out.append({
            "width": w, "params": params, "gradient_bytes": grad, "buckets": len(sizes),
            "single_ms": single * 1e3, "single_1t_ms": single_1t * 1e3, "ddp_ms": ddp * 1e3,
            "speedup": single / ddp, "speedup_vs_1t": single_1t / ddp,
            "compute_ms": compute_s * 1e3, "compute_ns_per_byte": compute_s / grad * 1e9 if grad else math.nan,
            "predicted_ddp_ms": pred.step_s * 1e3, "predicted_speedup": single / pred.step_s,
            "predicted_comm_ms": pred.comm_s * 1e3, "predicted_exposed_comm_ms": pred.exposed_comm_s * 1e3,
            "predicted_overhead_ms": pred.overhead_s * 1e3, "prediction_error": pred.step_s / ddp - 1,
            "rounds": int(ddp_rows["round"].nunique()),
        })
    return pd.DataFrame(out, columns=list(COLUMNS))


# -- reading the curve ---------------------------------------------------------------------------------------------
def crossover(frame: pd.DataFrame, column: str = "speedup") -> float | None:
    """The width where ``column`` (measured speedup by default) first reaches 1, interpolated in log-width.

    Walking up the widths, the first pair of neighbours with speedup < 1 and
    then >= 1 brackets it; between them the speedup is taken as linear in
    log(width). None if the speedup never reaches 1; the smallest width if it
    is >= 1 already there (data parallelism pays from the first width tried).
    """
    if "width" not in frame.columns or column not in frame.columns:
        raise ValueError(f"crossover: the frame needs columns 'width' and {column!r}; got {list(frame.columns)}")
    df = frame.dropna(subset=["width", column]).sort_values("width")
    return crossing(df["width"].to_numpy(float), df[column].to_numpy(float))


def closest_approach(frame: pd.DataFrame, column: str = "speedup") -> dict[str, float]:
    """The width where ``column`` is largest: {"width", "speedup"} (where the curve comes closest to paying)."""
    df = frame.dropna(subset=[column])
    if df.empty:
        raise ValueError(f"closest_approach: no {column!r} values")
    best = df.loc[df[column].idxmax()]
    return {"width": float(best["width"]), "speedup": float(best[column])}


def verdict(frame: pd.DataFrame) -> str:
    """The answer in a sentence or two, with this run's numbers: the crossover, or the closest approach."""
    who = frame.attrs.get("baseline", "ddp vs single")
    measured, predicted = crossover(frame), crossover(frame, "predicted_speedup")
    if measured is not None:
        lines = [f"crossover: ddp beats single from width ≈ {measured:.0f} ({who})"]
    else:
        best = closest_approach(frame)
        row = frame.loc[frame["width"] == best["width"]].iloc[0]
        lines = [f"crossover: none -- ddp never beats single at widths {int(frame['width'].min())}-"
                 f"{int(frame['width'].max())} ({who}); closest at width {best['width']:.0f}: speedup "
                 f"{best['speedup']:.2f} (ddp {row['ddp_ms']:.1f} ms vs single {row['single_ms']:.1f} ms)"]
    lines.append("cost model: " + _predicted_text(frame, predicted))
    if "speedup_vs_1t" in frame.columns:
        one = crossover(frame, "speedup_vs_1t")
        lines.append("against single on 1 thread: " + (f"ddp pays from width ≈ {one:.0f}" if one is not None else
                                                      f"never (at most {frame['speedup_vs_1t'].max():.2f})"))
    return "\n".join(lines)


def _predicted_text(frame: pd.DataFrame, predicted: float | None) -> str:
    df = frame.sort_values("width")
    if predicted is None:
        return f"predicts no crossover (at most {df['predicted_speedup'].max():.2f})"
    above = df[df["predicted_speedup"] >= 1]
    if (df.loc[df["width"] >= above["width"].min(), "predicted_speedup"] >= 1).all():
        return f"predicts the crossover at width ≈ {predicted:.0f}"
    where = ", ".join(f"{int(w)} (predicted ddp {p:.3g} ms, measured {m:.3g} ms)"
                      for w, p, m in zip(above["width"], above["predicted_ddp_ms"], above["ddp_ms"]))
    return f"predicts a speedup >= 1 only at width {where}, below 1 elsewhere"


def format_table(frame: pd.DataFrame) -> str:
    cols = ["width", "params", "single_ms", "single_1t_ms", "ddp_ms", "speedup", "speedup_vs_1t",
            "predicted_ddp_ms", "predicted_speedup", "prediction_error", "compute_ns_per_byte"]
    fmt = {c: "{:.2f}".format for c in ("single_ms", "single_1t_ms", "ddp_ms", "predicted_ddp_ms", "speedup",
                                        "speedup_vs_1t", "predicted_speedup", "compute_ns_per_byte")}
    fmt["prediction_error"] = "{:+.0%}".format
    return frame[[c for c in cols if c in frame.columns]].to_string(index=False, formatters=fmt)


# -- python -m dtlab.analysis.speedup --------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.analysis.speedup",
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
    parser.add_argument("--quick", action="store_true", default=os.environ.get("DTLAB_QUICK") == "1",
                        help="few widths, steps and rounds (also DTLAB_QUICK=1)")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",") if w.strip()] or list(QUICK_WIDTHS if args.quick
                                                                           else DEFAULT_WIDTHS)
    t0 = time.perf_counter()
    frame = speedup_sweep(widths, world_size=args.world_size, global_batch=args.global_batch,
                          steps=args.steps or (QUICK_STEPS if args.quick else STEPS),
                          rounds=args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS), progress=True)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "crossover.csv", index=False)
    png = save(speedup_curve(frame), args.out / "crossover.png")
    print(f"\n{frame.attrs['baseline']}; MLP depth {frame.attrs['depth']}, {frame.attrs['optimizer']}, "
          f"{frame.attrs['steps']} steps × {frame.attrs['rounds']} rounds; times are median ms per step")
    print(format_table(frame))
    print(verdict(frame))
    print(f"link beta {frame.attrs['beta_ns_per_byte']:.2f} ns/B; wrote {args.out / 'crossover.csv'} and {png} "
          f"in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
