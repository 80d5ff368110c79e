"""What the CommRecorder costs: timings with and without it, interleaved. Target: at most 2 % slower.

(a) Collective loops at world size 2 in one launch: per round, the ranks time
    the same work with the recorder off (no recorder started, so none of its
    dispatcher kernels is registered) and on (a fresh ``CommRecorder``):
    DDP-style gradient buckets (25 MB in 4 buckets, issued async and waited
    through their futures, as DDP's reducer does), many
    small 4 KB all-reduces (where a per-call cost shows most), and FSDP2-style
    units (per unit, synchronous as FSDP2 runs them on CPU: an all-gather for
    forward, another for backward and a reduce-scatter of the gradient, 4 MB
    units as the large MLP's middle layer).
(b) Training runs, ``dtlab.train.run(cfg)`` at world size 2 with tiers ddp and
    fsdp, each at a small size (MLP 64, digits, global batch 64: steps of a few
    ms) and a large one (MLP 1024, synthetic, global batch 1024: compute-bound
    steps of tens of ms), launched with ``record=True`` and ``record=False``
    alternately; the measure is the median steady-state step time.

(c) The same for the ``tp`` tier (charformer, world 2), where recording also opens
    the ``modules`` channel (torch's ModTracker: module hooks that name the layer
    issuing each DTensor collective). Reported apart (``instrument_overhead.tp``, no
    target), as it was when a dispatch mode recorded these collectives.

Reported: the median over rounds of instrumented / plain for each, with the
interval of that median (``_common.median_interval``: a 90 % bootstrap from 10
rounds, their min-max below) and the range of the per-round ratios, and the
worst of the medians of (a) and (b) as the headline, saying whether its interval
excludes the target (if not, the run cannot tell the recorder's cost from noise).
With ``record=False`` dtlab still times its compute phases
(``recorder.phase``) and registers no dispatcher kernel; DDP runs its built-in C++
all-reduce either way (recording needs no comm hook): (b) measures the cost of
recording the collectives, not of the phase timers, which dtlab cannot switch off.

    .venv/bin/python benchmarks/instrument_overhead.py [--quick] [--out results/bench] [--repeats N]
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


def collectives_rank(info, sizes: dict, rounds: int, warmup_rounds: int) -> list[dict]:
    """On each rank: the interleaved rounds of (a); returns this rank's rows."""
    import time

    import torch
    import torch.distributed as dist

    from dtlab.instrument import recorder as instrument

    torch.set_num_threads(1)
    numel = int(sizes["bucket_mb"] * 1e6 / 4)
    buckets = [torch.randn(numel) for _ in range(sizes["buckets"])]
    small = [torch.randn(sizes["small_kb"] * 1024 // 4) for _ in range(sizes["small_calls"])]
    shard = int(sizes["unit_mb"] * 1e6 / 4) // info.world_size
    # Per unit: this rank's parameter shard, the gathered parameters, the gradient and its reduced shard.
    units = [(torch.randn(shard), torch.empty(shard * info.world_size), torch.randn(shard * info.world_size),
              torch.empty(shard)) for _ in range(sizes["units"])]

    def gradient_buckets() -> None:
        for _ in range(sizes["bucket_iters"]):
            futures = [dist.all_reduce(t, async_op=True).get_future() for t in buckets]
            torch.futures.wait_all(futures)

    def small_calls() -> None:
        for t in small:
            dist.all_reduce(t)

    def fsdp_units() -> None:
        for _ in range(sizes["unit_iters"]):
            for params, full, _grad, _grad_shard in units:  # forward: gather each unit before its compute
                dist.all_gather_into_tensor(full, params)
            for params, full, grad, grad_shard in reversed(units):  # backward: gather again, reduce-scatter
                dist.all_gather_into_tensor(full, params)
                dist.reduce_scatter_tensor(grad_shard, grad)

    def timed(mode: str, loop) -> dict:
        recorder = None
        if mode == "instrumented":
            recorder = instrument.CommRecorder(info.rank).start()
        # otherwise no recorder runs and its kernels are not registered: torch.distributed as torch ships it
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
                for loop in (gradient_buckets, small_calls, fsdp_units) for mode in MODES}
    return common.interleave(variants, rounds, warmup_rounds=warmup_rounds)


def measure_collectives(quick: bool, rounds: int) -> tuple[list[dict], dict[str, list[float]]]:
    if quick:
        sizes = {"bucket_mb": 1.0, "buckets": 2, "bucket_iters": 1, "small_kb": 4, "small_calls": 20,
                 "unit_mb": 0.25, "units": 2, "unit_iters": 1}
    else:
        sizes = {"bucket_mb": 6.25, "buckets": 4, "bucket_iters": 4, "small_kb": 4, "small_calls": 400,
                 "unit_mb": 4.0, "units": 3, "unit_iters": 4}
    # record=False: no recorder from the launcher; the ranks switch their own on and off.
    per_rank = launch(collectives_rank, 2, args=(sizes, rounds, 0 if quick else 2), progress=False, record=False,
                      timeout_s=120.0)
    # One row per (round, variant, rank); a block's time is its slowest rank's.
    rows = [{**sizes, **row} for rank_rows in per_rank for row in rank_rows]
    slowest: dict[tuple[int, str], dict] = {}
    for row in rows:
        key = (row["round"], row["variant"])
        if key not in slowest or row["seconds"] > slowest[key]["seconds"]:
            slowest[key] = row
    blocks = list(slowest.values())
    calls = {"gradient_buckets": sizes["buckets"] * sizes["bucket_iters"], "small_calls": sizes["small_calls"],
             "fsdp_units": 3 * sizes["units"] * sizes["unit_iters"]}
    for row in rows:  # the recorder really recorded (and only when on)
        loop, mode = row["variant"].split(":")
        expected = calls[loop] + 1 if mode == "instrumented" else 0  # + the barrier
        if row["events"] != expected:
            raise RuntimeError(f"{row['variant']} on rank {row['rank']}: {row['events']} events, expected {expected}")
    out = {}
    for loop, label in (("gradient_buckets", f"all_reduce {sizes['buckets']}x{sizes['bucket_mb']:g} MB"),
                        ("small_calls", f"all_reduce {sizes['small_kb']} KB"),
                        ("fsdp_units", f"fsdp all_gather/reduce_scatter {sizes['units']}x{sizes['unit_mb']:g} MB")):
        r = common.ratios(blocks, f"{loop}:instrumented", f"{loop}:plain", "seconds")
        out[label] = r
        common.note(f"(a) {label}: instrumented/plain per round {common.spread(r)}")
    return rows, out


# (b): per size, the RunConfig fields besides tier; the small one is this benchmark's original run.
TRAINING = {
    "small": {"model_size": 64, "dataset": "digits", "global_batch_size": 64, "steps": 30, "quick_steps": 8},
    "large": {"model_size": common.LARGE.model_size, "dataset": "synthetic", "dataset_size": common.LARGE.dataset_size,
              "global_batch_size": common.LARGE.global_batch, "steps": 20, "quick_steps": 6},
}
TIERS = ("ddp", "fsdp")


def training_config(tier: str, size: str, quick: bool) -> RunConfig:
    fields = dict(TRAINING[size])
    quick_steps = fields.pop("quick_steps")
    if quick:
        fields["steps"] = quick_steps
    return RunConfig(tier=tier, world_size=2, model="mlp", optimizer="sgd", lr=0.05, threads_per_rank=1, **fields)


def measure_training(quick: bool, rounds: int) -> tuple[list[dict], list[dict], dict[str, list[float]]]:
    """(b): returns one row per run, one per (run, rank, step), and the per-round ratios of each tier and size."""
    steps: list[dict] = []
    cfgs = {f"{tier}:{size}": training_config(tier, size, quick) for tier in TIERS for size in TRAINING}

    def one(cfg: RunConfig, variant: str, mode: str):
        def go(round_: int) -> dict:
            result = run(cfg, progress=False, record=mode == "instrumented")
            steps.extend(common.steps_rows(result, round=round_, variant=variant))
            events = len(result.ranks[0].events)
            if (events > 0) != (mode == "instrumented"):
                raise RuntimeError(f"{variant} run recorded {events} events on rank 0")
            return {"median_step_s": common.steady_step_s(result), "wall_s": result.wall_s, "events_rank0": events}
        return go

    variants = {f"{key}:{mode}": one(cfg, f"{key}:{mode}", mode) for key, cfg in cfgs.items() for mode in MODES}
    rows = common.interleave(variants, rounds, warmup_rounds=0 if quick else 1, log=None if quick else common.note)
    out_rows, out = [], {}
    for row in rows:
        cfg = cfgs[row["variant"].rsplit(":", 1)[0]]
        out_rows.append({"tier": cfg.tier, "size": row["variant"].split(":")[1], "world_size": cfg.world_size,
                         "model_size": cfg.model_size, "global_batch": cfg.global_batch_size, "steps": cfg.steps,
                         **row})
    for key, cfg in cfgs.items():
        r = common.ratios(rows, f"{key}:instrumented", f"{key}:plain", "median_step_s")
        plain_ms = 1e3 * common.median(common.per_round(rows, f"{key}:plain", "median_step_s").values())
        label = f"{cfg.tier} training {key.split(':')[1]} [MLP {cfg.model_size}, batch {cfg.global_batch_size}]"
        out[label] = r
        common.note(f"(b) {label}: plain step {plain_ms:.1f} ms; instrumented/plain per round {common.spread(r)}")
    return out_rows, steps, out


def measure_tp(quick: bool, rounds: int) -> tuple[list[dict], list[float]]:
    """(c): one row per run, as (b)'s, and the per-round instrumented / plain median step time of tp."""
    cfg = RunConfig(tier="tp", world_size=2, model="charformer", dataset="text", optimizer="sgd", lr=0.05,
                    steps=6 if quick else 20, threads_per_rank=1)

    def one(mode: str):
        def go(_round: int) -> dict:
            result = run(cfg, progress=False, record=mode == "instrumented")
            return {"median_step_s": common.steady_step_s(result), "wall_s": result.wall_s,
                    "events_rank0": len(result.ranks[0].events)}
        return go

    rows = common.interleave({f"tp:charformer:{mode}": one(mode) for mode in MODES}, rounds,
                             warmup_rounds=0 if quick else 1, log=None if quick else common.note)
    out_rows = [{"tier": "tp", "size": "charformer", "world_size": cfg.world_size, "model_size": cfg.model_size,
                 "global_batch": cfg.global_batch_size, "steps": cfg.steps, **row} for row in rows]
    return out_rows, common.ratios(rows, "tp:charformer:instrumented", "tp:charformer:plain", "median_step_s")


def main() -> None:
    p = common.parser(__doc__)
    args = common.parse(p)
    rows_a, ratios_a = measure_collectives(args.quick, common.repeats(args, full=40, quick=2))
    rows_b, steps_b, ratios_b = measure_training(args.quick, common.repeats(args, full=16, quick=1))
    common.write_csv(args.out / f"{NAME}_collectives.csv", rows_a)
    common.write_csv(args.out / f"{NAME}_training_steps.csv", steps_b)
    parts = {**ratios_a, **ratios_b}
    medians = {k: common.median(v) for k, v in parts.items()}
    worst_key = max(medians, key=medians.get)
    worst = medians[worst_key]
    detail = ("worst of: " + ", ".join(f"{k} {common.ratio_text(v)}" for k, v in parts.items())
              + f"; {worst_key}: {common.resolution(parts[worst_key], TARGET)}")
    common.result_line(NAME, worst, f"<= {TARGET}", quick=args.quick, detail=detail, passed=worst <= TARGET)
    rows_tp, tp = measure_tp(args.quick, common.repeats(args, full=12, quick=1))
    common.write_csv(args.out / f"{NAME}_training.csv", rows_b + rows_tp)  # every tier's runs, tp's included
    common.result_line(f"{NAME}.tp", common.median(tp), "none: the modules channel's cost", quick=args.quick,
                       detail=f"tp training, charformer, world 2: instrumented / plain {common.ratio_text(tp)}; "
                              f"against no cost: {common.resolution(tp, 1.0)}")


if __name__ == "__main__":
    main()
