"""What the CommRecorder costs: timings with and without it, interleaved. Target: at most 2 % slower.

(a) A DDP-style all-reduce loop at world size 2 in one launch: per round, the
    ranks time the same work with the recorder off (c10d's functions not even
    wrapped: ``dtlab.instrument.recorder.uninstall()``) and on (a fresh ``CommRecorder``):
    gradient buckets (25 MB in 4 buckets, issued async and waited through
    their futures, as DDP's comm hook does) and many small 4 KB all-reduces
    (where a per-call cost shows most).
(b) A small training run, ``dtlab.train.run(cfg)`` with tier ddp at world
    size 2, launched with ``record=True`` and ``record=False`` alternately;
    the measure is the median steady-state step time.

Reported: the median over rounds of instrumented / plain for each, and the
worst of them as the headline. With ``record=False`` dtlab still times its
compute phases (``recorder.phase``): (b) measures the cost of recording the
collectives, not of the phase timers, which dtlab cannot switch off.

    .venv/bin/python benchmarks/instrument_overhead.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import _common as common
import cloudpickle

from dtlab.core.config import RunConfig
from dtlab.launch.local import launch
from dtlab.train import run

NAME = "instrument_overhead"
TARGET = 1.02
MODES = ("plain", "instrumented")

cloudpickle.register_pickle_by_value(common)  # the ranks use common.interleave; they cannot import it by name


def allreduce_rank(info, sizes: dict, rounds: int, warmup_rounds: int) -> list[dict]:
    """On each rank: the interleaved rounds of (a); returns this rank's rows."""
    import time

    import torch
    import torch.distributed as dist

    from dtlab.instrument import recorder as instrument

    torch.set_num_threads(1)
    numel = int(sizes["bucket_mb"] * 1e6 / 4)
    buckets = [torch.randn(numel) for _ in range(sizes["buckets"])]
    small = [torch.randn(sizes["small_kb"] * 1024 // 4) for _ in range(sizes["small_calls"])]

    def gradient_buckets() -> None:
        for _ in range(sizes["bucket_iters"]):
            futures = [dist.all_reduce(t, async_op=True).get_future() for t in buckets]
            torch.futures.wait_all(futures)

    def small_calls() -> None:
        for t in small:
            dist.all_reduce(t)

    def timed(mode: str, loop) -> dict:
        recorder = None
        if mode == "instrumented":
            recorder = instrument.CommRecorder(info.rank).start()
        else:
            instrument.uninstall()  # the plain case: torch.distributed exactly as torch ships it
        dist.barrier()
        t0 = time.perf_counter()
        loop()
        elapsed = time.perf_counter() - t0
        events = 0
        if recorder is not None:
            recorder.stop()
            events = len(recorder.events)
        return {"rank": info.rank, "mode": mode, "seconds": elapsed, "events": events}

    variants = {f"{loop.__name__}:{mode}": (lambda _round, mode=mode, loop=loop: timed(mode, loop))
                for loop in (gradient_buckets, small_calls) for mode in MODES}
    return common.interleave(variants, rounds, warmup_rounds=warmup_rounds)


def measure_allreduce(quick: bool, rounds: int) -> tuple[list[dict], dict[str, float]]:
    if quick:
        sizes = {"bucket_mb": 1.0, "buckets": 2, "bucket_iters": 1, "small_kb": 4, "small_calls": 20}
    else:
        sizes = {"bucket_mb": 6.25, "buckets": 4, "bucket_iters": 4, "small_kb": 4, "small_calls": 400}
    # record=False: no recorder from the launcher; the ranks switch their own on and off.
    per_rank = launch(allreduce_rank, 2, args=(sizes, rounds, 0 if quick else 2), progress=False, record=False,
                      timeout_s=120.0)
    # One row per (round, variant, rank); a block's time is its slowest rank's.
    rows = [{**sizes, **row} for rank_rows in per_rank for row in rank_rows]
    slowest: dict[tuple[int, str], dict] = {}
    for row in rows:
        key = (row["round"], row["variant"])
        if key not in slowest or row["seconds"] > slowest[key]["seconds"]:
            slowest[key] = row
    blocks = list(slowest.values())
    calls = {"gradient_buckets": sizes["buckets"] * sizes["bucket_iters"], "small_calls": sizes["small_calls"]}
    for row in rows:  # the recorder really recorded (and only when on)
        loop, mode = row["variant"].split(":")
        expected = calls[loop] + 1 if mode == "instrumented" else 0  # + the barrier
        if row["events"] != expected:
            raise RuntimeError(f"{row['variant']} on rank {row['rank']}: {row['events']} events, expected {expected}")
    out = {}
    for loop, label in (("gradient_buckets", f"all_reduce {sizes['buckets']}x{sizes['bucket_mb']:g} MB"),
                        ("small_calls", f"all_reduce {sizes['small_kb']} KB")):
        r = common.ratios(blocks, f"{loop}:instrumented", f"{loop}:plain", "seconds")
        out[label] = common.median(r)
        common.note(f"(a) {label}: instrumented/plain per round {common.spread(r)}")
    return rows, out


def measure_training(quick: bool, rounds: int) -> tuple[list[dict], list[dict], float]:
    """(b): returns one row per run, one per (run, rank, step), and the median ratio."""
    cfg = RunConfig(tier="ddp", world_size=2, model="mlp", model_size=64, dataset="digits", global_batch_size=64,
                    steps=8 if quick else 30, optimizer="sgd", lr=0.05, threads_per_rank=1)

    steps: list[dict] = []

    def one(mode: str):
        def go(round_: int) -> dict:
            result = run(cfg, progress=False, record=mode == "instrumented")
            steps.extend(common.steps_rows(result, round=round_, variant=mode))
            events = len(result.ranks[0].events)
            if (events > 0) != (mode == "instrumented"):
                raise RuntimeError(f"{mode} run recorded {events} events on rank 0")
            return {"median_step_s": common.steady_step_s(result), "wall_s": result.wall_s, "events_rank0": events}
        return go

    variants = {mode: one(mode) for mode in MODES}
    rows = common.interleave(variants, rounds, warmup_rounds=0 if quick else 2,
                             log=None if quick else common.note)
    rows = [{"tier": cfg.tier, "world_size": cfg.world_size, "model_size": cfg.model_size,
             "steps": cfg.steps, **row} for row in rows]
    r = common.ratios(rows, "instrumented", "plain", "median_step_s")
    common.note(f"(b) ddp training: instrumented/plain per round {common.spread(r)}")
    return rows, steps, common.median(r)


def main() -> None:
    p = common.parser(__doc__)
    args = common.parse(p)
    rows_a, ratios_a = measure_allreduce(args.quick, common.repeats(args, full=40, quick=2))
    rows_b, steps_b, ratio_b = measure_training(args.quick, common.repeats(args, full=60, quick=1))
    common.write_csv(args.out / f"{NAME}_allreduce.csv", rows_a)
    common.write_csv(args.out / f"{NAME}_training.csv", rows_b)
    common.write_csv(args.out / f"{NAME}_training_steps.csv", steps_b)
    parts = {**ratios_a, "ddp training (run)": ratio_b}
    worst = max(parts.values())
    detail = "worst of: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
    common.result_line(NAME, worst, f"<= {TARGET}", quick=args.quick, detail=detail, passed=worst <= TARGET)


if __name__ == "__main__":
    main()
