"""Bad values fail in RunConfig, before any process starts, naming the field."""

from __future__ import annotations

import pytest

from dtlab import RunConfig
from dtlab.tiers import ddp, zero

BAD = [
    (dict(world_size=0), "world_size"),
    (dict(world_size=-2), "world_size"),
    (dict(tier="ddp", world_size=3, global_batch_size=64), "global_batch_size"),
    (dict(tier="warp-drive"), "tier"),
    (dict(model="resnet9000"), "model"),
    (dict(model="no_such_package.module:factory"), "model"),
    (dict(model="dtlab.core.models:no_such_factory"), "model"),
    (dict(model="dtlab.core.models"), "model"),
    (dict(dataset="imagenet"), "dataset"),
    (dict(steps=0), "steps"),
    (dict(lr=0.0), "lr"),
    (dict(optimizer="lamb"), "optimizer"),
    (dict(backend="mpi"), "backend"),
    (dict(device="tpu"), "device"),
    (dict(device="cpu", backend="nccl"), "backend"),
    (dict(threads_per_rank=-1), "threads_per_rank"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(model="charformer", dataset="digits"), "model"),
    (dict(tier="single", world_size=2), "world_size"),
    (dict(tier="single", tier_options=ddp.Options()), "tier_options"),
    (dict(tier="ddp", tier_options=ddp.Options(comm_hook="gzip")), "comm_hook"),
    (dict(tier="ddp", tier_options=ddp.Options(bucket_cap_mb=0)), "bucket_cap_mb"),
    (dict(tier="zero", tier_options=zero.Options(bucket_cap_mb=-1)), "bucket_cap_mb"),
    (dict(tier="zero", tier_options=ddp.Options()), "tier_options"),
    (dict(tier="ddp", world_size=2, global_batch_size=64, tier_options=ddp.Options(accumulation_steps=3)),
     "accumulation_steps"),
    (dict(tier="ddp", tier_options=ddp.Options(comm_hook="bf16")), "comm_hook"),
    (dict(tier="ddp", tier_options=ddp.Options(powersgd_rank=0)), "powersgd_rank"),
]


@pytest.mark.parametrize("changes,field", BAD, ids=[f"{f}:{c}" for c, f in BAD])
def test_bad_value_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        RunConfig(**changes)


def test_error_lists_the_allowed_values():
    with pytest.raises(ValueError) as info:
        RunConfig(tier="warp-drive")
    for name in ("single", "dp", "ddp-naive", "ddp", "zero"):
        assert name in str(info.value)


def test_good_config_gets_default_tier_options_and_derived_values():
    cfg = RunConfig(tier="ddp", world_size=2, global_batch_size=64, threads_per_rank=1)
    assert isinstance(cfg.tier_options, ddp.Options)
    assert cfg.per_rank_batch == 32
    assert cfg.resolved_threads == 1
    assert cfg.replace(tier="ddp-naive").tier_options != cfg.tier_options


def test_import_path_model_resolves():
    cfg = RunConfig(model="dtlab.core.models:mlp")
    assert callable(cfg.model) is False and cfg.model == "dtlab.core.models:mlp"


def test_config_is_frozen():
    cfg = RunConfig()
    with pytest.raises(AttributeError):
        cfg.steps = 3  # type: ignore[misc]
