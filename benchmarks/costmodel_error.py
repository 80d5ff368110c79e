"""The cost model's error: predicted against measured DDP step time at world sizes 1, 2 and 4.

Calibrates an alpha-beta link on an all_reduce sweep at world size 2 (loopback,
gloo): 15 message sizes from 1 KiB to 16 MiB a factor of 2 apart (the small
ones set alpha, the large ones beta), 25 interleaved repeats each, the slowest
rank of each repeat counting, repeats more than 3 MADs slower than their
size's median dropped, the median of the rest fitted robustly, and a 90 %
bootstrap interval for alpha and the bandwidth (``costmodel.calibrate``), each
rank on one thread as the training ranks. Then, round after round, it measures
``busy_s``, what an all-reduce costs beyond the link's price for it when it
follows 5 ms of compute (``costmodel.calibrate_busy``, a synthetic job of
matrix products and all-reduces; the mean iteration, so the slow wake-ups a
sweep's fit leaves out are in it), and runs every point, interleaved: it predicts
the DDP step of an MLP (width 1024, depth 3, 8.3 MiB of gradients) from
``single`` runs at each point's per-rank batch, timed in n copies at once as the
n ranks share the machine, the buckets DDP built, that round's ``busy_s`` and
DDP's overhead measured at world size 1 on another batch (every round's) -- and
compares with the DDP step measured in the same round, unrecorded. A point's
error is the median over rounds of each round's error (``ddp_steps.validate_rounds``):
this machine's speed drifts by 10-25 % within minutes, and a round's prediction
and measurement drift together. Two bucket
caps: 25 MB (one bucket, ready only when backward ends) and 2 MB (3 buckets:
the first two ready during backward, but with every core computing, nothing
overlaps: ``costmodel.spare_cores``). Global batch 128, one thread per rank; every run of a round
is interleaved with the others. World size 4 oversubscribes a 2-core machine:
reported, not counted. As root, also DDP across two simulated hosts (one
rank each, ``multinode`` tier) on links capped at 10 Gbit/s, 1 Gbit/s and
200 Mbit/s: predicted with the loopback link behind each cap
(``costmodel.capped``), nothing fitted on them.

Prints ``costmodel.median_error`` (target <= 0.15) and ``costmodel.max_error``
(target <= 0.30, worst counted point); writes ``costmodel_error.csv`` (the
points), ``costmodel_error_runs.csv`` (every run), ``costmodel_error_sweep.csv``
(the calibration sweep per size, with the fit), ``costmodel_error_repeats.csv``
(every repeat of it, outliers marked) and ``costmodel_error.png``. The detail
lines give alpha, the bandwidth and their intervals.

    .venv/bin/python benchmarks/costmodel_error.py [--quick] [--out results/bench] [--repeats ROUNDS]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import _common as common
import pandas as pd

from dtlab import plots
from dtlab.core.config import RunConfig
from dtlab.cost import links as costmodel
from dtlab.cost.estimate.calibration import fitted_sweep
from dtlab.cost.links import sweep as collectives
from dtlab.experiments import ddp_steps
from dtlab.launch import netns
from dtlab.tiers import ddp

NAME = "costmodel_error"
WORLD_SIZES = (1, 2, 4)
BUCKET_CAPS_MB = (25.0, 2.0)
QUICK_BUCKET_CAPS_MB = (25.0, 0.1)
LINK_CAPS_MBIT = (10_000.0, 1_000.0, 200.0)
QUICK_LINK_CAPS_MBIT = (200.0,)
# the calibration sweep: a few seconds of collectives (a round of 15 sizes moves 32 MiB, ~0.1 s on loopback)
SWEEP_SIZES, SWEEP_REPEATS = collectives.CALIBRATION_SIZES, 25
QUICK_SWEEP_SIZES, QUICK_SWEEP_REPEATS = collectives.QUICK_CALIBRATION_SIZES, collectives.QUICK_CALIBRATION_REPEATS


def config(quick: bool) -> RunConfig:
    width, depth = (256, 2) if quick else (1024, 3)
    return RunConfig(tier="ddp", world_size=1, model="mlp", model_size=width, model_depth=depth,
                     dataset="synthetic", dataset_size=4096, global_batch_size=128, steps=8 if quick else 30,
                     optimizer="sgd", threads_per_rank=1, tier_options=ddp.Options())


def calibrate(args) -> tuple[costmodel.LinkModel, pd.DataFrame, pd.DataFrame]:
    """The link, its fit per size and the sweep's repeats (per repeat, so the bootstrap resamples them too)."""
    sizes, repeats = (QUICK_SWEEP_SIZES, QUICK_SWEEP_REPEATS) if args.quick else (SWEEP_SIZES, SWEEP_REPEATS)
    link, sweep = fitted_sweep(  # swept once more where other work stalled the first sweep
        lambda: collectives.sweep(2, ops=("all_reduce",), sizes=sizes, repeats=repeats, per_repeat=True),
        lambda frame: costmodel.calibrate(frame, "all_reduce", label="gloo loopback, calibrated at n=2"))
    common.note(link.describe())
    return link, costmodel.fit_frame(sweep, link), sweep


def measure_rounds(link: costmodel.LinkModel, rounds: int, quick: bool,
                   measure_one: Callable[[], pd.DataFrame]) -> tuple[pd.DataFrame, dict[int, costmodel.LinkModel]]:
    """``rounds`` rounds of ``measure_one()`` (one round of runs), each after its own ``busy_s``: the link per round.

    ``busy_s`` is the excess over the link's price of the synthetic job's 64 KiB all-reduce, the mean of its
    iterations: price + busy_s is what that all-reduce costs after compute, its slow wake-ups included, which
    the fit (on the fast calls) leaves out. Not cut at zero: where the fit overprices it (alpha 1136 us at a
    fit RMS of 61 % once), the excess takes the overshoot back."""
    frames, links = [], {}
    price = link.predict("all_reduce", costmodel.BUSY_NBYTES, 2)
    for r in range(rounds):
        busy = costmodel.calibrate_busy(2, rounds=3 if quick else costmodel.BUSY_ROUNDS, price_s=price)
        links[r] = dataclasses.replace(link, busy_s=busy)
        frames.append(measure_one().assign(round=r))
        common.note(f"round {r + 1}/{rounds} done, busy_s {busy * 1e3:.2f} ms")
    return pd.concat(frames, ignore_index=True), links


def link_text(link: costmodel.LinkModel, busy_s: list[float]) -> str:
    """Alpha and bandwidth with their 90 % intervals, the fit's RMS error, the repeats dropped, busy_s per round."""
    (a_lo, a_hi), (b_lo, b_hi) = link.alpha_range_s, link.bandwidth_range_gbps
    return (f"link alpha {link.alpha_s * 1e6:.0f} us [{a_lo * 1e6:.0f}-{a_hi * 1e6:.0f}], "
            f"{link.bandwidth_gbps:.2f} GB/s [{b_lo:.2f}-{b_hi:.2f}] ({link.spread_method}), fit RMS "
            f"{link.fit_rel_rms:.1%} over {link.points} sizes, {link.dropped}/{link.repeats} repeats dropped, "
            f"busy_s per round {'/'.join(f'{b * 1e3:.2f}' for b in busy_s)} ms")


def point_text(row) -> str:
    over = " oversubscribed, not counted" if row["oversubscribed"] else ""
    mbit = row.get("link_mbit", float("nan"))
    where = f" {mbit:g} Mbit/s hosts" if mbit == mbit else ""
    what = f"n={int(row['world_size'])} {int(row['buckets'])}b{where}{over}"
    return (f"{what}: predicted {row['predicted_s'] * 1e3:.1f} ms vs measured {row['measured_s'] * 1e3:.1f} ms "
            f"({row['signed_error']:+.1%})")


def main() -> None:
    args = common.parse(common.parser(__doc__))
    link, fit, sweep = calibrate(args)
    cfg = config(args.quick)
    caps = QUICK_BUCKET_CAPS_MB if args.quick else BUCKET_CAPS_MB
    runs, links = measure_rounds(link, common.repeats(args, full=5, quick=1), args.quick,
                                 lambda: ddp_steps.measure(cfg, WORLD_SIZES, rounds=1, bucket_caps_mb=caps))
    df = ddp_steps.validate_rounds(ddp_steps.validate, links, runs)
    df["overhead_s_per_byte"] = [ddp_steps.overhead_from(runs, cap) for cap in df["bucket_cap_mb"]]
    busy = [lk.busy_s for lk in links.values()]
    ok, reason = netns.available()
    if ok:
        link_cfg = cfg.replace(tier_options=ddp.Options(bucket_cap_mb=caps[0]))
        mbits = QUICK_LINK_CAPS_MBIT if args.quick else LINK_CAPS_MBIT
        link_runs, capped_links = measure_rounds(link, common.repeats(args, full=3, quick=1), args.quick,
                                                 lambda: ddp_steps.measure_links(link_cfg, mbits, rounds=1))
        busy += [lk.busy_s for lk in capped_links.values()]
        linked = ddp_steps.validate_rounds(ddp_steps.validate_links, capped_links, link_runs)
        linked["overhead_s_per_byte"] = ddp_steps.overhead_from(link_runs, caps[0])
        df = pd.concat([df.assign(link_mbit=float("nan")), linked], ignore_index=True)
        runs = pd.concat([runs, link_runs.assign(source="simulated hosts")], ignore_index=True)
    else:
        common.note(f"capped links not measured: {reason}")
    for _, row in df.iterrows():
        common.note(point_text(row))
    (a_lo, a_hi), (b_lo, b_hi) = link.alpha_range_s, link.beta_range_s_per_byte
    fitted = {"alpha_s": link.alpha_s, "alpha_lo_s": a_lo, "alpha_hi_s": a_hi, "beta_s_per_byte": link.beta_s_per_byte,
              "beta_lo_s_per_byte": b_lo, "beta_hi_s_per_byte": b_hi}
    common.write_csv(args.out / f"{NAME}.csv", df.assign(**fitted).to_dict("records"))
    common.write_csv(args.out / f"{NAME}_runs.csv", runs.to_dict("records"))
    common.write_csv(args.out / f"{NAME}_sweep.csv", fit.to_dict("records"))
    common.write_csv(args.out / f"{NAME}_repeats.csv", sweep.to_dict("records"))
    plots.save(plots.predicted_vs_measured(df, tolerance=ddp_steps.MEDIAN_TARGET), args.out / f"{NAME}.png")

    s = ddp_steps.summary(df)
    overheads = ", ".join(f"{g * 1e9:.2f}" for g in df.drop_duplicates("bucket_cap_mb")["overhead_s_per_byte"])
    setup = (f"MLP {cfg.model_size}x{cfg.model_depth}, batch {cfg.global_batch_size}, bucket caps "
             f"{'/'.join(f'{c:g}' for c in caps)} MB; {link_text(link, busy)}; DDP overhead {overheads} ns/B")
    points = "; ".join(point_text(row) for _, row in df.iterrows())
    common.result_line("costmodel.median_error", s["median_error"], f"<= {s['median_target']:g}", quick=args.quick,
                       passed=s["median_ok"], detail=f"{s['counted']} counted points: {points}")
    common.result_line("costmodel.max_error", s["max_error"], f"<= {s['max_target']:g}", quick=args.quick,
                       passed=s["max_ok"], detail=setup)


if __name__ == "__main__":
    main()
