"""The pipeline tier: parity with the single device, its P2P traffic, its schedule diagram, bad input."""

from __future__ import annotations

import functools

import pytest

from dtlab import RunConfig
from dtlab.cost import pipeline as pipeline_cost
from dtlab.read import pipeline as pipeline_runs
from dtlab.tiers import pipeline as pp
from dtlab.tiers.pipeline import Options
from dtlab.train import run

pytestmark = pytest.mark.usefixtures("no_survivors")
TOL = 1e-5
LR = {"sgd": 0.05, "adam": 0.01}


def job(optimizer: str = "sgd", **changes) -> RunConfig:
    base = dict(steps=20, optimizer=optimizer, lr=LR[optimizer], global_batch_size=64, threads_per_rank=1,
                model_depth=2)
    return RunConfig(**{**base, **changes})


@functools.cache
def single(cfg: RunConfig):
    return run(cfg, progress=False)


def pipelined(cfg: RunConfig, schedule: str, microbatches: int, world_size: int = 2):
    return run(cfg.replace(tier="pipeline", world_size=world_size,
                           tier_options=Options(schedule=schedule, microbatches=microbatches)), progress=False)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_single(schedule, optimizer):
    ref = single(job(optimizer))
    result = pipelined(job(optimizer), schedule, 4)
    assert result.max_param_diff(ref) <= TOL
    # the loss (last stage only; the others report NaN) and the held-out evaluation match too
    assert (result.loss_curve() - ref.loss_curve()).abs().max() <= TOL
    assert result.ranks[0].evaluation["loss"] == pytest.approx(ref.ranks[0].evaluation["loss"], abs=TOL)
    assert result.steps_frame().groupby("rank")["loss"].apply(lambda s: s.isna().all()).tolist() == [True, False]


@pytest.mark.parametrize("microbatches,optimizer", [(1, "sgd"), (1, "adam"), (4, "adam")])
def test_naive_split_matches_single(microbatches, optimizer):
    ref = single(job(optimizer))
    result = pipelined(job(optimizer), "naive", microbatches)
    assert result.max_param_diff(ref) <= TOL
    assert (result.loss_curve() - ref.loss_curve()).abs().max() <= TOL


def test_four_stages_match_single():
    # in float64, where a gap above 1e-10 is a bug: in float32 this job (Adam at lr 0.01, 20 steps) is rounding
    # amplified by Adam and depends on the CPU's kernels: 2.2e-6 from single on one x86_64 model, 1.4e-2 on an
    # AVX-512 AMD EPYC (every schedule alike, DDP at world 2 3.3e-2; 8e-7 after 5 steps); 2.2e-15 in float64
    cfg = job("adam", model_depth=4, dtype="float64")
    assert pipelined(cfg, "1f1b", 4, world_size=4).max_param_diff(single(cfg)) <= 1e-10


def test_charformer_blocks_split_matches_single():
    cfg = job("adam", model="charformer", dataset="text").replace(lr=0.003, steps=10)
    result = pipelined(cfg, "gpipe", 2)
    assert result.max_param_diff(single(cfg)) <= TOL
    assert result.ranks[0].strategy["stage_state"][:2] == ["tok.weight", "pos.weight"]


@pytest.mark.parametrize("schedule,microbatches,stages", [("gpipe", 4, 2), ("1f1b", 4, 2), ("naive", 3, 2),
                                                          ("gpipe", 2, 4)])
def test_p2p_transfers_per_step(schedule, microbatches, stages):
    """2·M·(S−1) transfers per step, counted once at their senders (the receivers post as many irecvs):
    M·(S−1) activations forward and M·(S−1) gradients backward."""
    steps = 4
    cfg = job(steps=steps, model_depth=4, global_batch_size=48)
    result = pipelined(cfg, schedule, microbatches, world_size=stages)
    ev = result.events_frame()
    schedule_ev = ev[~ev["tag"].isin([pp.SETUP_TAG, pp.GATHER_TAG])]
    expected = 2 * microbatches * (stages - 1)
    for op in ("isend", "irecv"):
        per_step = schedule_ev[schedule_ev["op"] == op].groupby("step").size()
        assert per_step.to_dict() == {s: expected for s in range(steps)}, op
    assert set(schedule_ev["op"]) == {"isend", "irecv"}  # no other traffic inside the steps
    # each activation is as big as a micro-batch of the 64-wide hidden layer
    sends = schedule_ev[schedule_ev["op"] == "isend"]
    assert set(sends["bytes"]) == {48 // microbatches * cfg.model_size * 4}
    # set-up only in step 0, the gather only after the last step
    assert set(ev.loc[ev["tag"] == pp.SETUP_TAG, "step"]) == {0}
    assert set(ev.loc[ev["tag"] == pp.GATHER_TAG, "step"]) == {steps}
    # the schedule diagram names every transfer by what it carries
    frame = pipeline_runs.schedule_frame(result, step=1, p2p=True)
    counts = frame["phase"].value_counts().to_dict()
    half = microbatches * (stages - 1)
    assert counts == {"forward": microbatches * stages, "backward": microbatches * stages,
                      "send act": half, "recv act": half, "send grad": half, "recv grad": half}


def _assert_bars_are_the_frame(fig, frame):
    """One bar per row of the schedule frame, at its start and as long as it lasted, in ms since the first."""
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time since first shown start (ms)" and len(ax.patches) == len(frame)
    t0 = frame["start"].min()
    assert sorted(b.get_x() for b in ax.patches) == pytest.approx(sorted((frame["start"] - t0) * 1e3))
    longest = (frame["end"] - frame["start"]).max() * 1e3
    assert max(b.get_width() for b in ax.patches) == pytest.approx(longest)


def test_schedule_diagram_and_bubble(tmp_path):
    from dtlab import plots

    result = pipelined(job(steps=4), "1f1b", 4)
    frame = pipeline_runs.schedule_frame(result)
    assert list(frame["lane"].unique()) == ["stage 0", "stage 1"]
    # 1F1B: stage 1 alternates forward and backward from its first micro-batch
    last = frame[frame["lane"] == "stage 1"]
    assert list(last["phase"]) == ["forward", "backward"] * 4
    assert list(last["microbatch"]) == [0, 0, 1, 1, 2, 2, 3, 3]
    fig = pipeline_runs.schedule_figure(result, p2p=True)
    assert [t.get_text() for t in fig.axes[0].texts].count("3") == 4
    _assert_bars_are_the_frame(fig, pipeline_runs.schedule_frame(result, p2p=True))
    assert plots.save(fig, tmp_path / "schedule.png").exists()
    bubble = pipeline_runs.bubble_frame(result)
    assert len(bubble) == 4 * 2 and bubble["idle_fraction"].between(0, 1).all()
    # every rank sends and receives in every step; the idle time in flight is part of the idle time
    assert (bubble["transfer_s"] > 0).all()
    assert (bubble["idle_in_transfer_s"] <= bubble["span_s"] - bubble["busy_s"] + 1e-9).all()
    assert pipeline_cost.ideal_bubble("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert pipeline_cost.ideal_bubble("naive", 4, 8) == pytest.approx(3 / 4)
    # the result's own files still work with the extra phases and the stage-shaped strategy facts
    assert (result.save(tmp_path / "run") / "trace.json").exists()
    assert result.summary()["strategy"]["stage_parameters"] < sum(t.numel() for t in result.params().values())


# -- several stages per rank --------------------------------------------------------------
MULTI = ["interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"]


@functools.cache
def multi_job(schedule: str) -> tuple[RunConfig, object]:
    """Four stages on two ranks (depth 4: one block each), 4 micro-batches, Adam at the four-stage test's lr."""
    cfg = job("adam", model_depth=4).replace(lr=0.003, tier="pipeline", world_size=2,
                                               tier_options=Options(schedule=schedule, microbatches=4))
    return cfg, run(cfg, progress=False)


@pytest.mark.parametrize("schedule", MULTI)
def test_multi_stage_schedules_match_single_and_predicted_activations(schedule):
    from dtlab.cost.estimate import compare, estimate

    cfg, result = multi_job(schedule)
    ref = single(job("adam", model_depth=4).replace(lr=0.003))  # the same global batch on one device
    assert result.max_param_diff(ref) <= TOL
    assert (result.loss_curve() - ref.loss_curve()).abs().max() <= TOL
    assert result.ranks[0].evaluation["loss"] == pytest.approx(ref.ranks[0].evaluation["loss"], abs=TOL)
    # looped: stages 0, 2 | 1, 3 and the loss on rank 1; V-shaped: 0, 3 | 1, 2 and the loss on rank 0
    v_shaped = schedule in ("zbv", "dualpipev")
    assert [r.strategy["rank_stages"] for r in result.ranks] == ([[0, 3], [1, 2]] if v_shaped else [[0, 2], [1, 3]])
    has_loss = result.steps_frame().groupby("rank")["loss"].apply(lambda s: s.notna().all()).tolist()
    assert has_loss == ([True, False] if v_shaped else [False, True])
    # the estimator walks each rank's actions on fake tensors: every kind as measured, activations included
    table = compare(estimate(cfg), result)
    assert {"parameters", "gradients", "optimizer_state", "activations"} <= set(table["kind"])
    assert (table["error"] == 0).all(), table.to_string()  # exactly: the walk replays each rank's actions


@pytest.mark.parametrize("schedule,hops", [("interleaved-1f1b", 3), ("zbv", 2)])
def test_multi_stage_transfers_and_diagram(schedule, hops, tmp_path):
    """Looped: all three stage boundaries cross ranks; V-shaped: the middle one (stages 1 and 2, both on
    rank 1) is a local hand-off, not a transfer. Each crossing: one activation and one gradient per micro-batch."""
    from dtlab import plots

    cfg, result = multi_job(schedule)
    ev = result.events_frame()
    inside = ev[~ev["tag"].isin([pp.SETUP_TAG, pp.GATHER_TAG]) & (ev["step"] < cfg.steps)]
    assert inside[inside["op"] == "isend"].groupby("step").size().unique().tolist() == [2 * 4 * hops]
    frame = pipeline_runs.schedule_frame(result, step=1, p2p=True)
    counts = frame["phase"].value_counts().to_dict()
    backward = {"backward_input": 16, "backward_weight": 16} if schedule == "zbv" else {"backward": 16}
    assert counts == {"forward": 16, **backward, **{f"{d} {w}": 4 * hops for d in ("send", "recv")
                                                    for w in ("act", "grad")}}
    assert list(frame["lane"].unique()) == ["rank 0", "rank 0 p2p", "rank 1", "rank 1 p2p"]
    fig = pipeline_runs.schedule_figure(result, p2p=True)
    per_rank = 3 if schedule == "zbv" else 2  # micro-batch 3's F and B (zbv: F, I and W) on each of 2 stages
    assert [t.get_text() for t in fig.axes[0].texts].count("3") == 2 * 2 * per_rank
    _assert_bars_are_the_frame(fig, pipeline_runs.schedule_frame(result, p2p=True))
    assert plots.save(fig, tmp_path / "schedule.png").exists()
    table = pipeline_runs.bubble_table({schedule: result})
    assert table["measured"].between(0, 1).all() and table["simulated"].iloc[0] < pipeline_cost.ideal_bubble(
        "1f1b", 2, 4)


def test_unrecorded_run_still_trains():
    cfg = job(steps=5)
    result = run(cfg.replace(tier="pipeline", world_size=2), progress=False, record=False)
    assert result.max_param_diff(single(cfg)) <= TOL


BAD = [
    (dict(model_depth=3), "model_depth"),  # 3 layers do not split into 2 equal stages
    (dict(world_size=4, model_depth=2), "model_depth"),  # more stages than layers
    (dict(tier_options=Options(microbatches=5)), "microbatches"),  # 64 samples into 5
    (dict(tier_options=Options(microbatches=0)), "microbatches"),
    (dict(tier_options=Options(schedule="interleaved")), "schedule"),
    (dict(world_size=4, model_depth=4, tier_options=Options(schedule="1f1b", microbatches=2)), "microbatches"),
    (dict(model="cnn"), "model"),
    (dict(model_depth=2, tier_options=Options(schedule="zbv")), "model_depth"),  # 2 layers, 4 stages
    (dict(model_depth=4, tier_options=Options(schedule="zbv", stages_per_rank=3)), "stages_per_rank"),
    (dict(tier_options=Options(schedule="1f1b", stages_per_rank=2)), "stages_per_rank"),
    (dict(model_depth=4, tier_options=Options(schedule="interleaved-1f1b", stages_per_rank=1)), "stages_per_rank"),
    (dict(tier_options=Options(stages_per_rank=-1)), "stages_per_rank"),
    (dict(model_depth=4, tier_options=Options(schedule="dualpipev", microbatches=2)), "microbatches"),  # < 4 stages
    (dict(global_batch_size=60, model_depth=4, tier_options=Options(schedule="zero-bubble", microbatches=5)),
     "microbatches"),  # rounds of 2: 5 is not a multiple
]


@pytest.mark.parametrize("changes,field", BAD, ids=[f"{f}:{c}" for c, f in BAD])
def test_bad_input_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        job(**{"tier": "pipeline", "world_size": 2, **changes})


def test_step_table_splits_forward_backward_and_waiting():
    """Each stage's step row holds its own forward and backward compute; the rest of the step it waited
    (transfers, bubble) and that is counted as comm: the columns add up to the step."""
    result = pipelined(job("sgd"), "gpipe", 4)
    steps = result.steps_frame()
    steady = steps[steps["step"] >= 1]
    assert (steady["forward"] > 0).all() and (steady["backward"] > 0).all()
    parts = steady[["data", "forward", "backward", "comm", "optimizer"]].sum(axis=1)
    assert ((parts - steady["total"]).abs() <= 0.05 * steady["total"] + 2e-4).all()
    # the first stage waits for the last stage's backward in every step: it has a bubble
    assert steady.loc[steady["rank"] == 0, "comm"].median() > 0
