"""Goodput: the model against hand-computed values, the fault schedules, the figure, and one quick end-to-end run."""

from __future__ import annotations

import math
import random

import pandas as pd
import pytest

from dtlab.cost import goodput as gm
from dtlab.experiments import goodput
from dtlab.experiments import goodput as goodput_measure
from dtlab.plots.goodput import goodput_figure


def test_young_and_daly_by_hand():
    assert gm.young_interval(2.0, 100.0) == pytest.approx(20.0)
    # x = 2 / 200 = 0.01: 20 * (1 + 0.1 / 3 + 0.01 / 9) - 2
    assert gm.daly_interval(2.0, 100.0) == pytest.approx(18.688889, rel=1e-6)
    assert gm.daly_interval(300.0, 100.0) == 100.0  # a save longer than 2M: checkpoint every M
    assert gm.interval_steps(gm.Restart(0.5, 2.0, 0.0), 100.0) == 37  # 18.69 s / 0.5 s
    with pytest.raises(ValueError, match="mtbf_s"):
        gm.young_interval(1.0, 0.0)


def test_restart_model_by_hand():
    # (M + R) (e^((W + d) / M) - 1) = 12 (e^0.2 - 1)
    assert gm.segment_s(1.0, 1.0, 2.0, 10.0) == pytest.approx(12.0 * (math.exp(0.2) - 1.0))
    c = gm.Restart(step_s=0.1, save_s=1.0, restart_s=2.0)
    assert gm.restart_goodput(c, 10.0, every=10) == pytest.approx(10.0 / (12.0 * (math.exp(0.2) - 1.0)))
    assert gm.restart_goodput(c, math.inf, every=10) == pytest.approx(5.0)  # k / (k t + d)
    assert gm.restart_goodput(c, 1e9, every=10) == pytest.approx(5.0, rel=1e-6)
    slow_persist = gm.Restart(0.1, 1.0, 2.0, persist_s=3.0)
    assert gm.restart_goodput(slow_persist, 10.0, every=10) < gm.restart_goodput(c, 10.0, every=10)
    # Daly's interval is (near) the best whole number of steps
    best = max(range(1, 400), key=lambda k: gm.restart_goodput(c, 50.0, every=k))
    assert abs(gm.interval_steps(c, 50.0) - best) <= 0.1 * best


def test_per_fault_model_and_break_even_by_hand():
    assert gm.per_fault_goodput(gm.PerFault(0.1, 5.0), 10.0) == pytest.approx(1.0 / 0.15)
    assert gm.break_even_steps(0.002, 2.8) == pytest.approx(1400.0)
    assert gm.break_even_overhead(0.9, 0.99) == pytest.approx(0.1)
    restart, per_step = gm.Restart(0.10, 0.5, 20.0), gm.PerFault(0.12, 1.0)
    m = gm.break_even_mtbf(per_step, restart)
    assert m is not None and gm.goodput(per_step, m) == pytest.approx(gm.goodput(restart, m), rel=1e-6)
    assert gm.goodput(per_step, m / 10) > gm.goodput(restart, m / 10)  # faults more often: per-step wins
    assert gm.goodput(per_step, m * 10) < gm.goodput(restart, m * 10)
    assert gm.break_even_mtbf(gm.PerFault(0.1, 1.0), gm.PerFault(0.2, 1.0)) is None  # one always better


def test_llama3_projection_figures():
    assert gm.LLAMA3.mtbf_s == pytest.approx(54 * 86400 / 419)  # about 3.09 h
    assert gm.LLAMA3.mtbf_at([2 * 16384]) == [pytest.approx(gm.LLAMA3.mtbf_s / 2)]
    proj = goodput.projection()
    at = proj[proj["gpus"] == 16384].set_index("variant")["fraction"]
    assert at["restart, async save"] > at["restart, sync save"]
    assert (proj.groupby("variant")["fraction"].apply(lambda s: s.is_monotonic_decreasing)).all()


def test_fault_schedules():
    rng = random.Random(3)
    faults = goodput_measure.elastic_schedule(30.0, 5000, 7, rng)
    resumes = [0] + [f // 7 * 7 for f in faults[:-1]]
    assert faults and all(r < f < 5000 for r, f in zip(resumes, faults))
    assert goodput_measure.redone_steps([9, 14, 20], 7) == 2 + 0 + 6
    gaps = pd.Series(goodput_measure.replica_schedule(50.0, 200_000, random.Random(1))).diff().dropna()
    assert (gaps >= 1).all() and gaps.mean() == pytest.approx(50.5, rel=0.05)  # Exp(50) rounded up
    assert goodput_measure.replica_schedule(50.0, 200, random.Random(1)) == \
        goodput_measure.replica_schedule(50.0, 200, random.Random(1))


def _frame() -> pd.DataFrame:
    curve = [{"kind": "curve", "variant": v, "mtbf_s": m, "goodput": g * m / (m + 1)}
             for v, g in (("ft", 50.0), ("restart, DCP save", 80.0)) for m in (0.1, 1.0, 10.0)]
    point = [{"kind": "point", "variant": "ft", "mtbf_s": 1.0, "goodput": 24.0}]
    return pd.DataFrame(curve + point + goodput.projection().to_dict("records"))


def test_figure_draws_curves_points_and_projection():
    fig = goodput_figure(_frame())
    left, right = fig.axes
    assert left.get_xscale() == "log" and "MTBF (s)" in left.get_xlabel() and "steps per" in left.get_ylabel()
    assert {line.get_label() for line in left.lines} == {"ft (predicted)", "restart, DCP save (predicted)"}
    assert len(left.collections) == 1 and left.collections[0].get_offsets().shape == (1, 2)
    assert "PROJECTION" in right.get_title() and len(right.lines) == 3 + 1  # three variants and the marker
    with pytest.raises(ValueError, match="curve"):
        goodput_figure(_frame().query("kind != 'curve'"))


def test_quick_run_is_consistent(tmp_path, no_survivors):
    frame = goodput.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "goodput.png").stat().st_size > 0 and (tmp_path / "goodput.csv").exists()
    ckpt = frame[frame["kind"] == "checkpoint"].set_index("variant")["seconds"]
    assert 0 < ckpt["async_block_s"] < ckpt["async_total_s"] and ckpt["save_s"] > 0 and ckpt["load_s"] > 0
    points = frame[frame["kind"] == "point"].set_index("tier")
    assert set(points.index) == {"elastic", "ft", "diloco"} and (points["faults"] >= 1).all()
    # elastic: every fault costs the steps since its snapshot, exactly as the schedule says
    assert points.loc["elastic", "executed_steps"] == points.loc["elastic", "predicted_executed_steps"]
    # a group down loses its share of the batch; nothing is lost without one
    assert points.loc["ft", "useful_steps"] < points.loc["ft", "steps"] - 1
    assert points.loc["elastic", "useful_steps"] == points.loc["elastic", "steps"] - 1
    # stated band: each measured point within a factor of 2 of its prediction (one run, few faults, a loaded machine)
    assert ((points["ratio"] > 0.5) & (points["ratio"] < 2.0)).all(), points[["goodput", "predicted", "ratio"]]
    # ordered as predicted: at faults this frequent, per-step recovery beats a restart, measured and predicted
    assert points.loc["ft", "goodput"] > points.loc["elastic", "goodput"]
    assert points.loc["ft", "predicted"] > points.loc["elastic", "predicted"]
