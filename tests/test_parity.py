"""The backbone: every tier trains to the single-device parameters on the same global batch."""

from __future__ import annotations

import pytest

from dtlab.tiers.ddp import Options as DDPOptions
from dtlab.tiers.zero import Options as ZeroOptions
from dtlab.train import run
from tests.parity import TOL, job, single

pytestmark = pytest.mark.usefixtures("no_survivors")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("tier", ["dp", "ddp-naive", "ddp", "zero"])
def test_tier_matches_single(tier, world_size, optimizer):
    result = run(job(optimizer, tier=tier, world_size=world_size), progress=False)
    assert result.max_param_diff(single(optimizer)) <= TOL
    # every replica ends with the same parameters
    assert len({r.params_checksum for r in result.ranks}) == 1


def test_zero_parameters_as_bucket_view_matches_and_broadcasts_less():
    cfg = job("adam", tier="zero", world_size=2)
    packed = run(cfg.replace(tier_options=ZeroOptions(parameters_as_bucket_view=True)), progress=False)
    plain = run(cfg, progress=False)
    assert packed.max_param_diff(single("adam")) <= TOL
    # ZeRO's broadcasts: one per rank, against one per parameter tensor (from step 2: step 1's forward
    # also broadcasts DDP's rebuilt bucket layout from rank 0)
    broadcasts = [_calls_per_step(r, "broadcast", first_step=2) for r in (packed, plain)]
    assert broadcasts == [2, 6]


def _calls_per_step(result, op: str, first_step: int) -> float:
    ev = result.events_frame()
    ev = ev[(ev["rank"] == 0) & (ev["op"] == op) & (ev["step"] >= first_step) & (ev["step"] < result.config.steps)]
    return len(ev) / (result.config.steps - first_step)


@pytest.mark.parametrize("tier", ["ddp", "zero"])
def test_world_size_four_matches_single(tier):
    result = run(job("adam", tier=tier, world_size=4), progress=False)
    assert len(result.ranks) == 4
    assert result.max_param_diff(single("adam")) <= TOL


def test_transformer_parity_with_adam():
    # Adam's update is about lr * sign(g) where a gradient is near zero, so a
    # rounding-level difference in g can flip a whole update: this tiny model
    # ends 1.4e-5 from single at lr=0.01, 3.8e-6 at 0.003 (measured here). It
    # passes TOL only at the lowered lr; the float64 test checks lr 0.01 strictly.
    cfg = job("adam", model="charformer", dataset="text").replace(lr=0.003)
    ref = run(cfg, progress=False)
    result = run(cfg.replace(tier="ddp", world_size=2), progress=False)
    assert result.max_param_diff(ref) <= TOL


def test_gradient_accumulation_matches_single():
    cfg = job("sgd", tier="ddp", world_size=2, tier_options=DDPOptions(accumulation_steps=4))
    result = run(cfg, progress=False)
    assert result.max_param_diff(single("sgd")) <= TOL
    # no_sync(): one reduction per step, not one per micro-batch
    assert result.comm_summary()["all_reduce"]["calls_per_step"] == pytest.approx(1.0)


def test_small_buckets_match_single_too():
    cfg = job("sgd", tier="ddp", world_size=2, tier_options=DDPOptions(bucket_cap_mb=0.001))
    result = run(cfg, progress=False)
    assert result.max_param_diff(single("sgd")) <= TOL
    assert result.ranks[0].strategy["num_buckets"] > 1


def test_batchnorm_breaks_parity_as_taught():
    """Each rank normalises with its own half of the batch: the exception the notebook shows."""
    ref = single("sgd", model="cnn-bn")
    result = run(job("sgd", tier="ddp", world_size=2, model="cnn-bn"), progress=False)
    assert result.max_param_diff(ref) > 1e-3
    plain_cnn = run(job("sgd", tier="ddp", world_size=2, model="cnn"), progress=False)
    assert plain_cnn.max_param_diff(single("sgd", model="cnn")) <= TOL


@pytest.mark.parametrize("options", [DDPOptions(sync_batchnorm=True), ZeroOptions(sync_batchnorm=True)])
def test_sync_batchnorm_restores_parity(options):
    """Statistics over the global batch (all-reduced) make BatchNorm match the single device again."""
    tier = "zero" if isinstance(options, ZeroOptions) else "ddp"
    cfg = job("sgd", tier=tier, world_size=2, model="cnn-bn", tier_options=options)
    result = run(cfg, progress=False)
    assert result.max_param_diff(single("sgd", model="cnn-bn")) <= TOL  # running stats included
    # two all-reduces per BatchNorm layer per step (statistics forward, gradient sums backward)
    assert result.comm_summary()["all_reduce"]["calls_per_step"] >= 1 + 2 * 2


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_compressing_hooks_still_train(hook):
    cfg = job("sgd", tier="ddp", world_size=2, tier_options=DDPOptions(comm_hook=hook)).replace(steps=40, lr=0.2)
    result = run(cfg, progress=False)
    curve = result.loss_curve()
    assert curve.iloc[-5:].mean() < curve.iloc[:5].mean() - 0.05
    assert result.ranks[0].strategy["comm_hook"] == hook


def test_user_model_difference_is_reported():
    cfg = job("sgd", model="dtlab.core.models:mlp")
    ref = run(cfg, progress=False)
    other = run(cfg.replace(tier="ddp", world_size=2), progress=False)
    assert other.max_param_diff(ref) <= TOL


def test_dataparallel_replicas_run_concurrently():
    cfg = job("sgd", tier="dp", world_size=2, model_size=1024, global_batch_size=512).replace(steps=10)
    result = run(cfg, progress=False)
    assert result.ranks[0].strategy["dataparallel"] == "emulated on CPU threads"
    phases = result.phases_frame()
    fwd = phases[phases["phase"].str.startswith("dp_forward:")]
    overlapping = 0
    for _, group in fwd.groupby("step"):
        assert len(group) == 2
        overlapping += group["start"].max() < group["end"].min()
    # A loop over replicas would never overlap; threads do in most steps (scheduling varies).
    assert overlapping >= 5
    names = set(phases["phase"])
    assert {"dp_replicate", "dp_scatter", "dp_gather"} <= names
