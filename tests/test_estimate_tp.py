"""The memory rules of the tensor- and context-parallel tiers: predicted on fake tensors, without a process
group, they must equal what a run counts on its real DTensor shards, per rank and kind."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab import RunConfig, run
from dtlab.cost.estimate import activations as acts
from dtlab.cost.estimate import compare, estimate
from dtlab.cost.estimate import memory as mem
from dtlab.cost.estimate.tensor_parallel import RULES, localize, shard_dims, share, tp_locals
from dtlab.tiers import cp, fsdp, fsdp_tp, tp

TEXT = {"model": "charformer", "dataset": "text", "model_size": 32}
COUNTED = {"parameters", "gradients", "optimizer_state", "activations"}  # these tiers report no comm_buffers


def test_the_rules_are_registered():
    assert RULES.items() <= mem.RULES.items()


def fake(cfg: RunConfig) -> tuple[torch.nn.Module, acts.Shapes]:
    s = acts.shapes(cfg)
    return acts.fake_model(cfg, s, FakeTensorMode()), s


def test_share_is_torch_chunk():
    for size in (1, 5, 53, 64):
        for n in (1, 2, 3, 4):
            assert [share(size, n, i) for i in range(n)][:len(torch.arange(size).chunk(n))] == \
                [len(c) for c in torch.arange(size).chunk(n)]


def test_shard_dims_follow_the_plan():
    cfg = RunConfig(tier="tp", world_size=2, **TEXT)
    dims, whole_grad = shard_dims(fake(cfg)[0], tp.Options())
    assert dims["blocks.0.attn.q.weight"] == dims["blocks.0.attn.q.bias"] == dims["head.weight"] == 0  # Colwise
    assert dims["blocks.0.mlp.2.weight"] == 1 and "blocks.0.mlp.2.bias" not in dims  # Rowwise: bias whole
    assert dims["tok.weight"] == 0 and whole_grad == {"tok.weight"}  # Rowwise embedding: rows
    assert "pos.weight" not in dims and "ln.weight" not in dims


def test_local_model_holds_the_local_shards():
    cfg = RunConfig(tier="tp", world_size=2, **TEXT)
    model, s = fake(cfg)
    for i in range(2):
        mode = FakeTensorMode()
        local = localize(acts.fake_model(cfg, s, mode), tp.Options(), 2, i, mode)
        want = tp_locals(model, tp.Options(), 2, i)
        assert {k: tuple(p.shape) for k, p in local.named_parameters()} == {k: tuple(t.shape) for k, t in want.items()}
    assert want["head.weight"].shape[0] == 26  # 53 characters: 27 rows on rank 0, 26 on rank 1


def test_fsdp_tp_with_one_column_is_fsdp():
    cfg = RunConfig(tier="fsdp-tp", world_size=2, global_batch_size=32, tier_options=fsdp_tp.Options(tp_size=1),
                    **TEXT)
    model, s = fake(cfg)
    got = RULES["fsdp-tp"](cfg, model, s)
    want = mem.fsdp(cfg.replace(tier="fsdp", tier_options=fsdp.Options()), model, s)
    assert [r.memory for r in got] == [r.memory for r in want]


JOBS = {
    "tp-mlp": RunConfig(tier="tp", world_size=2, model="mlp", model_size=96),
    "tp": RunConfig(tier="tp", world_size=2, **TEXT),
    "tp-sp-recompute": RunConfig(tier="tp", world_size=2, activation_checkpointing=True,
                                 tier_options=tp.Options(sequence_parallel=True), **TEXT),
    "tp-lp": RunConfig(tier="tp", world_size=2, tier_options=tp.Options(loss_parallel=True), **TEXT),
    "fsdp-tp-sp-lp": RunConfig(tier="fsdp-tp", world_size=4, **TEXT, tier_options=fsdp_tp.Options(
        tp_size=2, sequence_parallel=True, loss_parallel=True)),
    "cp": RunConfig(tier="cp", world_size=2, **TEXT),
    "cp-zigzag-w4": RunConfig(tier="cp", world_size=4, tier_options=cp.Options(balance="zigzag"), **TEXT),
    "cp-ulysses-zigzag-w4": RunConfig(tier="cp", world_size=4, model_heads=4,
                                      tier_options=cp.Options(method="ulysses", balance="zigzag"), **TEXT),
}


@pytest.mark.parametrize("cfg", JOBS.values(), ids=JOBS.keys())
def test_predicted_equals_measured_kind_by_kind(cfg, no_survivors):
    cfg = cfg.replace(steps=2, global_batch_size=32, threads_per_rank=1)
    table = compare(estimate(cfg), run(cfg, progress=False))
    assert set(table["kind"]) >= COUNTED and len(set(table["rank"])) == cfg.world_size
    wrong = table[table["predicted"] != table["measured"]]
    assert wrong.empty, wrong.to_string()
