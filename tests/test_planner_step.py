"""The planner's step time from first principles: the ops' FLOPs against the FLOP conventions, each strategy's
exposed communication, the bubble of each pipeline schedule, NCCL's ring and tree on the links a group crosses."""

from __future__ import annotations

import dataclasses

import pytest

from dtlab.cost import planner as P
from dtlab.cost.planner import network
from dtlab.cost.planner.layout import Layout, check_layout
from dtlab.cost.planner.ops import stage_ops
from dtlab.cost.planner.search import evaluate
from dtlab.cost.planner.step import bubble
from dtlab.cost.roofline import MEMORY, compute_time

GPT = P.TransformerSpec("gpt", layers=4, hidden=1024, heads=16, kv_heads=16, ffn=4096, seq=2048, vocab=50000,
                        gated_mlp=False)


def _counted(model, layout):
    """Matmul and attention FLOPs of one micro-batch on one GPU of a one-stage layout (model and hardware)."""
    timed = compute_time([op for op in stage_ops(model, layout, first=True, last=True).all() if op.kind != MEMORY],
                         P.H100_SXM.device)
    return timed.model_flops, timed.hardware_flops


@pytest.mark.parametrize("model", [GPT, P.LLAMA2_70B, P.MIXTRAL_8X7B, dataclasses.replace(GPT, flash_attention=False)],
                         ids=["gpt", "gqa-swiglu", "moe", "materialised"])
@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_the_ops_count_the_flops_the_conventions_count(model, ckpt):
    tp = 8 if model.kv_heads % 8 == 0 else 4
    for t in (1, tp):
        layout = Layout(1, t, 1, 0, ckpt, 2, "bf16", ep=1)
        tokens = 2 * model.seq
        model_flops, hardware_flops = _counted(model, layout)
        assert model_flops * t == pytest.approx(model.model_flops_per_token() * tokens, rel=1e-3)
        assert hardware_flops * t == pytest.approx(model.flops_per_token(ckpt) * tokens, rel=1e-3)


def test_grouped_query_attention_shrinks_only_the_kv_projections():
    gqa = dataclasses.replace(GPT, kv_heads=4)
    shapes = {op.name: op.shape for op in stage_ops(gqa, Layout(1, 1, 1, 0, "none", 1, "bf16"), first=True,
                                                     last=True).forward if op.shape}
    assert shapes["qkv"][1] == GPT.hidden + 2 * 4 * 64 and shapes["attn_out"][1] == GPT.hidden


def test_mfu_and_hfu_come_out_of_the_step_and_are_never_mixed():
    for ckpt in ("none", "full"):
        row = evaluate(GPT, P.A100_80GB, Layout(8, 1, 1, 0, ckpt, 4, "bf16"), 64)
        tokens = 64 * GPT.seq
        assert row["mfu"] == pytest.approx(GPT.model_flops_per_token() * tokens / (row["step_s"] * 8 * 312e12))
        assert row["hfu"] == pytest.approx(GPT.flops_per_token(ckpt) * tokens / (row["step_s"] * 8 * 312e12))
        assert (row["hfu"] == row["mfu"]) == (ckpt == "none") and 0 < row["mfu"] <= row["hfu"] < 0.8


def test_tensor_parallel_collectives_are_exposed_and_recomputation_adds_its_passes():
    rows = {ckpt: evaluate(P.LLAMA2_70B, P.H100_SXM, Layout(8, 8, 1, 1, ckpt, 1, "bf16"), 64)
            for ckpt in ("none", "selective", "full")}
    assert rows["none"]["tp_comm_s"] > 0 and rows["full"]["tp_comm_s"] > rows["none"]["tp_comm_s"]
    assert rows["none"]["compute_s"] < rows["selective"]["compute_s"] < rows["full"]["compute_s"]
    slower = dataclasses.replace(P.H100_SXM, intra_bus_bandwidth=P.H100_SXM.intra_bus_bandwidth / 4)
    assert evaluate(P.LLAMA2_70B, slower, Layout(8, 8, 1, 1, "none", 1, "bf16"), 64)["tp_comm_s"] > \
        2 * rows["none"]["tp_comm_s"]


def test_each_schedule_has_its_bubble():
    one = Layout(4, 1, 8, 1, "none", 1, "bf16")
    f, b, w = 1.0, 1.0, 1.0
    assert bubble(one, f, b, w) == 7 * 3.0
    assert bubble(dataclasses.replace(one, schedule="gpipe"), f, b, w) == 7 * 3.0
    assert bubble(dataclasses.replace(one, schedule="interleaved", interleave=4), f, b, w) == 7 * 3.0 / 4
    assert bubble(dataclasses.replace(one, schedule="zero_bubble"), f, b, w) == 7 * 1.0  # ZB-H1: F + B - W
    assert bubble(dataclasses.replace(one, pp=1), f, b, w) == 0.0
    # over a real model: more micro-batches amortise the bubble; the interleaved schedule shrinks it
    model, cluster = P.LLAMA2_7B, P.H100_SXM
    few, many = (evaluate(model, cluster, Layout(4, 1, 8, 1, "selective", 1, "bf16"), n) for n in (32, 256))
    assert few["bubble_s"] / few["step_s"] > many["bubble_s"] / many["step_s"]
    inter = evaluate(model, cluster, Layout(4, 1, 8, 1, "selective", 1, "bf16", interleave=2, schedule="interleaved"),
                     32)
    assert inter["bubble_s"] < few["bubble_s"] and inter["pp_comm_s"] > few["pp_comm_s"]
    gpipe = P.search(model, cluster, gpus=32, global_batch=64).table  # GPipe is not searched, 1F1B is
    assert set(gpipe.loc[gpipe["pp"] > 1, "schedule"]) == {"1f1b", "interleaved"}


def test_data_parallel_reduction_hides_under_the_backward_except_the_last_bucket():
    model, cluster = P.LLAMA2_7B, P.H100_SXM
    ddp = evaluate(model, cluster, Layout(64, 1, 1, 0, "none", 1, "bf16"), 256)
    assert 0 < ddp["dp_exposed_s"] < ddp["dp_comm_s"] and ddp["dp_link"] == "inter"
    slow = dataclasses.replace(cluster, inter_bus_bandwidth=cluster.inter_bus_bandwidth / 100)
    slowed = evaluate(model, slow, Layout(64, 1, 1, 0, "none", 1, "bf16"), 256)
    assert slowed["dp_exposed_s"] > 0.5 * slowed["dp_comm_s"]  # the backward cannot hide it any more
    fsdp = evaluate(model, cluster, Layout(64, 1, 1, 3, "none", 1, "bf16"), 256)
    assert fsdp["dp_comm_s"] > 3 * ddp["dp_comm_s"]  # every micro-batch gathers and scatters again


def test_collectives_take_the_links_they_cross():
    c = P.H100_SXM
    tp = network.group(c, 8)
    dp = network.group(c, 64, stride=8)  # one member per node: one NIC each
    dp4 = network.group(c, 64, stride=2)  # four members per node: four NICs' worth
    assert (tp.where, dp.where, dp4.per_node, network.group(c, 1).where) == ("intra", "inter", 4, "none")
    size = 1e9
    ring = 7 * c.intra_latency_s + 7 / 8 * size / c.intra_bus_bandwidth
    assert network.seconds(c, "all_gather", size, tp) == pytest.approx(ring)
    assert network.seconds(c, "all_reduce", size, dp4) < network.seconds(c, "all_reduce", size, dp)
    # a small all-reduce over many nodes: the tree's log2(nodes) latency beats the ring's 2 (n - 1) steps
    many = network.group(c, 512, stride=8)
    assert network.seconds(c, "all_reduce", 1e3, many) < 2 * 511 * c.inter_latency_s / 10
    assert network.seconds(c, "all_to_all", size, tp) < network.seconds(c, "all_to_all", size, network.group(c, 16))
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        network.seconds(c, "gossip", 1.0, tp)


def test_uneven_stages_are_timed_at_the_busiest_and_context_parallel_splits_the_sequence():
    llama3 = P.TransformerSpec("405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, seq=8192,
                               vocab=128000)
    layout = Layout(2, 8, 16, 1, "none", 1, "bf16")
    check_layout(llama3, P.H100_SXM, layout, 32)  # 126 layers on 16 stages: 8 on the busiest
    assert layout.stage_layers(126) == 8
    long = dataclasses.replace(llama3, seq=131072)
    cp = evaluate(long, P.H100_SXM, Layout(1, 8, 16, 1, "none", 1, "bf16", cp=16), 256)
    plain = evaluate(long, P.H100_SXM, Layout(16, 8, 16, 1, "none", 1, "bf16"), 256)
    assert cp["activations"] == pytest.approx(plain["activations"] / 16, rel=0.1)
    assert cp["cp_comm_s"] < 0.05 * cp["step_s"]  # the ring hides under the attention of 131k tokens
    with pytest.raises(ValueError, match="^cp=3 is invalid"):
        check_layout(llama3, P.H100_SXM, Layout(1, 8, 2, 1, "none", 1, "bf16", cp=3), 16)
