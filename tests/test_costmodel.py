"""The cost model: formulas, calibration, the DDP step predictor, validation and projection."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pandas as pd
import pytest

from dtlab import plots
from dtlab.core.config import RunConfig
from dtlab.core.results import RankResult, RunResult
from dtlab.cost import links as cm
from dtlab.cost.links import sweep as collectives
from dtlab.experiments import ddp_steps
from dtlab.plots import costmodel as costmodel_plots
from dtlab.tiers import ddp

ALPHA, BETA = 2e-4, 1.5e-9  # 200 us, ~0.67 GB/s: loopback-like
SIZES = [4**k * 1024 for k in range(8)]


def synthetic_sweep(op: str = "all_reduce", sizes=SIZES, group_sizes=(2,), alpha=ALPHA, beta=BETA,
                    backend: str = "gloo") -> pd.DataFrame:
    rows = []
    for n in group_sizes:
        a, b = cm.coefficients(op, n, backend)
        rows += [{"op": op, "bytes": s, "group_size": n, "seconds": a * alpha + b * s * beta} for s in sizes]
    return pd.DataFrame(rows)


# -- formulas ------------------------------------------------------------------------------------
def test_every_collective_is_free_on_one_rank():
    link = cm.LinkModel(ALPHA, BETA)
    for op in cm.OPS:
        assert link.predict(op, 1 << 20, 1) == 0.0


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_ring_all_reduce_formula_and_byte_scaling(n):
    link = cm.LinkModel(ALPHA, BETA)
    s = 1 << 20
    assert link.predict("all_reduce", s, n) == pytest.approx(2 * (n - 1) * ALPHA + 2 * (n - 1) / n * s * BETA)
    # doubling the bytes adds exactly the bandwidth term once more; the latency term stays
    extra = link.predict("all_reduce", 2 * s, n) - link.predict("all_reduce", s, n)
    assert extra == pytest.approx(2 * (n - 1) / n * s * BETA)
    assert link.predict("all_gather", s, n) == pytest.approx((n - 1) * ALPHA + (n - 1) / n * s * BETA)


def test_gloo_algorithms_differ_from_the_textbook_ring_where_gloo_does():
    gloo, ring = cm.LinkModel(ALPHA, BETA, backend="gloo"), cm.LinkModel(ALPHA, BETA, backend="ring")
    s, n = 1 << 20, 8
    # gloo's reduce_scatter is a whole all-reduce; the textbook one is half of it
    assert gloo.predict("reduce_scatter", s, n) == pytest.approx(gloo.predict("all_reduce", s, n))
    assert ring.predict("reduce_scatter", s, n) == pytest.approx(ring.predict("all_reduce", s, n) / 2)
    # gloo's broadcast is a binomial tree: log2(8) = 3 hops of the whole message
    assert gloo.predict("broadcast", s, n) == pytest.approx(3 * (ALPHA + s * BETA))
    assert ring.predict("broadcast", s, n) == pytest.approx((n - 1) * ALPHA + s * BETA)
    assert gloo.predict("all_reduce", s, n) == ring.predict("all_reduce", s, n)


def test_predict_takes_arrays_and_defaults_to_the_calibrated_world_size():
    link = cm.LinkModel(ALPHA, BETA, world_size=4)
    sizes = np.array([0, 1024, 1 << 20])
    out = link.predict("all_reduce", sizes)
    assert out.shape == (3,) and out[0] == pytest.approx(6 * ALPHA)
    assert link.predict("all_reduce", 1024) == pytest.approx(float(out[1]))


def test_from_bandwidth_units():
    link = cm.LinkModel.from_bandwidth(200, 1e-4)
    assert link.beta_s_per_byte == pytest.approx(8 / 200e6)
    assert link.bandwidth_mbit_per_s == pytest.approx(200)
    assert link.bandwidth_gbps == pytest.approx(0.025)
    assert "200 Mbit/s" in link.label


# -- calibration ------------------------------------------------------------------------------------
def test_calibration_recovers_alpha_and_beta_from_an_exact_sweep():
    link = cm.calibrate(synthetic_sweep(group_sizes=(2, 4)))
    assert link.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert link.beta_s_per_byte == pytest.approx(BETA, rel=1e-9)
    assert link.world_size == 4 and link.points == 16 and link.fit_rel_rms < 1e-9


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "broadcast", "send_recv"])
def test_calibration_uses_each_ops_own_formula(op):
    link = cm.calibrate(synthetic_sweep(op, group_sizes=(2, 4)), op)
    assert (link.alpha_s, link.beta_s_per_byte) == pytest.approx((ALPHA, BETA), rel=1e-9)
    assert link.ops == (op,)


def test_calibrate_ops_fits_each_collective_on_its_own_sweep_and_falls_back_to_the_default():
    sweep = pd.concat([synthetic_sweep("all_reduce"), synthetic_sweep("all_gather", alpha=3 * ALPHA, beta=4 * BETA)])
    links = cm.calibrate_ops(sweep, ("all_reduce", "all_gather"), draws=0, label="loopback")
    gather = links.links["all_gather"]
    assert (gather.alpha_s, gather.beta_s_per_byte) == pytest.approx((3 * ALPHA, 4 * BETA), rel=1e-9)
    assert links.predict("all_gather", 1 << 20, 2) == pytest.approx(gather.predict("all_gather", 1 << 20, 2))
    # no reduce_scatter link: the default (all_reduce's) prices it, with reduce_scatter's own formula
    assert links.predict("reduce_scatter", 1 << 20, 4) == pytest.approx(
        links.links["all_reduce"].predict("reduce_scatter", 1 << 20, 4))
    assert "(all_gather)" in gather.label
    with pytest.raises(ValueError, match="default='broadcast'"):
        cm.calibrate_ops(sweep, ("all_reduce",), default="broadcast")


def test_robust_calibration_shrugs_off_an_outlier():
    df = synthetic_sweep()
    df.loc[2, "seconds"] *= 8  # one repeat set hit by a scheduler hiccup
    robust = cm.calibrate(df)
    plain = cm.calibrate(df, robust=False)
    assert robust.alpha_s == pytest.approx(ALPHA, rel=0.05)
    assert robust.beta_s_per_byte == pytest.approx(BETA, rel=0.05)
    assert abs(plain.alpha_s / ALPHA - 1) > abs(robust.alpha_s / ALPHA - 1)


def test_calibration_never_returns_a_negative_latency():
    df = synthetic_sweep(alpha=0.0)
    df["seconds"] *= np.linspace(0.8, 1.2, len(df))  # small messages too fast: the intercept goes below zero
    link = cm.calibrate(df, robust=False)
    assert link.alpha_s == 0.0 and link.beta_s_per_byte > 0


def test_fit_frame_sets_predictions_beside_measurements():
    df = synthetic_sweep()
    link = cm.calibrate(df)
    fit = cm.fit_frame(df, link)
    assert np.allclose(fit["error"], 0, atol=1e-9) and fit["fitted_on"].all()


# -- a calibration that holds from run to run: repeats, the outlier rule, the spread ----------------------------
TOLERANCE = 0.05  # planted outliers may move alpha or beta by at most 5 %


def repeat_sweep(noise: float = 0.02, repeats: int = 15, sizes=SIZES, order=None) -> pd.DataFrame:
    """A per-repeat sweep at n = 2, as ``collectives.sweep`` measures it before reducing it: two ranks (rank 1
    always 10 % faster: the slowest rank counts), bounded deterministic noise of +-``noise``, run in ``order``
    (default: ``collectives.sweep_plan``'s) with a barrier (2 alpha) before each repeat; ``start_s`` says when."""
    order = order or collectives.sweep_plan(("all_reduce",), tuple(sizes), repeats)
    rows, clock = [], 0.0
    for rep, op, s in order:
        seconds = (2 * ALPHA + s * BETA) * (1 + noise * math.sin(1.7 * rep + 2.3 * sizes.index(s)))
        rows += [{"rank": rank, "op": op, "bytes": s, "group_size": 2, "repeat": rep, "start_s": clock,
                  "seconds": seconds * (1 - 0.1 * rank)} for rank in (0, 1)]
        clock += 2 * ALPHA + seconds
    return pd.DataFrame(rows)


def moved(link: cm.LinkModel) -> tuple[float, float]:
    return abs(link.alpha_s / ALPHA - 1), abs(link.beta_s_per_byte / BETA - 1)


def test_planted_outlier_repeats_are_dropped_and_do_not_move_the_fit():
    df = repeat_sweep()
    planted = df["repeat"].isin([4, 9]) | ((df["repeat"] == 2) & (df["bytes"] == 1024))
    df.loc[df["repeat"].isin([4, 9]), "seconds"] *= 3  # two rounds under a burst of load, every size 3x
    df.loc[(df["repeat"] == 2) & (df["bytes"] == 1024), "seconds"] *= 10  # and one scheduler hiccup
    marked = collectives.mark_outliers(df)
    truth = df[df["rank"] == 0].set_index(["bytes", "repeat"]).index.isin(
        df[planted & (df["rank"] == 0)].set_index(["bytes", "repeat"]).index)
    assert (marked.set_index(["bytes", "repeat"]).loc[df[df["rank"] == 0].set_index(["bytes", "repeat"]).index,
                                                     "outlier"].to_numpy() == truth).all()  # those, and only those
    link = cm.calibrate(df)
    assert max(moved(link)) < TOLERANCE
    assert (link.points, link.repeats, link.dropped) == (8, 120, 17)
    plain = cm.calibrate(df, robust=False)  # every repeat kept, the mean per size, ordinary least squares
    assert min(moved(plain)) > 4 * TOLERANCE
    assert cm.calibrate(collectives.size_medians(df), draws=0).alpha_s == pytest.approx(link.alpha_s)


def test_interleaving_spreads_a_load_burst_over_the_sizes():
    """A 150 ms burst of load (3x) at the start of a sweep. Run size after size (the old layout), it covers every
    repeat of the smallest sizes -- no median can help, and alpha moves; interleaved (``sweep_plan``), it covers
    about two rounds: a few repeats of each size, which the outlier rule drops."""
    sizes, repeats = list(collectives.CALIBRATION_SIZES), 25
    size_after_size = [(rep, "all_reduce", s) for s in sizes for rep in range(repeats)]
    for order, holds in ((None, True), (size_after_size, False)):
        df = repeat_sweep(repeats=repeats, sizes=sizes, order=order)
        df.loc[df["start_s"] < 0.150, "seconds"] *= 3
        assert (max(moved(cm.calibrate(df, draws=0))) < TOLERANCE) is holds


def test_the_spread_is_reported_and_grows_with_the_noise():
    exact = cm.calibrate(repeat_sweep(noise=0.0))
    assert exact.alpha_range_s == pytest.approx((ALPHA, ALPHA), rel=1e-6)
    quiet, noisy = cm.calibrate(repeat_sweep(noise=0.02)), cm.calibrate(repeat_sweep(noise=0.10))
    for link in (quiet, noisy):
        lo, hi = link.alpha_range_s
        assert lo <= link.alpha_s <= hi and lo < ALPHA * 1.05 and hi > ALPHA * 0.95
        b_lo, b_hi = link.bandwidth_range_gbps
        assert b_lo <= link.bandwidth_gbps <= b_hi
        assert "bootstrap" in link.spread_method and "repeats and sizes" in link.spread_method
        text = link.describe()
        assert f"{lo * 1e6:.3g}-{hi * 1e6:.3g} us" in text and f"{b_lo:.3g}-{b_hi:.3g} GB/s" in text
        assert "120 repeats" in text
    width = [link.alpha_range_s[1] - link.alpha_range_s[0] for link in (quiet, noisy)]
    assert width[1] > 2 * width[0]
    assert cm.calibrate(repeat_sweep(noise=0.02)).alpha_range_s == quiet.alpha_range_s  # seeded: reproducible
    per_size = cm.calibrate(synthetic_sweep())  # one time per size: the bootstrap runs over sizes only
    assert per_size.spread_method.endswith("over sizes") and per_size.repeats == 0
    assert math.isnan(cm.calibrate(synthetic_sweep(), draws=0).alpha_range_s[0])
    assert cm.LinkModel(ALPHA, BETA).spread_text() == ""  # a link built by hand has no spread
    slow = cm.capped(quiet, 200)  # the cap binds: beta is the cap's, without spread; alpha keeps its own
    assert math.isnan(slow.beta_range_s_per_byte[0]) and slow.alpha_range_s == quiet.alpha_range_s


def test_fit_frame_reduces_a_per_repeat_sweep_to_one_row_per_size():
    df = repeat_sweep()
    fit = cm.fit_frame(df, cm.calibrate(df, draws=0))
    assert list(fit["bytes"]) == SIZES and (fit["repeats"] == 15).all() and "dropped" in fit.columns
    assert fit["error"].abs().max() < 0.03
    with pytest.raises(ValueError, match="at least 3"):
        cm.calibrate(synthetic_sweep(sizes=SIZES[:2]))


# -- bad input ----------------------------------------------------------------------------------------
def test_bad_input_names_what_is_wrong():
    link = cm.LinkModel(ALPHA, BETA)
    with pytest.raises(ValueError, match="all_to_none"):
        link.predict("all_to_none", 1024, 2)
    with pytest.raises(ValueError, match="world_size"):
        link.predict("all_reduce", 1024, 0)
    with pytest.raises(ValueError, match="bytes"):
        link.predict("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="empty"):
        cm.calibrate(pd.DataFrame())
    with pytest.raises(ValueError, match="all_to_none"):
        cm.calibrate(synthetic_sweep(), "all_to_none")
    with pytest.raises(ValueError, match="column"):
        cm.calibrate(pd.DataFrame({"op": ["all_reduce"], "bytes": [1024]}))
    with pytest.raises(ValueError, match="no usable rows"):
        cm.calibrate(synthetic_sweep(), "broadcast")
    with pytest.raises(ValueError, match="backend"):
        cm.LinkModel(ALPHA, BETA, backend="carrier-pigeon")
    with pytest.raises(ValueError, match="beta"):
        cm.LinkModel(ALPHA, 0.0)
    with pytest.raises(ValueError, match="mbit_per_s"):
        cm.LinkModel.from_bandwidth(-5, ALPHA)
    with pytest.raises(ValueError, match="optimizer"):
        cm.predict_ddp_step({"data": 0, "forward": 0, "backward": 0}, [1024], link, 2)
    with pytest.raises(ValueError, match="bucket_bytes"):
        cm.predict_ddp_step({p: 0.001 for p in cm.COMPUTE_PHASES}, [1024, -8], link, 2)
    with pytest.raises(ValueError, match="world_size"):
        cm.predict_ddp_step({p: 0.001 for p in cm.COMPUTE_PHASES}, [1024], link, 0)


# -- one DDP step ---------------------------------------------------------------------------------------
PHASES = {"data": 0.001, "forward": 0.002, "backward": 0.010, "optimizer": 0.003}


def test_ddp_step_by_hand_early_buckets_overlap_the_last_does_not():
    # all_reduce at n = 2: 2 alpha + S beta = 1 ms + S us
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    pred = cm.predict_ddp_step(PHASES, [4000, 4000, 2000], link, 2, overhead_s=0.0005)
    # ready at 4, 8, 10 ms (their share of backward's bytes); runs 4-9, 9-14, 14-17 ms
    starts_ends = [t for b in pred.buckets for t in (b.ready_s, b.start_s, b.end_s)]
    assert starts_ends == pytest.approx([0.004, 0.004, 0.009, 0.008, 0.009, 0.014, 0.010, 0.014, 0.017])
    assert pred.buckets[0].end_s < PHASES["backward"]  # hidden behind backward
    assert pred.buckets[-1].start_s > PHASES["backward"]  # the last one is exposed
    assert pred.step_s == pytest.approx(0.001 + 0.002 + 0.017 + 0.003 + 0.0005)
    assert pred.comm_s == pytest.approx(0.013)
    assert pred.exposed_comm_s == pytest.approx(0.007)
    assert pred.hidden_comm_s == pytest.approx(0.006)


def test_ddp_step_on_a_fast_link_costs_only_the_last_bucket():
    link = cm.LinkModel(alpha_s=0.0, beta_s_per_byte=1e-9)
    pred = cm.predict_ddp_step(PHASES, [4000, 4000, 2000], link, 2)
    assert pred.exposed_comm_s == pytest.approx(2000e-9)  # only the last bucket's 2 us
    assert pred.step_s == pytest.approx(sum(PHASES.values()) + 2000e-9)


def test_ddp_step_without_a_spare_core_overlaps_nothing():
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    pred = cm.predict_ddp_step(PHASES, [4000, 4000, 2000], link, 2, overhead_s=0.0005, overlap=False)
    # every all-reduce after backward's 10 ms: 10-15, 15-20, 20-23 ms
    assert [t for b in pred.buckets for t in (b.start_s, b.end_s)] == pytest.approx([0.010, 0.015, 0.015, 0.020,
                                                                                     0.020, 0.023])
    assert pred.exposed_comm_s == pytest.approx(pred.comm_s) == pytest.approx(0.013)
    assert pred.step_s == pytest.approx(sum(PHASES.values()) + 0.013 + 0.0005)
    assert cm.spare_cores(2, 1, cores=2) is False and cm.spare_cores(2, 1, cores=4) is True
    assert cm.spare_cores(3, 1, cores=4) is True and cm.spare_cores(2, 2, cores=4) is False


def test_ddp_step_pays_the_links_busy_s_once_and_only_with_peers():
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    busy = dataclasses.replace(link, busy_s=0.004)
    plain = cm.predict_ddp_step(PHASES, [4000, 4000, 2000], link, 2)
    pred = cm.predict_ddp_step(PHASES, [4000, 4000, 2000], busy, 2)
    assert pred.busy_s == 0.004 and pred.step_s == pytest.approx(plain.step_s + 0.004)
    assert cm.timeline_frame(pred)["end"].max() == pytest.approx(pred.step_s)
    alone = cm.predict_ddp_step(PHASES, [4000], busy, 1)
    assert alone.busy_s == 0 and alone.step_s == pytest.approx(sum(PHASES.values()))


def test_ddp_step_on_one_rank_is_compute_plus_overhead():
    pred = cm.predict_ddp_step(PHASES, [4000, 4000], cm.LinkModel(ALPHA, BETA), 1, overhead_s=0.002)
    assert pred.step_s == pytest.approx(sum(PHASES.values()) + 0.002)
    assert pred.comm_s == 0 and not pred.buckets


def test_timeline_frame_spans_the_predicted_step():
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    pred = cm.predict_ddp_step(PHASES, [4000, 4000, 2000], link, 2, overhead_s=0.0005)
    frame = cm.timeline_frame(pred)
    assert frame["end"].max() == pytest.approx(pred.step_s)
    idle = frame[frame["phase"] == "idle"].iloc[0]
    assert idle["end"] - idle["start"] == pytest.approx(pred.exposed_comm_s)
    assert (frame["lane"] == "comm").sum() == 3
    assert plots.gantt(frame) is not None


# -- validation (no processes) -----------------------------------------------------------------------------
def run_row(role, n, batch, step_s, phases=PHASES, buckets=(4000, 4000, 2000), threads=1, rnd=0):
    return {"round": rnd, "role": role, "world_size": n, "per_rank_batch": batch, "threads_per_rank": threads,
            "step_s": step_s, **phases, "bucket_sizes_bytes": list(buckets) if role != "compute" else []}


def synthetic_runs(measured_n2: float) -> pd.DataFrame:
    half = {k: v / 2 for k, v in PHASES.items()}
    return pd.DataFrame([
        run_row("compute", 1, 64, sum(PHASES.values()), buckets=[]),
        run_row("ddp", 1, 64, 0.02),
        run_row("compute", 1, 32, sum(half.values()), phases=half),
        run_row("ddp", 2, 32, measured_n2),
        run_row("compute", 1, 16, 0.004, phases={k: v / 4 for k, v in PHASES.items()}),
        run_row("ddp", 4, 16, 0.05),
        run_row("overhead_single", 1, 8, 0.010),
        run_row("overhead_ddp", 1, 8, 0.011),  # 1 ms over 10000 gradient bytes
    ])


def test_validation_never_uses_the_measured_ddp_time_to_predict():
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    a = ddp_steps.validate(link, synthetic_runs(0.020), cores=2)
    b = ddp_steps.validate(link, synthetic_runs(0.040), cores=2)
    assert list(a["world_size"]) == [1, 2, 4]
    assert np.allclose(a["predicted_s"], b["predicted_s"])
    half = {k: v / 2 for k, v in PHASES.items()}
    # 2 ranks x 1 thread on 2 cores: no core to spare, so no bucket overlaps backward
    expected = cm.predict_ddp_step(half, [4000, 4000, 2000], link, 2, overhead_s=0.001, overlap=False).step_s
    assert a.loc[a["world_size"] == 2, "predicted_s"].iloc[0] == pytest.approx(expected)
    assert a.loc[a["world_size"] == 2, "error"].iloc[0] == pytest.approx(abs(expected / 0.020 - 1))
    spare = ddp_steps.validate(link, synthetic_runs(0.020), cores=8)  # a core to spare: the first buckets hide
    overlapped = cm.predict_ddp_step(half, [4000, 4000, 2000], link, 2, overhead_s=0.001).step_s
    assert spare.loc[spare["world_size"] == 2, "predicted_s"].iloc[0] == pytest.approx(overlapped)
    assert overlapped < expected
    assert list(a["oversubscribed"]) == [False, False, True] and list(a["counted"]) == [True, True, False]
    assert plots.predicted_vs_measured(a, tolerance=ddp_steps.MEDIAN_TARGET) is not None


def test_validation_per_bucket_cap_uses_that_caps_overhead():
    half = {k: v / 2 for k, v in PHASES.items()}
    rows = [run_row("compute", 1, 32, sum(half.values()), phases=half),
            run_row("overhead_single", 1, 8, 0.010)]
    for cap, buckets, overhead_step in ((25.0, [10000], 0.012), (0.004, [4000, 4000, 2000], 0.011)):
        rows += [{**run_row("ddp", 2, 32, 0.03, buckets=buckets), "bucket_cap_mb": cap},
                 {**run_row("overhead_ddp", 1, 8, overhead_step, buckets=buckets), "bucket_cap_mb": cap}]
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    df = ddp_steps.validate(link, pd.DataFrame(rows), cores=2).set_index("bucket_cap_mb")
    assert df.loc[25.0, "overhead_s"] == pytest.approx(0.002) and df.loc[0.004, "overhead_s"] == pytest.approx(0.001)
    one = cm.predict_ddp_step(half, [10000], link, 2, overhead_s=0.002)
    assert df.loc[25.0, "predicted_s"] == pytest.approx(one.step_s)
    assert one.hidden_comm_s == 0  # a single bucket is ready only when backward ends
    assert df.loc[25.0, "label"] == "n=2, 1 bucket" and df.loc[0.004, "buckets"] == 3


def test_validation_round_by_round_pairs_each_rounds_prediction_with_its_measurement():
    """Round 1 runs on a machine twice as slow: each round is predicted from its own compute and busy_s and
    scored against its own measurement; DDP's overhead comes from both rounds."""
    slow = synthetic_runs(0.020)
    for col in ("step_s", *PHASES):
        slow[col] = slow[col] * 2
    runs = pd.concat([synthetic_runs(0.020), slow.assign(round=1)], ignore_index=True)
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    links = {0: link, 1: dataclasses.replace(link, busy_s=1e-3)}
    df = ddp_steps.validate_rounds(ddp_steps.validate, links, runs, cores=2).set_index("world_size")
    half = {k: v / 2 for k, v in PHASES.items()}
    overhead = 0.0015  # (median 16.5 ms - median 15 ms) over 10000 gradient bytes, both rounds
    predicted = [cm.predict_ddp_step({k: v * scale for k, v in half.items()}, [4000, 4000, 2000], links[r], 2,
                                     overhead_s=overhead, overlap=False).step_s for r, scale in ((0, 1), (1, 2))]
    errors = [predicted[0] / 0.020 - 1, predicted[1] / 0.040 - 1]
    assert df.loc[2, "signed_error"] == pytest.approx(sum(errors) / 2)
    assert df.loc[2, "error"] == pytest.approx(abs(sum(errors) / 2))
    assert df.loc[2, "predicted_s"] == pytest.approx(sum(predicted) / 2)
    assert df.loc[2, "measured_s"] == pytest.approx(0.030) and df.loc[2, "measured_spread_s"] == pytest.approx(0.020)
    assert df.loc[2, "rounds"] == 2 and list(df.index) == [1, 2, 4]
    assert ddp_steps.summary(df.reset_index())["counted"] == 2
    with pytest.raises(ValueError, match=r"no link for round\(s\) \[1\]"):
        ddp_steps.validate_rounds(ddp_steps.validate, {0: link}, runs, cores=2)


def test_runs_read_back_from_csv_keep_typed_bucket_sizes(tmp_path):
    runs = synthetic_runs(0.020)
    path = tmp_path / "runs.csv"
    runs.assign(bucket_sizes_bytes=[json.dumps(v) for v in runs["bucket_sizes_bytes"]]).to_csv(path, index=False)
    back = ddp_steps.read_runs(path)
    assert list(back["bucket_sizes_bytes"]) == list(runs["bucket_sizes_bytes"])
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-6)
    assert np.allclose(ddp_steps.validate(link, back, cores=2)["predicted_s"],
                       ddp_steps.validate(link, runs, cores=2)["predicted_s"])
    old = tmp_path / "old.csv"  # written before the sizes were typed: space-separated, empty for compute rows
    runs.assign(bucket_sizes_bytes=[" ".join(map(str, v)) for v in runs["bucket_sizes_bytes"]]).to_csv(old, index=False)
    assert list(ddp_steps.read_runs(old)["bucket_sizes_bytes"]) == list(runs["bucket_sizes_bytes"])
    with pytest.raises(ValueError, match="read_runs"):  # text that was never parsed is named, not misread
        ddp_steps.validate(link, runs.assign(bucket_sizes_bytes="4000 4000 2000"), cores=2)


def test_capped_link_takes_the_slower_bandwidth_and_keeps_alpha():
    link = cm.LinkModel(alpha_s=300e-6, beta_s_per_byte=1 / 0.7e9)
    slow = cm.capped(link, 200)
    assert slow.alpha_s == link.alpha_s and slow.bandwidth_mbit_per_s == pytest.approx(200)
    assert cm.capped(link, 100_000).beta_s_per_byte == link.beta_s_per_byte  # faster than the link: no change
    assert "capped at 200 Mbit/s" in slow.label


def test_validate_links_predicts_each_cap_from_the_loopback_link_only():
    half = {k: v / 2 for k, v in PHASES.items()}
    rows = [{**run_row("compute", 1, 32, sum(half.values()), phases=half), "link_mbit": np.nan},
            {**run_row("overhead_single", 1, 8, 0.010), "link_mbit": np.nan},
            {**run_row("overhead_ddp", 1, 8, 0.011, buckets=[10000]), "bucket_cap_mb": 25.0, "link_mbit": np.nan}]
    for mbit, measured in ((1000.0, 0.03), (200.0, 0.09)):
        rows.append({**run_row("ddp", 2, 32, measured, buckets=[10000]), "bucket_cap_mb": 25.0, "link_mbit": mbit})
    link = cm.LinkModel(alpha_s=0.5e-3, beta_s_per_byte=1e-9)
    df = ddp_steps.validate_links(link, pd.DataFrame(rows), cores=2).set_index("link_mbit")
    for mbit in (1000.0, 200.0):
        expected = cm.predict_ddp_step(half, [10000], cm.capped(link, mbit), 2, overhead_s=0.001).step_s
        assert df.loc[mbit, "predicted_s"] == pytest.approx(expected)
    assert df.loc[200.0, "label"] == "n=2, 200 Mbit/s simulated hosts"
    assert df.loc[1000.0, "label"] == "n=2, 1 Gbit/s simulated hosts"
    with pytest.raises(ValueError, match="no link_mbit column"):
        ddp_steps.validate_links(link, synthetic_runs(0.02))


def test_summary_counts_only_counted_points():
    df = pd.DataFrame({"error": [0.05, 0.10, 0.90], "counted": [True, True, False]})
    s = ddp_steps.summary(df)
    assert s["median_error"] == pytest.approx(0.075) and s["max_error"] == pytest.approx(0.10)
    assert s["passed"] and s["counted"] == 2 and s["reported"] == 3
    assert not ddp_steps.summary(df.assign(counted=True))["max_ok"]
    with pytest.raises(ValueError, match="counted"):
        ddp_steps.summary(df.assign(counted=False))


# -- steady state ------------------------------------------------------------------------------------------
def fake_result(totals_by_rank, first_step=0):
    ranks = [RankResult(rank=r, steps=[{"step": first_step + i, "total": t, **PHASES} for i, t in enumerate(totals)],
                        memory={}, events=[], phases=[], params_checksum=0.0)
             for r, totals in enumerate(totals_by_rank)]
    return RunResult(config=None, ranks=ranks, wall_s=0.0)


def test_steady_leaves_out_the_warm_up_steps_and_keeps_at_least_one():
    result = fake_result([[0.9, 0.2, 0.1, 0.3, 0.5], [0.8, 0.1, 0.4, 0.1, 0.2]])
    assert sorted(result.steady()["step"].unique()) == [1, 2, 3, 4]  # the default leaves out step 0
    assert sorted(result.steady(3)["step"].unique()) == [3, 4]
    assert sorted(result.steady(0)["step"].unique()) == [0, 1, 2, 3, 4]
    assert sorted(result.steady(99)["step"].unique()) == [4]  # too short: the last step stays
    assert len(result.steady(3)) == 4  # every rank's rows of the kept steps
    assert result.median_step_s() == pytest.approx(0.35)  # slowest rank per step: 0.2, 0.4, 0.3, 0.5
    assert result.median_step_s(3) == pytest.approx(0.4)
    resumed = fake_result([[0.9, 0.2, 0.1]], first_step=7)  # a resumed run's first step warms up too
    assert sorted(resumed.steady()["step"].unique()) == [8, 9]
    with pytest.raises(ValueError, match="warmup_steps"):
        result.steady(-1)


# -- projection ---------------------------------------------------------------------------------------------
def test_projection_is_monotonic_and_bounded():
    slow, fast = cm.LinkModel.from_bandwidth(200, 1e-4), cm.LinkModel.from_bandwidth(100_000, 1e-4)
    df = cm.project(0.05, 100 * 2**20, [slow, fast], bucket_bytes=25 * 2**20)
    for _, rows in df.groupby("link"):
        rows = rows.sort_values("world_size")
        assert rows["step_s"].is_monotonic_increasing  # a ring only gets longer with n
        assert rows["speedup"].is_monotonic_increasing
        assert (rows["efficiency"] <= 1 + 1e-12).all() and (rows["step_s"] >= 0.05).all()
    by = df.pivot(index="world_size", columns="link", values="speedup")
    assert (by[fast.label] > by[slow.label]).all()
    hidden = cm.project(0.05, 100 * 2**20, [fast], overlap=1.0)
    exposed = cm.project(0.05, 100 * 2**20, [fast], overlap=0.0)
    assert (hidden["step_s"].to_numpy() <= exposed["step_s"].to_numpy()).all()
    assert costmodel_plots.projection(df) is not None


def test_assumptions_say_it_is_a_simulation_and_name_each_link():
    links = [cm.LinkModel.from_bandwidth(200, 1e-4), cm.LinkModel(ALPHA, BETA, label="loopback")]
    lines = cm.assumptions(links, 0.05, 2**20)
    assert lines[0].startswith("SIMULATION")
    assert sum("Link " in line for line in lines) == 2


def test_split_buckets():
    assert cm.split_buckets(10, 4) == [4, 4, 2]
    assert cm.split_buckets(8, 4) == [4, 4]
    with pytest.raises(ValueError, match="bucket_bytes"):
        cm.split_buckets(8, 0)


# -- one real run ---------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("no_survivors")
def test_end_to_end_calibrate_predict_measure_at_world_size_2():
    sweep = collectives.sweep(2, ops=("all_reduce",), sizes=(4096, 65536, 1 << 20, 4 << 20), repeats=5)
    link = cm.calibrate(sweep)
    assert link.alpha_s >= 0 and 1e6 < link.bandwidth_bytes_per_s < 1e12
    cfg = RunConfig(tier="ddp", world_size=2, model="mlp", model_size=512, model_depth=2, dataset="synthetic",
                    dataset_size=512, global_batch_size=32, steps=30, optimizer="sgd", threads_per_rank=1,
                    tier_options=ddp.Options(bucket_cap_mb=0.25))  # 1.2 MB of gradients in 3 buckets
    runs = ddp_steps.measure(cfg, world_sizes=(2,), rounds=1)
    assert set(runs["role"]) == {"compute", "ddp", "overhead_single", "overhead_ddp"}
    compute = runs[runs["role"] == "compute"].iloc[0]  # timed in two copies at once, as the two ranks compute
    assert compute["copies"] == 2 and compute["threads_per_rank"] == 1 and compute["per_rank_batch"] == 16
    assert compute["step_s"] == pytest.approx(sum(compute[p] for p in cm.COMPUTE_PHASES)) and compute["backward"] > 0
    sizes = runs.loc[runs["role"] == "ddp", "bucket_sizes_bytes"].iloc[0]  # typed, as the ddp tier reports them
    assert isinstance(sizes, list) and len(sizes) >= 2 and all(type(b) is int for b in sizes)
    df = ddp_steps.validate(link, runs)
    row = df.iloc[0]
    assert row["world_size"] == 2 and row["buckets"] >= 2 and row["comm_s"] > 0
    assert math.isfinite(row["predicted_s"]) and row["predicted_s"] > row["compute_s"]
    # a sanity bound only: a few-ms step on a shared 2-core machine varies by 2x from run to run
    assert 1 / 4 < row["predicted_s"] / row["measured_s"] < 4


def _busy_rows(per_round: list[tuple[float, float, float]]) -> list[dict]:
    """Rows as ``busy_rank`` returns them, two ranks; rank 1 always 1 ms slower."""
    return [{"rank": rank, "round": rnd, "mode": mode, "seconds": s + rank * 1e-3}
            for rnd, times in enumerate(per_round) for mode, s in zip(cm.busy.BUSY_MODES, times) for rank in (0, 1)]


def test_busy_excess_is_the_median_round_of_both_minus_its_parts():
    rows = _busy_rows([(5e-3, 1e-3, 8e-3), (5e-3, 1e-3, 9e-3), (5e-3, 1e-3, 20e-3)])
    # per round, each mode's slowest rank (rank 1): 9 - 6 - 2 = 1 ms, 2 ms, 13 ms; the median round: 2 ms
    assert cm.busy_excess(rows) == pytest.approx(2e-3)
    assert cm.busy_excess(rows, collective_s=0.5e-3) == pytest.approx(3.5e-3)  # a link's price in its place
    assert cm.busy_excess(_busy_rows([(5e-3, 1e-3, 6e-3)])) == 0.0  # over the timed all-reduce: never below zero
    # over a price that overshoots the all-reduce, the excess takes the overshoot back: 7 - 6 - 3 = -2 ms
    assert cm.busy_excess(_busy_rows([(5e-3, 1e-3, 6e-3)]), collective_s=3e-3) == pytest.approx(-2e-3)
    with pytest.raises(ValueError, match="every round needs the modes"):
        cm.busy_excess([r for r in rows if r["mode"] != "both"])


def test_busy_at_runs_straight_between_the_two_spacings_and_holds_at_either_end():
    link = cm.LinkModel.from_bandwidth(1000, 50e-6)
    assert cm.busy_at(dataclasses.replace(link, busy_s=2e-3), 1e-4) == 2e-3  # no short figure: busy_s everywhere
    both = dataclasses.replace(link, busy_s=2e-3, busy_short_s=0.5e-3)
    assert cm.busy_at(both, cm.BUSY_SHORT_COMPUTE_S) == pytest.approx(0.5e-3)
    assert cm.busy_at(both, 1e-5) == pytest.approx(0.5e-3)  # held below the short spacing
    assert cm.busy_at(both, cm.BUSY_COMPUTE_S) == pytest.approx(2e-3)
    assert cm.busy_at(both, 0.1) == pytest.approx(2e-3)  # and above the long one
    halfway = (cm.BUSY_SHORT_COMPUTE_S + cm.BUSY_COMPUTE_S) / 2
    assert cm.busy_at(both, halfway) == pytest.approx(1.25e-3)
    linkset = cm.LinkSet({"all_reduce": link}, link, busy_s=2e-3, busy_short_s=0.5e-3)
    assert cm.busy_at(linkset, halfway) == pytest.approx(1.25e-3)


def test_calibrate_busy_names_a_bad_argument_before_starting_anything():
    for kwargs, field in (({"rounds": 0}, "rounds"), ({"nbytes": 0}, "nbytes"), ({"compute_s": 0.0}, "compute_s"),
                          ({"world_size": 1}, "world_size"), ({"world_size": 0}, "world_size")):
        with pytest.raises(ValueError, match=field):
            cm.calibrate_busy(**kwargs)


@pytest.mark.slow
def test_calibrate_busy_measures_a_launched_job(no_survivors):
    busy = cm.calibrate_busy(2, rounds=2, iterations=5, compute_s=1e-3)
    assert math.isfinite(busy) and 0.0 <= busy < 0.5
    # a near-free price: the excess over it is about the all-reduce's whole cost in the synthetic step
    link = cm.with_busy(cm.LinkModel.from_bandwidth(1e6, 1e-6), 2, rounds=2, iterations=5)
    assert all(math.isfinite(v) and -1e-3 < v < 0.5 for v in (link.busy_s, link.busy_short_s))
    assert link.alpha_s == 1e-6  # the price is kept; only the busy figures are measured
    # a link that prices the all-reduce at 1 s: the excess takes the overshoot back, price + excess stays the
    # all-reduce's cost in the synthetic step (well under a second)
    dear = cm.with_busy(cm.LinkModel.from_bandwidth(1000, 1.0), 2, rounds=2, iterations=5)
    in_step = dear.predict("all_reduce", 64 * 1024, 2) + dear.busy_short_s
    assert dear.busy_s < -0.5 and 0.0 < in_step < 0.5
