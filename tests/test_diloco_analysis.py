"""dtlab.read.diloco and diloco_link's own checks: held-out curves judged like for like."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dtlab.read import diloco as judge
from tests import bench_scripts


def _benchmark():
    return bench_scripts.load("diloco_link")


def _curve(losses, seconds_per_point=1.0, samples_per_point=64):
    n = len(losses)
    return pd.DataFrame({"step": range(1, n + 1), "samples": [samples_per_point * (i + 1) for i in range(n)],
                         "time_s": [seconds_per_point * (i + 1) for i in range(n)], "heldout_loss": losses})


def test_first_reach_is_the_first_evaluation_at_or_below_the_target_and_nan_when_never():
    curve = _curve([2.0, 1.5, 1.0, 1.2, 0.8])
    assert judge.first_reach(curve, 1.0) == 3.0  # the first crossing, not the last point below
    assert judge.first_reach(curve, 1.25) == 3.0
    assert judge.first_reach(curve, 1.25, interpolate=True) == pytest.approx(2.5)  # halfway from 1.5 to 1.0
    assert math.isnan(judge.first_reach(curve, 0.5))
    assert judge.reached_text(judge.first_reach(curve, 0.5)) == "not reached"
    assert judge.reached_text(3.0) == "3.00 s"


def test_the_verdict_is_met_only_when_every_seed_reaches_the_target_within_the_bound():
    assert judge.verdict([0.2, 0.4, 0.5], 0.5)["met"]
    assert not judge.verdict([0.2, 0.4, 0.51], 0.5)["met"]
    unreached = judge.verdict([0.2, math.nan, 0.3], 0.5)
    assert not unreached["met"] and unreached["not_reached"] == 1
    assert not judge.verdict([], 0.5)["met"]


def test_unequal_sample_budgets_and_a_replay_away_from_its_run_are_problems():
    same = {"ddp": _curve([2.0, 1.0]), "diloco": _curve([2.1, 1.1])}
    assert judge.consistency_problems(same, {"ddp": 1e-6}) == []
    half = {**same, "one group": _curve([2.1, 1.1], samples_per_point=32)}
    problems = judge.consistency_problems(half, {"ddp": 0.0})
    assert len(problems) == 1 and "different sample budgets" in problems[0] and "one group 64" in problems[0]
    assert "ends +0.0500" in judge.consistency_problems(same, {"ddp": 0.05})[0]


def _rows(bench, ddp_gap=0.0):
    base = dict(seed=0, link_mbit=200.0, fragments=1, comm_dtype="fp32", payload_bytes_per_step=100.0)
    return [dict(base, variant="ddp@200", h=0, heldout_final=1.0, replay_gap=ddp_gap),
            dict(base, variant="diloco_h5@200", h=5, heldout_final=0.9, replay_gap=math.nan,
                 payload_bytes_per_step=20.0),
            dict(base, variant="diloco_h50@200", h=50, heldout_final=1.3, replay_gap=math.nan,
                 payload_bytes_per_step=2.0)]


def test_the_benchmark_reports_a_run_that_never_reaches_the_target_as_not_reached():
    bench = _benchmark()
    rows = _rows(bench)
    curves = {(0, "ddp@200"): _curve([2.0, 1.4, 1.0, 1.0]), (0, "diloco_h5@200"): _curve([1.8, 0.9, 0.9, 0.9], 0.3),
              (0, "diloco_h50@200"): _curve([2.0, 1.8, 1.5, 1.3], 0.1)}
    assert bench.judge_seed(rows, curves) == []
    by = {r["variant"]: r for r in rows}
    assert by["ddp@200"]["time_to_target_s"] == 3.0 and by["ddp@200"]["time_ratio"] == 1.0
    assert by["diloco_h5@200"]["time_ratio"] == pytest.approx(0.6 / 3.0)
    assert by["diloco_h5@200"]["bytes_ratio"] == pytest.approx(0.2)
    assert by["diloco_h50@200"]["reached"] == "not reached" and math.isnan(by["diloco_h50@200"]["time_ratio"])
    assert judge.best_h(rows, bench.SLOW) == "diloco_h5@200"  # a run that never reaches the target never wins


def test_the_benchmark_fails_on_a_one_group_result_or_a_replay_that_drifted():
    bench = _benchmark()
    # one group finished alone: half of each global batch, so half the samples of DDP's budget
    curves = {(0, "ddp@200"): _curve([2.0, 1.0]), (0, "diloco_h5@200"): _curve([1.8, 0.9], 0.3, 32),
              (0, "diloco_h50@200"): _curve([2.0, 1.3], 0.1)}
    problems = bench.judge_seed(_rows(bench), curves)
    assert len(problems) == 1 and "seed 0: the runs consumed different sample budgets" in problems[0]
    curves[(0, "diloco_h5@200")] = _curve([1.8, 0.9], 0.3)
    assert "replayed held-out loss ends" in bench.judge_seed(_rows(bench, ddp_gap=0.2), curves)[0]


def test_the_arithmetic_bytes_ratio_is_the_codes_size_over_h():
    bench = _benchmark()
    assert bench.arithmetic_ratio(bench.Variant("d", 200.0, 20), 1000) == pytest.approx(1 / 20)
    int8 = bench.Variant("d", 200.0, 20, dtype="int8")
    assert bench.arithmetic_ratio(int8, 1280) == pytest.approx((1280 + 10 * 4) / (4 * 1280 * 20))
