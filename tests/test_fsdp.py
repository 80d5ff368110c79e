"""The fsdp tier: parity with single, FSDP2's collectives per unit, and memory sharded three ways."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from dtlab import RunConfig
from dtlab.core.models import build
from dtlab.cost.estimate import compare, estimate
from dtlab.read.fsdp import comm_exposure
from dtlab.tiers.fsdp import Options, shard_units
from dtlab.train import preflight, run

pytestmark = pytest.mark.usefixtures("no_survivors")
TOL = 1e-5
LR = {"sgd": 0.05, "adam": 0.01}


def job(optimizer: str, **changes) -> RunConfig:
    base_job = dict(steps=20, optimizer=optimizer, lr=LR[optimizer], global_batch_size=64, threads_per_rank=1)
    return RunConfig(**{**base_job, **changes})


@functools.cache
def single(optimizer: str, model: str = "mlp", dataset: str = "digits", lr: float | None = None):
    return run(job(optimizer, model=model, dataset=dataset, lr=lr or LR[optimizer]), progress=False)


# -- options -------------------------------------------------------------------------
@pytest.mark.parametrize("options,field", [
    (Options(mixed_precision="fp8"), "mixed_precision"),
    (Options(reshard_after_forward="yes"), "reshard_after_forward"),
    (Options(checkpoint_every=-1), "checkpoint_every"),
    (Options(checkpoint_every=5), "checkpoint_every"),  # nowhere to save
    (Options(resume_from="/nonexistent/checkpoint"), "resume_from"),
    (Options(replicate=3), "replicate"),  # world_size 2 does not split into groups of 2 / 3
    (Options(replicate=0), "replicate"),
])
def test_bad_options_fail_before_launch(options, field):
    with pytest.raises(ValueError, match=f"fsdp tier_options.{field}="):
        preflight(job("sgd", tier="fsdp", world_size=2, tier_options=options))  # a missing file: the preflight's


def test_units_are_the_blocks():
    digits = (1, 8, 8)
    mlp = build("mlp", digits, 10, 16, depth=3)
    assert [name for name, _ in shard_units(mlp)] == ["1", "3", "5", "7"]  # the Linear layers, not ReLU/Flatten
    cnn = build("cnn", digits, 10, 16)
    assert [name for name, _ in shard_units(cnn)] == ["0", "3", "8"]  # two convolutions and the classifier
    former = build("charformer", (32,), 40, 16, depth=2)
    assert [name for name, _ in shard_units(former)] == ["blocks.0", "blocks.1"]  # the root keeps the rest
    assert shard_units(nn.Linear(2, 2)) == []  # any other model is one unit: the root


# -- parity --------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp_matches_single(world_size, optimizer):
    result = run(job(optimizer, tier="fsdp", world_size=world_size), progress=False)
    assert result.max_param_diff(single(optimizer)) <= TOL
    # every rank gathered the same full parameters at the end
    assert len({r.params_checksum for r in result.ranks}) == 1
    assert result.ranks[0].evaluation["accuracy"] == pytest.approx(single(optimizer).ranks[0].evaluation["accuracy"])


def test_world_size_four_and_the_transformer_match_single():
    result = run(job("adam", tier="fsdp", world_size=4), progress=False)
    assert len(result.ranks) == 4 and result.max_param_diff(single("adam")) <= TOL
    # the charformer: two Block units plus the root (embeddings, final norm, head); lr as in test_parity
    former = run(job("adam", tier="fsdp", world_size=2, model="charformer", dataset="text", lr=0.003),
                 progress=False)
    assert former.ranks[0].strategy["fsdp_units"] == ["blocks.0", "blocks.1", "root"]
    assert former.max_param_diff(single("adam", "charformer", "text", lr=0.003)) <= TOL
    # its Linear head returns a view, which FSDP2 warns about; the loop never modifies it in place
    assert former.logs and not any("returned a view tensor" in log for log in former.logs.values())


@pytest.mark.parametrize("options", [Options(reshard_after_forward=False), Options(cpu_offload=True)])
def test_memory_knobs_do_not_change_the_result(options):
    result = run(job("adam", tier="fsdp", world_size=2, tier_options=options), progress=False)
    assert result.max_param_diff(single("adam")) <= TOL


def test_bf16_gathers_half_the_bytes_and_still_trains():
    cfg = job("adam", tier="fsdp", world_size=2)
    fp32 = run(cfg, progress=False).comm_summary()
    result = run(cfg.replace(tier_options=Options(mixed_precision="bf16")), progress=False)
    comm = result.comm_summary()
    # parameters travel in bf16; gradients are reduced in fp32 (MixedPrecisionPolicy.reduce_dtype)
    assert comm["all_gather_into_tensor"]["bytes_per_step"] == fp32["all_gather_into_tensor"]["bytes_per_step"] / 2
    assert comm["reduce_scatter_tensor"]["bytes_per_step"] == fp32["reduce_scatter_tensor"]["bytes_per_step"]
    diff = result.max_param_diff(single("adam"))
    assert TOL < diff < 0.5  # rounded, not broken
    curve = result.loss_curve()
    assert curve.iloc[-5:].mean() < curve.iloc[:5].mean() - 0.5


# -- collectives -----------------------------------------------------------------------
def collectives_per_step(result, rank: int = 0) -> dict[tuple[str, str], int]:
    """(op, pass) -> calls per step, the pass read from the loop's phase times (not from the tags)."""
    events = result.events_frame()
    phases = result.phases_frame()
    events = events[(events["rank"] == rank) & (events["step"] >= 0) & (events["step"] < result.config.steps)]
    phases = phases[(phases["rank"] == rank) & phases["phase"].isin(["forward", "backward"])]
    counts: dict[tuple[str, str], int] = {}
    for ev in events.itertuples():
        inside = phases[(phases["step"] == ev.step) & (phases["start"] <= ev.start) & (ev.start <= phases["end"])]
        assert len(inside) == 1, f"{ev.op} at step {ev.step} outside forward and backward"
        pass_ = inside["phase"].iloc[0]
        assert ev.tag.startswith(f"fsdp:{pass_}:")  # the tier's own tag agrees
        counts[(ev.op, pass_)] = counts.get((ev.op, pass_), 0) + 1
    return {key: n / result.config.steps for key, n in counts.items()}


@pytest.mark.parametrize("reshard", [True, False])
def test_one_all_gather_per_unit_and_pass_one_reduce_scatter_per_unit(reshard):
    options = Options(reshard_after_forward=reshard)
    cfg = job("sgd", tier="fsdp", world_size=2, model_depth=3, steps=4, tier_options=options)
    result = run(cfg, progress=False)
    units = result.ranks[0].strategy["fsdp_units"]
    assert len(units) == 4  # the mlp's 4 Linear layers; its root owns no parameters, so gathers nothing
    # FSDP2 gathers a unit's parameters in its forward pre-hook and, when they were freed after
    # forward, again before its backward; each unit reduce-scatters its gradients once, after its
    # backward. Without resharding, backward needs no all-gather at all.
    expected = {("all_gather_into_tensor", "forward"): 4, ("reduce_scatter_tensor", "backward"): 4}
    if reshard:
        expected[("all_gather_into_tensor", "backward")] = 4
    assert collectives_per_step(result) == expected
    # On CPU FSDP2 runs them synchronously in the training thread (its overlap needs CUDA
    # streams): none of their time is hidden behind compute.
    exposure = comm_exposure(result)
    assert (exposure["hidden_s"] == 0).all() and (exposure["blocked_s"] > 0).all()


def test_hsdp_reduce_scatters_within_a_group_and_all_reduces_across():
    """HSDP at 4 ranks, replicate=2: a 2 x 2 mesh, sharded along a row, replicated down a column."""
    cfg = job("adam", tier="fsdp", world_size=4, tier_options=Options(replicate=2))
    result = run(cfg, progress=False)
    assert result.max_param_diff(single("adam")) <= TOL  # measured: 1.3e-7
    units = len(result.ranks[0].strategy["fsdp_units"])  # the mlp's 3 Linear layers
    # the three collectives of fsdp, plus one all-reduce per unit after its reduce-scatter
    assert collectives_per_step(result) == {("all_gather_into_tensor", "forward"): units,
                                            ("all_gather_into_tensor", "backward"): units,
                                            ("reduce_scatter_tensor", "backward"): units,
                                            ("all_reduce", "backward"): units}
    events = result.events_frame()
    steady = events[(events["rank"] == 0) & (events["step"] == 1)]
    assert steady.groupby("op")["group_size"].unique().map(list).to_dict() == {
        "all_gather_into_tensor": [2], "reduce_scatter_tensor": [2], "all_reduce": [2]}
    # what crosses the groups is the reduce-scatter's output: each unit's gradient shard, half its gradient
    scattered = steady[steady["op"] == "reduce_scatter_tensor"].set_index("tag")["bytes"]
    reduced = steady[steady["op"] == "all_reduce"].set_index("tag")["bytes"]
    assert (reduced * 2).to_dict() == scattered.to_dict()
    # memory: each rank holds a group's share (1/2), as the estimate predicts to the byte
    table = compare(estimate(cfg), result)
    assert set(table["kind"]) >= {"parameters", "gradients", "optimizer_state", "activations", "comm_buffers"}
    wrong = table[table["predicted"] != table["measured"]]
    assert wrong.empty, wrong.to_string()


def test_a_single_rank_communicates_nothing():
    result = run(job("sgd", tier="fsdp", world_size=1, steps=2), progress=False)
    assert result.comm_summary() == {}


# -- memory --------------------------------------------------------------------------
WIDTH = 64


def twenty_linear_layers(input_shape, num_classes):
    """test_memory's model: 20 x Linear(64, 64), every tensor divisible by 1, 2 and 4 ranks."""
    return nn.Sequential(nn.Flatten(), *[nn.Linear(WIDTH, WIDTH) for _ in range(20)])


def test_ddp_zero_fsdp_memory_ladder():
    """The ZeRO stages measured: zero shards the optimizer state, fsdp everything."""
    step_counters = 20 * 2 * 4  # Adam keeps one fp32 step count per parameter tensor on every rank
    for world in (1, 2, 4):
        cfg = RunConfig(tier="ddp", world_size=world, model=twenty_linear_layers, optimizer="adam", lr=1e-3, steps=2,
                        global_batch_size=16, threads_per_rank=1)
        ddp, zero, fsdp = (run(cfg.replace(tier=t), progress=False) for t in ("ddp", "zero", "fsdp"))
        full = ddp.ranks[0].memory
        for r in fsdp.ranks:
            assert r.memory["parameters"] == full["parameters"] / world
            assert r.memory["gradients"] == full["gradients"] / world
            assert r.memory["optimizer_state"] == (full["optimizer_state"] - step_counters) / world + step_counters
        for r in zero.ranks:
            assert r.memory["parameters"] == full["parameters"] and r.memory["gradients"] == full["gradients"]
        assert sum(r.memory["optimizer_state"] for r in zero.ranks) == pytest.approx(
            full["optimizer_state"], rel=0.01)
