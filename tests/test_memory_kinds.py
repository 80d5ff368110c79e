"""The memory kinds a predictor compares with, measured per rank: DDP's buckets, FSDP2's gathered units,
pipeline activations in flight."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest

from dtlab import RunConfig
from dtlab.core.models import build
from dtlab.core.registry import get
from dtlab.tiers import ddp, fsdp, pipeline
from dtlab.train import run

pytestmark = pytest.mark.usefixtures("no_survivors")
DIGITS = (1, 8, 8)  # the digits dataset's images: 64 inputs, 10 classes


def job(tier: str, world_size: int, options: object, **changes: object) -> RunConfig:
    base = dict(tier=tier, world_size=world_size, model="mlp", steps=2, global_batch_size=64, threads_per_rank=1,
                tier_options=options)
    return RunConfig(**{**base, **changes})


def test_every_strategy_has_the_hook():
    for tier in ("single", "ddp", "fsdp", "pipeline"):
        assert callable(get(tier).strategy.memory)


# -- ddp ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_comm_buffers_are_the_buckets_counted_once(as_view):
    # a small bucket cap: several buckets
    result = run(job("ddp", 2, ddp.Options(bucket_cap_mb=0.01, gradient_as_bucket_view=as_view)), progress=False)
    for rank in result.ranks:
        buckets = sum(rank.strategy["bucket_sizes_bytes"])
        assert rank.strategy["num_buckets"] > 1
        assert buckets == pytest.approx(rank.memory["gradients"], rel=0.01)  # the gradients, padding aside
        # copies of the gradients; or the gradients themselves (views), counted once, as gradients
        assert rank.memory["comm_buffers"] == (0 if as_view else buckets)


_BUCKET_PROBE = textwrap.dedent("""
    import os, sys, tempfile
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from dtlab.core.compat import ddp_bucket_sizes

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, gradient_as_bucket_view=sys.argv[1] == "True")
    buffers = {}

    def hook(state, bucket):
        buf = bucket.buffer()
        buffers[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # the second step runs on the rebuilt buckets
        buffers.clear()
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(8, 64)).sum().backward()
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    print(sum(buffers.values()), sum(ddp_bucket_sizes(ddp)), len(grads & buffers.keys()), len(buffers))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_buckets_are_separate_unless_gradients_are_views(as_view):
    """What ddp.Strategy.memory() assumes, measured on DDP itself: the reducer's buffers (seen by a comm
    hook) are the sizes it reports, and the gradients live in them only with gradient_as_bucket_view."""
    out = subprocess.run([sys.executable, "-c", _BUCKET_PROBE, str(as_view)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    real, reported, shared, buckets = map(int, out.stdout.split())
    assert real == reported == (64 * 64 + 64) * 4 * 2 + (64 * 10 + 10) * 4
    assert buckets > 1
    assert shared == (buckets if as_view else 0)


# -- fsdp -----------------------------------------------------------------------------------------
def unit_bytes(width: int, depth: int) -> list[int]:
    """Full parameter bytes of each FSDP unit of the mlp, in forward order."""
    model = build("mlp", DIGITS, 10, width, depth=depth)
    return [sum(p.numel() * 4 for p in unit.parameters()) for _, unit in fsdp.shard_units(model)]


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_comm_buffers_are_the_gathered_peak(reshard):
    width, depth = 64, 4
    sizes = unit_bytes(width, depth)
    assert len(sizes) == 5  # four hidden Linear layers and the classifier
    if reshard:
        # forward: one unit at a time; backward: each unit with the one before it (FSDP2 prefetches it)
        expected = max(max(sizes), *(a + b for a, b in zip(sizes, sizes[1:])))
    else:
        expected = sum(sizes)  # all gathered after forward, until each unit's backward
    cfg = job("fsdp", 2, fsdp.Options(reshard_after_forward=reshard), model_size=width, model_depth=depth)
    result = run(cfg, progress=False)
    for rank in result.ranks:
        assert rank.strategy["unit_bytes"] == dict(zip(rank.strategy["fsdp_units"], sizes))
        assert rank.memory["comm_buffers"] == expected


# -- pipeline -------------------------------------------------------------------------------------
@functools.cache
def activations(schedule: str, microbatches: int, stages: int = 2) -> list[int]:
    cfg = job("pipeline", stages, pipeline.Options(schedule=schedule, microbatches=microbatches), model_depth=4)
    return [rank.memory["activations"] for rank in run(cfg, progress=False).ranks]


def test_pipeline_activations_in_flight_per_schedule():
    stages, m = 2, 4
    naive, gpipe, one_f_one_b = (activations(s, m) for s in ("naive", "gpipe", "1f1b"))
    # naive holds one micro-batch: the rest of each peak is whole micro-batches of the same size
    for stage in range(stages):
        per_micro = (gpipe[stage] - naive[stage]) / (m - 1)  # GPipe: all M after the forwards
        assert per_micro > 0
        in_flight = stages - stage  # 1F1B: S - stage forwards before the first backward
        assert one_f_one_b[stage] == pytest.approx(naive[stage] + (in_flight - 1) * per_micro)


@pytest.mark.parametrize("microbatches", [4, 8])
def test_one_f_one_b_holds_less_than_gpipe(microbatches):
    gpipe, one_f_one_b = activations("gpipe", microbatches), activations("1f1b", microbatches)
    assert one_f_one_b[0] < gpipe[0]
    assert all(a <= b for a, b in zip(one_f_one_b, gpipe))
