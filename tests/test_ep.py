"""Expert parallelism and the moe model on real ranks: parity with one device, the recorded all-to-alls."""

from __future__ import annotations

import functools

import pytest

from dtlab import RunConfig, run
from dtlab.core.results import RunResult
from dtlab.cost.estimate import compare, estimate
from dtlab.cost.estimate import experts as estimate_experts
from dtlab.read import ep as ex
from dtlab.tiers.ep import Options

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_survivors")]

TOL = 1e-5
# Adam at lr 0.001: its update is about lr * sign(g) where g is near zero, so rounding-level differences
# in the experts' summed gradients grow with lr (8.4e-7 here at 0.001, 8.3e-6 at 0.01; measured 2026-12-06).
# tests/test_parity_float64.py holds ep to 1e-10 at lr 0.01 in float64, where rounding cannot hide a bug.
JOB = dict(model="moe", dataset="text", model_size=32, steps=8, optimizer="adam", lr=0.001, global_batch_size=32,
           threads_per_rank=1)


@functools.cache
def job(tier: str = "single", world_size: int = 1) -> RunResult:
    return run(RunConfig(**JOB, tier=tier, world_size=world_size), progress=False)


@pytest.mark.parametrize("tier, world_size", [("ep", 2), ("ep", 4), ("ddp", 2), ("fsdp", 2)])
def test_moe_matches_single_on_the_same_global_batch(tier, world_size):
    result = job(tier, world_size)
    assert result.max_param_diff(job()) <= TOL
    assert len({r.params_checksum for r in result.ranks}) == 1  # every rank ends with the whole model


def test_every_all_to_all_is_recorded_with_its_split_sizes():
    result = job("ep", 2)
    ev = result.events_frame()
    ev = ev[(ev["op"] == "all_to_all_single") & (ev["step"] == 1)]
    layers, row = RunConfig().model_depth, JOB["model_size"] * 4
    kinds = ev["tag"].str.replace(r":blocks\.\d+\.mlp", "", regex=True).value_counts().to_dict()
    assert kinds == {k: 2 * layers for k in ("ep:counts", "ep:dispatch", "ep:combine", "ep:dispatch (backward)",
                                             "ep:combine (backward)")}
    dispatch = ev[ev["tag"] == "ep:dispatch:blocks.0.mlp"].set_index("rank")
    # dropless: each rank sends its tokens x top_k rows, as the formula says; what rank s sends r, r receives
    assert (dispatch["bytes"] == ex.dispatch_bytes(result.config)).all()
    assert (dispatch["input_splits"].map(sum) * row == dispatch["bytes"]).all()
    assert dispatch.loc[0, "input_splits"][1] == dispatch.loc[1, "output_splits"][0]
    assert dispatch.loc[1, "input_splits"][0] == dispatch.loc[0, "output_splits"][1]


def test_tokens_per_expert_and_imbalance_are_reported():
    result = job("ep", 2)
    load = ex.expert_load(result)  # from every rank's routing
    by_owner = [tokens for r in result.ranks for tokens in zip(*r.strategy["expert_tokens"])]  # from the experts
    assert [list(col) for col in by_owner] == [load[e].tolist() for e in load.columns]
    assert (load.sum(axis=1) == 32 * 32 * 2 * 2).all()  # tokens x top_k x layers, dropless
    assert (ex.imbalance(result) >= 1).all()


def test_an_overloaded_expert_makes_its_rank_the_straggler():
    # width 256: the hot expert's extra rows cost milliseconds a step, well above a shared machine's jitter
    # (at width 64 they cost tens of microseconds and the straggler was a coin toss under load)
    cfg = RunConfig(**{**JOB, "steps": 6, "model_size": 256}, tier="ep", world_size=2,
                    tier_options=Options(hot_expert=0))
    result = run(cfg, progress=False)
    assert (ex.imbalance(result) > 1.5).all()
    ranks = ex.rank_load(result)
    busiest = ranks.loc[ranks.groupby("step")["tokens"].idxmax(), "rank"]
    assert (busiest == 0).all()  # expert 0 lives on rank 0
    assert (ex.stragglers(result) == 0).mean() >= 0.5  # the others wait for it
    table = compare(estimate(cfg), result)  # the estimate routes as the hot expert does: rank 0 holds more
    assert (table["error"] == 0).all(), table
    acts = table[table["kind"] == "activations"].set_index("rank")["predicted"]
    assert acts[0] > 1.3 * acts[1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_counts_what_each_ep_rank_holds(world_size, monkeypatch):
    result = job("ep", world_size)
    table = compare(estimate(result.config), result)
    assert set(table["kind"]) >= {"parameters", "gradients", "optimizer_state", "activations"}
    assert set(table["rank"]) == set(range(world_size)) and (table["error"] == 0).all(), table  # every rank, exactly
    measured = table[table["kind"] == "activations"]["measured"]
    assert measured.nunique() > 1  # the router is uneven: a mean per rank would miss each one
    monkeypatch.setattr(estimate_experts, "REAL_ROUTING_MAX_BYTES", 0)  # too large to run: the even router's mean
    mean = [r.memory["activations"] for r in estimate(result.config).per_rank]
    assert len(set(mean)) == 1 and sum(mean) == measured.sum() and max(mean) < measured.max()


def _functional_all_to_all(info):
    """An uneven all-to-all through torch's functional collectives (what DTensor would issue), recorded."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from dtlab.instrument import active

    sent = [[1, 2], [3, 1]][info.rank]
    received = [[1, 3], [2, 1]][info.rank]
    recorder = active()
    before = len(recorder.events)
    x = torch.ones(sum(sent), 4, requires_grad=True)
    all_to_all_single_autograd(x, received, sent, dist.group.WORLD).sum().backward()
    return [ev.row() for ev in recorder.events[before:]]


def test_functional_all_to_alls_are_recorded_with_their_splits_too():
    from dtlab.launch.local import launch

    for rank, rows in enumerate(launch(_functional_all_to_all, 2, progress=False).values):
        forward = [r for r in rows if r["op"] == "all_to_all_single"][0]
        assert forward["input_splits"] == [[1, 2], [3, 1]][rank]
        assert forward["output_splits"] == [[1, 3], [2, 1]][rank]
        assert forward["bytes"] == sum(forward["input_splits"]) * 4 * 4
