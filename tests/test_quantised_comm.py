"""Quantised communication trains with bounded drift at world 2 and 4, sends the bytes its codes promise, keeps
fp32 collectives on the path they took before, and keeps every rank's parameters identical.

Quantisation changes the numbers on purpose, so parity here is a bound on the drift of the loss curve from one
device's (20 Adam steps of the mlp at lr 0.01, the parity job). Measured here (one CPU model, x86_64): the
largest |loss - single's| over the steps is 2.7e-3 (ddp bf16) to 3.0e-2 (fsdp fp8 gathers, bf16 gradients)
across the cases below, on losses falling from 2.3 to about 0.5; the bound is 6e-2. The parameters end 5e-2 to
0.16 apart (Adam's lr-sized steps where a gradient is near zero turn any change into that).
``python -m dtlab.experiments.quantised`` measures the drift over 300 steps and the bytes.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from dtlab.core.quantise import encoded_bytes
from dtlab.core.results import RunResult
from dtlab.tiers import ddp, fsdp
from dtlab.tiers.parts import ddp_knobs
from dtlab.train import run
from tests.parity import job, single

pytestmark = pytest.mark.usefixtures("no_survivors")

DRIFT = 6e-2
BLOCK = 128
# (tier, world, all-gather code, reduce code): every code at 2 or 4 ranks, fp32 beside a quantised one
CASES = [("fsdp", 2, "int8", "fp32"), ("fsdp", 4, "fp32", "fp8"), ("fsdp", 2, "fp8", "bf16"),
         ("fsdp", 4, "bf16", "int8"), ("ddp", 2, "int8", "int8"), ("ddp", 4, "fp8", "fp8"), ("ddp", 2, "bf16", "bf16")]


@functools.cache
def quantised(tier: str, n: int, gather: str, reduce: str) -> RunResult:
    options = fsdp.Options(gather_comm_dtype=gather, reduce_comm_dtype=reduce, comm_block=BLOCK) if tier == "fsdp" \
        else ddp.Options(comm_dtype=gather, comm_block=BLOCK)
    return run(job("adam", tier=tier, world_size=n, tier_options=options), progress=False)


def _steady_events(result: RunResult, rank: int = 0):
    ev = result.events_frame()
    return ev[(ev["rank"] == rank) & (ev["step"] >= 1) & (ev["step"] < result.config.steps)]


def _fsdp_unit_shards(n: int) -> list[int]:
    """Elements of each fsdp unit's padded shard (each Linear of the mlp: ceil(rows / n) rows per rank)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))
    return [sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) for p in m.parameters()) for m in model]


@pytest.mark.parametrize(("tier", "n", "gather", "reduce"), CASES, ids=[f"{t}-w{n}-ag_{g}-rs_{r}"
                                                                        for t, n, g, r in CASES])
def test_quantised_training_drifts_within_its_bound_and_ranks_agree(tier, n, gather, reduce):
    result, ref = quantised(tier, n, gather, reduce), single("adam")
    drift = (result.loss_curve() - ref.loss_curve()).abs()
    assert drift.max() <= DRIFT, drift.max()
    assert drift.max() > 0  # the codes did change the numbers
    assert len({r.params_checksum for r in result.ranks}) == 1  # every rank summed the same decoded values
    assert result.ranks[0].strategy.get("comm_dtype", gather) == gather


@pytest.mark.parametrize(("tier", "n", "gather", "reduce"), CASES, ids=[f"{t}-w{n}-ag_{g}-rs_{r}"
                                                                        for t, n, g, r in CASES])
def test_the_recorded_bytes_are_the_codes(tier, n, gather, reduce):
    ev = _steady_events(quantised(tier, n, gather, reduce))
    steps = quantised(tier, n, gather, reduce).config.steps - 1
    per_op = (ev.groupby(["op", "dtype"])["bytes"].sum() / steps).to_dict()
    if tier == "ddp":  # every rank's encoded bucket, gathered: n codes of the bucket
        buckets = quantised(tier, n, gather, reduce).ranks[0].strategy["bucket_sizes_bytes"]
        assert per_op.pop(("all_gather_into_tensor", "uint8")) == n * sum(
            encoded_bytes(b // 4, gather, BLOCK) for b in buckets)
        assert set(op for op, _ in per_op) <= {"broadcast"}  # and no all-reduce of gradients
        return
    shards = _fsdp_unit_shards(n)

    def expect(code: str) -> tuple[str, int]:  # one unit's collective: n shards, as codes or as float32
        return "float32" if code == "fp32" else "uint8", sum(n * encoded_bytes(s, code, BLOCK)
                                                                          for s in shards)

    # all-gathers: twice per step (forward and backward); the reduction: a reduce-scatter in fp32, else an
    # all-to-all of every chunk's code (gloo cannot add int8 or fp8)
    gather_dtype, gathered = expect(gather)
    assert per_op.pop(("all_gather_into_tensor", gather_dtype)) == 2 * gathered
    reduce_dtype, reduced = expect(reduce)
    reduce_op = "reduce_scatter_tensor" if reduce == "fp32" else "all_to_all_single"
    assert per_op.pop((reduce_op, reduce_dtype)) == reduced
    assert not per_op


def test_fp32_takes_the_collectives_it_took_before():
    """fp32 keeps DDP's built-in all-reduce (no hook) and FSDP2's own collectives (see the mixed cases above)."""
    assert ddp_knobs.comm_hook(ddp.Options()) == (None, None)
    assert ddp_knobs.comm_hook(ddp.Options(comm_dtype="int8"))[1] is not None


def test_fsdp_runs_on_simulated_hosts_for_the_slow_link_measurement(nothing_left):
    """``run_on_hosts``: a local tier's job as torchrun agents on network namespaces with capped links (root)."""
    from dtlab.launch import netns
    from dtlab.train.runner import run_on_hosts

    cfg = job("adam", tier="fsdp", world_size=2, steps=3,
              tier_options=fsdp.Options(gather_comm_dtype="int8", reduce_comm_dtype="int8"))
    with pytest.raises(ValueError, match="nnodes=3 must divide world_size=2"):
        run_on_hosts(cfg, nnodes=3, link_mbit=200)
    with pytest.raises(ValueError, match="the rpc tier starts its own processes"):
        run_on_hosts(job("sgd", tier="rpc", world_size=2), nnodes=2, link_mbit=200)
    if not netns.available()[0]:
        with pytest.raises(ValueError, match="cannot run here"):
            run_on_hosts(cfg, nnodes=2, link_mbit=200)
        return
    result = run_on_hosts(cfg, nnodes=2, link_mbit=200)
    assert {(r.strategy["network"], r.strategy["link_mbit"]) for r in result.ranks} == {("netns", 200.0)}
    assert len({r.params_checksum for r in result.ranks}) == 1
    ev = _steady_events(result)
    assert set(ev["dtype"]) == {"uint8"} and set(ev["op"]) == {"all_gather_into_tensor", "all_to_all_single"}
