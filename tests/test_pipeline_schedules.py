"""Pipeline schedules without processes: stage placement, action orders, the equal-times layout and its
diagram, and the bubble formulas it must reproduce."""

from __future__ import annotations

import pytest

from dtlab import plots
from dtlab.analysis import pipeline as pipeline_runs
from dtlab.tiers.pipeline import Options, stages_per_rank
from dtlab.tiers.pipeline_stages import placement, rank_actions

FORMULA_CASES = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def test_stages_per_rank_defaults_to_the_schedules_own():
    assert [stages_per_rank(Options(s)) for s in ("gpipe", "interleaved-1f1b", "zbv")] == [1, 2, 2]
    assert stages_per_rank(Options("interleaved-1f1b", stages_per_rank=3)) == 3


def test_placement_is_looped_or_v_shaped():
    assert placement("1f1b", 3, 1) == [[0], [1], [2]]
    assert placement("interleaved-1f1b", 2, 3) == [[0, 2, 4], [1, 3, 5]]
    assert placement("dualpipev", 3, 2) == [[0, 5], [1, 4], [2, 3]]  # the last stage back on rank 0


def test_one_stage_orders_are_what_torch_runs():
    def names(order):
        return [f"{kind}{mb}" for _, kind, mb in order]

    # 1F1B: stage s warms up with S - s forwards, then backward-forward pairs
    assert names(rank_actions("1f1b", 2, 4, 1)[0]) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert names(rank_actions("1f1b", 2, 4, 1)[1]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert names(rank_actions("gpipe", 2, 2, 1)[1]) == ["F0", "F1", "B0", "B1"]
    # torch's own lists for the multi-stage ones: zero bubble splits every backward into I and W
    zbv = rank_actions("zbv", 2, 4, 2)
    assert all(sorted(k for _, k, _ in acts) == ["F"] * 8 + ["I"] * 8 + ["W"] * 8 for acts in zbv.values())


@pytest.mark.parametrize("p,m", FORMULA_CASES)
def test_equal_times_layout_reproduces_the_formulas(p, m):
    for schedule in ("naive", "gpipe", "1f1b"):
        assert pipeline_runs.simulated_bubble(schedule, p, m) == pytest.approx(
            pipeline_runs.ideal_bubble(schedule, p, m), abs=1e-12), schedule
    for v in (2, 3):
        assert pipeline_runs.simulated_bubble("interleaved-1f1b", p, m, v) == pytest.approx(
            pipeline_runs.ideal_bubble("interleaved-1f1b", p, m, v), abs=1e-12), v


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zero_bubble_schedules_idle_least(p, m):
    one_f_one_b = pipeline_runs.ideal_bubble("1f1b", p, m)
    interleaved = pipeline_runs.ideal_bubble("interleaved-1f1b", p, m, 2)
    for schedule in ("zero-bubble", "zbv", "dualpipev"):
        assert pipeline_runs.simulated_bubble(schedule, p, m) < interleaved < one_f_one_b, schedule
    # ZB-V, 2 ranks, 4 micro-batches: 24 units of work per rank, one unit idle (rank 0's last, rank 1's first)
    assert pipeline_runs.simulated_bubble("zbv", 2, 4) == pytest.approx(1 / 25)
    with pytest.raises(ValueError, match="no formula"):
        pipeline_runs.ideal_bubble("zbv", p, m)


def test_equal_times_diagram(tmp_path):
    frame = pipeline_runs.simulate("zbv", 2, 4)
    assert set(frame["phase"]) == {"forward", "backward_input", "backward_weight"}
    assert frame.groupby("rank")["hold"].apply(lambda h: sorted(set(h))).tolist() == [[0, 1], [0, 1]]
    fig = plots.pipeline_schedule(frame, title="zbv", seconds=False)
    assert len(fig.axes[0].texts) == len(frame)  # every bar labelled with its micro-batch
    assert any(bar.get_hatch() for bar in fig.axes[0].patches)  # each rank's second stage
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["forward", "backward_input", "backward_weight"]
    assert plots.save(fig, tmp_path / "zbv.png").stat().st_size > 5_000
