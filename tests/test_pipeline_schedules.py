"""Pipeline schedules without processes: stage placement, action orders, the equal-times layout and its
diagram, and the bubble formulas it must reproduce."""

from __future__ import annotations

import pandas as pd
import pytest

from dtlab import plots
from dtlab.cost import pipeline as pipeline_cost
from dtlab.read import pipeline as pipeline_runs
from dtlab.tiers.parts.pipeline_stages import placement, rank_actions
from dtlab.tiers.pipeline import Options, stages_per_rank

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
        assert pipeline_cost.simulated_bubble(schedule, p, m) == pytest.approx(
            pipeline_cost.ideal_bubble(schedule, p, m), abs=1e-12), schedule
    for v in (2, 3):
        assert pipeline_cost.simulated_bubble("interleaved-1f1b", p, m, v) == pytest.approx(
            pipeline_cost.ideal_bubble("interleaved-1f1b", p, m, v), abs=1e-12), v


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zero_bubble_schedules_idle_least(p, m):
    one_f_one_b = pipeline_cost.ideal_bubble("1f1b", p, m)
    interleaved = pipeline_cost.ideal_bubble("interleaved-1f1b", p, m, 2)
    for schedule in ("zero-bubble", "zbv", "dualpipev"):
        assert pipeline_cost.simulated_bubble(schedule, p, m) < interleaved < one_f_one_b, schedule
    # ZB-V, 2 ranks, 4 micro-batches: 24 units of work per rank, one unit idle (rank 0's last, rank 1's first)
    assert pipeline_cost.simulated_bubble("zbv", 2, 4) == pytest.approx(1 / 25)
    with pytest.raises(ValueError, match="no formula"):
        pipeline_cost.ideal_bubble("zbv", p, m)


def test_equal_times_diagram(tmp_path):
    frame = pipeline_cost.simulate("zbv", 2, 4)
    assert set(frame["phase"]) == {"forward", "backward_input", "backward_weight"}
    assert frame.groupby("rank")["hold"].apply(lambda h: sorted(set(h))).tolist() == [[0, 1], [0, 1]]
    fig = plots.pipeline_schedule(frame, title="zbv", seconds=False)
    assert len(fig.axes[0].texts) == len(frame)  # every bar labelled with its micro-batch
    assert any(bar.get_hatch() for bar in fig.axes[0].patches)  # each rank's second stage
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["forward", "backward_input", "backward_weight"]
    # the bars are the layout: one per action, at its start, as long as it takes, in time units
    ax = fig.axes[0]
    assert [bar.get_x() for bar in ax.patches] == pytest.approx(frame["start"].tolist())
    assert [bar.get_width() for bar in ax.patches] == pytest.approx((frame["end"] - frame["start"]).tolist())
    assert ax.get_xlabel() == "time (units: one forward = 1)"
    assert plots.save(fig, tmp_path / "zbv.png").exists()


# -- the layout against torch's own schedule tables -----------------------------------------
def _torch_table(schedule, world, microbatches):
    """torch's own per-rank time table for a zero-bubble schedule (``pipeline_order``: one action or None,
    an idle slot, per unit of time), built from stage stand-ins: no processes."""
    from types import SimpleNamespace

    from dtlab.tiers.parts.pipeline_stages import MULTI_STAGE

    held = placement(schedule, world, 2)
    total = sum(len(h) for h in held)

    def stand_in(i):
        return SimpleNamespace(group_size=world, group_rank=0, num_stages=total, stage_index=i, submod=None,
                               is_first=i == 0, is_last=i == total - 1)
    return MULTI_STAGE[schedule]([stand_in(i) for i in held[0]], n_microbatches=microbatches).pipeline_order


@pytest.mark.parametrize("schedule", ["zbv", "zero-bubble"])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8)])
def test_zero_bubble_layout_matches_torchs_own_time_table(schedule, p, m):
    """dtlab's zero-bubble bubble comes from its own simulator; torch's schedule classes lay the same
    actions out on a time grid of their own (F, I and W one slot each, None where the rank waits). The
    idle share per rank must agree, and no action may start later in dtlab's as-soon-as-ready layout."""
    table = _torch_table(schedule, p, m)
    span = max(len(slots) for slots in table.values())
    torch_idle = {r: 1 - sum(a is not None for a in slots) / span for r, slots in table.items()}
    torch_start = {(a.stage_index, a.computation_type.value, a.microbatch_index): t
                   for slots in table.values() for t, a in enumerate(slots) if a is not None}
    frame = pipeline_cost.simulate(schedule, p, m, 2)
    kind = {"forward": "F", "backward_input": "I", "backward_weight": "W"}
    ours = {(r.stage, kind[r.phase], r.microbatch): r.start for r in frame.itertuples()}
    assert ours.keys() == torch_start.keys()
    assert pipeline_cost.idle_share(frame).to_dict() == pytest.approx(torch_idle, abs=1e-12)
    assert pipeline_cost.simulated_bubble(schedule, p, m) == pytest.approx(sum(torch_idle.values()) / p)
    assert all(ours[k] <= torch_start[k] for k in ours)
    if schedule == "zbv":  # ZB-V's table is already as tight as it goes: every start the same
        assert ours == {k: float(t) for k, t in torch_start.items()}


# -- the measured bubble, on a timeline with a known answer ---------------------------------
def _timeline():
    """Two ranks, one step over [10, 14] s: each rank computes 2 s of it. Rank 0 has a send (10.9-11.5)
    and a receive (11.2-12.5) in flight, overlapping each other and its compute from 12: 1.6 s in flight,
    1 s of it idle. The receive's data leaves rank 1 at 11.8 (its send, during its compute): from then to
    12.5 it arrives, 0.2 s of that idle on rank 0. Set-up transfers and another step's are left out."""
    from types import SimpleNamespace

    from dtlab.tiers.pipeline import SETUP_TAG

    phases = pd.DataFrame([
        {"rank": 0, "step": 1, "phase": "pp_forward:0", "start": 10.0, "end": 11.0},
        {"rank": 0, "step": 1, "phase": "pp_backward:0", "start": 12.0, "end": 13.0},
        {"rank": 1, "step": 1, "phase": "pp_forward:0", "start": 11.0, "end": 12.0},
        {"rank": 1, "step": 1, "phase": "pp_backward:0", "start": 13.0, "end": 14.0},
        {"rank": 0, "step": 1, "phase": "optimizer", "start": 14.0, "end": 15.0},  # not a pipeline action
    ])
    events = pd.DataFrame([
        {"rank": 0, "step": 1, "op": "isend", "peer": 1, "tag": "", "start": 10.9, "end": 11.5},
        {"rank": 0, "step": 1, "op": "irecv", "peer": 1, "tag": "", "start": 11.2, "end": 12.5},
        {"rank": 0, "step": 1, "op": "all_reduce", "peer": -1, "tag": "", "start": 13.0, "end": 14.0},
        {"rank": 1, "step": 1, "op": "isend", "peer": 0, "tag": "", "start": 11.8, "end": 11.9},
        {"rank": 1, "step": 0, "op": "isend", "peer": 0, "tag": SETUP_TAG, "start": 0.0, "end": 20.0},
        {"rank": 1, "step": 2, "op": "irecv", "peer": 0, "tag": "", "start": 13.5, "end": 14.0},
    ])
    return SimpleNamespace(phases_frame=lambda: phases, events_frame=lambda: events)


def test_bubble_frame_on_a_known_timeline():
    b = pipeline_runs.bubble_frame(_timeline()).set_index("rank")
    assert b["span_s"].tolist() == pytest.approx([4.0, 4.0])
    assert b["busy_s"].tolist() == pytest.approx([2.0, 2.0])
    assert b["idle_fraction"].tolist() == pytest.approx([0.5, 0.5])
    assert b["transfer_s"].tolist() == pytest.approx([1.6, 0.1])  # 10.9-12.5, overlaps counted once
    assert b["idle_in_transfer_s"].tolist() == pytest.approx([1.0, 0.0])  # 11-12 idle and in flight
    assert b["idle_in_arrival_s"].tolist() == pytest.approx([0.2, 0.0])  # 11.8-12: sent, idle, not yet here
    # the run's summary, means over ranks: in flight 0.4 and 0.025 of the span; idle in flight 0.5 and 0;
    # idle while arriving 0.1 and 0
    assert pipeline_runs.transfer_share(_timeline()) == pytest.approx((0.2125, 0.25, 0.05))
