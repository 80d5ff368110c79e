"""The planner: analytic model against the real charformer, ZeRO's formulas, feasibility, ranking, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtlab.core import registry
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job
from dtlab.cost import planner as P
from dtlab.cost.estimate import estimate
from dtlab.cost.planner.search import Layout, check_layout, memory


@pytest.mark.parametrize("width,depth", [(16, 1), (64, 2), (96, 3), (128, 4)])
def test_analytic_parameters_equal_the_real_charformer(width, depth):
    spec = P.from_charformer(width, depth)
    cfg = RunConfig(tier="single", model="charformer", dataset="text", model_size=width, model_depth=depth)
    model, _ = build_job(cfg, torch.device("meta"))
    assert spec.parameters() == sum(p.numel() for p in model.parameters())
    assert spec.parameters() == estimate(cfg).memory["parameters"] // 4  # fp32: 4 bytes a parameter


def test_named_sizes_have_their_published_parameter_counts():
    assert P.LLAMA2_7B.parameters() == 6_738_415_616  # Llama-2-7b-hf's count
    assert P.LLAMA2_70B.parameters() == 68_976_648_192
    # 6N plus attention: a 7B model at 4k context trains on ~46 GFLOPs a token
    assert P.LLAMA2_7B.flops_per_token() == pytest.approx(6 * P.LLAMA2_7B.matmul_parameters()
                                                          + 12 * 32 * 4096 * 4096)
    assert P.LLAMA2_7B.flops_per_token("full") > P.LLAMA2_7B.flops_per_token("selective") > \
        P.LLAMA2_7B.flops_per_token()


def test_activation_formulas_are_korthikantis():
    m = dataclasses.replace(P.LLAMA2_7B, flash_attention=False)  # their formulas keep the s x s scores
    s, h, a, b = m.seq, m.hidden, m.heads, 2
    assert m.activation_bytes(b) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert m.activation_bytes(b, tp=4) == pytest.approx(s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert m.activation_bytes(b, tp=4, sequence_parallel=True) == pytest.approx(s * b * h / 4 * (34 + 5 * a * s / h))
    assert m.activation_bytes(b, recompute="selective") == pytest.approx(s * b * h * 34)
    assert m.activation_bytes(b, recompute="full") == pytest.approx(2 * s * b * h)
    assert P.LLAMA2_7B.activation_bytes(b) == pytest.approx(s * b * h * 34)  # flash attention stores no scores


def test_zero_stages_shrink_memory_as_the_paper_says():
    model, dp = P.LLAMA2_7B, 8
    psi = model.parameters()
    rows = {z: memory(model, Layout(dp, 1, 1, z, "selective", 1, "bf16"), 64) for z in range(4)}
    totals = [rows[z]["parameters"] + rows[z]["gradients"] + rows[z]["optimizer_state"] for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    # Rajbhandari et al. 2020, fig. 1: (2 + 2 + K) psi, then K psi / Nd, then (2 + K) psi / Nd, then all / Nd; K = 12
    assert totals[0] == pytest.approx(16 * psi)
    assert totals[1] == pytest.approx(4 * psi + 12 * psi / dp)
    assert totals[2] == pytest.approx(2 * psi + 14 * psi / dp)
    assert totals[3] == pytest.approx(16 * psi / dp)
    assert len({rows[z]["activations"] for z in range(4)}) == 1  # ZeRO does not touch activations


def test_70b_does_not_fit_one_gpu_but_fits_eight_nodes():
    alone = P.search(P.LLAMA2_70B, P.H100_SXM, gpus=1, global_batch=8)
    assert alone.feasible().empty
    assert alone.table["peak_bytes"].min() > 16 * P.LLAMA2_70B.parameters() * 0.99
    with pytest.raises(ValueError, match="no layout"):
        alone.best()
    plan = P.search(P.LLAMA2_70B, P.H100_SXM, gpus=64, global_batch=512)
    best = plan.best()
    assert best["peak_bytes"] <= P.H100_SXM.gpu_memory_bytes
    assert best["dp"] * best["tp"] * best["pp"] == 64
    assert "PROJECTION" in plan.assumptions[0] and "PROJECTION" in repr(plan)


def test_ranking_is_feasible_first_then_by_step_time():
    table = P.search(P.LLAMA2_7B, P.H100_SXM, gpus=16, global_batch=256).table
    assert list(table["rank"]) == list(range(1, len(table) + 1))
    fits = table["feasible"].tolist()
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    for _, part in table.groupby("feasible"):
        assert part["step_s"].is_monotonic_increasing


def test_tensor_parallel_never_leaves_a_node():
    for cluster in P.CLUSTERS.values():
        table = P.search(P.LLAMA2_70B, cluster, gpus=32, global_batch=256).table
        assert (table["tp"] <= cluster.gpus_per_node).all() and (cluster.gpus_per_node % table["tp"] == 0).all()
    with pytest.raises(ValueError, match="^tp=16 is invalid: a tensor-parallel group stays inside one node"):
        check_layout(P.LLAMA2_70B, P.H100_SXM, Layout(1, 16, 2, 0, "none", 1, "bf16"), 64)


def test_more_bandwidth_never_slows_a_step():
    fast = P.H100_SXM
    slow = P.Cluster(**{**fast.__dict__, "name": "slow", "inter_bus_bandwidth": fast.inter_bus_bandwidth / 10})
    a = P.search(P.LLAMA2_7B, fast, gpus=32, global_batch=256).table.set_index(["dp", "tp", "pp", "zero",
                                                                                "checkpointing", "micro_batch",
                                                                                "precision", "schedule"])
    b = P.search(P.LLAMA2_7B, slow, gpus=32, global_batch=256).table.set_index(a.index.names)
    assert (b.loc[a.index, "step_s"] >= a["step_s"] - 1e-12).all()
    assert (b.loc[a.index, "step_s"] > a["step_s"]).any()


@pytest.mark.parametrize("call,field", [
    (lambda: check_layout(P.LLAMA2_7B, P.H100_SXM, Layout(1, 3, 1, 0, "none", 1, "bf16"), 8), "tp"),
    (lambda: P.search(P.LLAMA2_7B, P.H100_SXM, gpus=8, global_batch=-4), "global_batch"),
    (lambda: P.search(P.LLAMA2_7B, P.H100_SXM, gpus=0, global_batch=8), "gpus"),
    (lambda: P.search(P.LLAMA2_7B, P.H100_SXM, gpus=12, global_batch=96), "gpus"),
    (lambda: check_layout(P.LLAMA2_7B, P.H100_SXM, Layout(2, 1, 4, 0, "none", 1, "bf16", interleave=3,
                                                          schedule="interleaved"), 64), "interleave"),
    (lambda: check_layout(P.LLAMA2_7B, P.H100_SXM, Layout(2, 1, 2, 0, "none", 1, "bf16", schedule="wavy"), 64),
     "schedule"),
    (lambda: P.TransformerSpec("x", layers=2, hidden=100, heads=3, kv_heads=3, ffn=400, seq=8, vocab=10), "heads"),
    (lambda: P.TransformerSpec("x", layers=0, hidden=64, heads=2, kv_heads=2, ffn=256, seq=8, vocab=10), "layers"),
    (lambda: check_layout(P.LLAMA2_7B, P.H100_SXM, Layout(2, 1, 2, 3, "none", 1, "bf16"), 8), "zero"),
    (lambda: check_layout(P.LLAMA2_7B, P.H100_SXM, Layout(8, 1, 1, 0, "some", 1, "bf16"), 8), "checkpointing"),
    (lambda: P.Cluster(**{**P.H100_SXM.__dict__, "gpu_memory_bytes": -1}), "gpu_memory_bytes"),
])
def test_bad_input_is_one_line_naming_the_field(call, field):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and field in message.split("=")[0]


def test_scaled_down_gives_a_valid_job_for_every_kind_of_row():
    rows = []
    for gpus, model in ((1, P.from_charformer(64, 2)), (2, P.from_charformer(64, 2)), (16, P.LLAMA2_7B)):
        rows += [r for _, r in P.search(model, P.H100_SXM, gpus=gpus, global_batch=32).table.iterrows()]
    seen = {}
    for row in rows:
        seen.setdefault((P.scaled_tier(row)[0], int(row["zero"]), row["checkpointing"], row["precision"]), row)
    tiers = {key[0] for key in seen}
    assert tiers == {"single", "ddp", "zero", "fsdp", "pipeline", "tp", "fsdp-tp"}
    for row in seen.values():
        cfg = P.scaled_down(row)
        assert cfg.world_size <= 4 and cfg.model == "charformer"
        registry.get(cfg.tier).validate(cfg)  # RunConfig ran it already; the tier's own check, named
        assert RunConfig.from_dict(cfg.to_dict()) == cfg


def _one_row_per_scaled_tier() -> dict[str, dict]:
    """A planned row for each tier a layout scales down to: Llama 2 7B's and a charformer's layouts, and
    Mixtral 8x7B's with expert parallelism."""
    best = P.search(P.LLAMA2_7B, P.H100_SXM, gpus=64, global_batch=1024).best()
    rows: dict[str, dict] = {"llama2-7b best": dict(best)}
    searches = ((2, P.from_charformer(64, 2), 32), (16, P.LLAMA2_7B, 32), (64, P.MIXTRAL_8X7B, 1024))
    for gpus, model, batch in searches:
        for _, row in P.search(model, P.H100_SXM, gpus=gpus, global_batch=batch).table.iterrows():
            rows.setdefault(P.scaled_tier(row)[0], dict(row))
    return rows


@pytest.mark.slow
def test_the_scaled_down_runs_bytes_equal_the_estimates(no_survivors):
    from dtlab.app.planner import run_scaled

    rows = _one_row_per_scaled_tier()
    assert {"ddp", "zero", "fsdp", "pipeline", "tp", "fsdp-tp", "ep"} <= set(rows)
    for name, row in rows.items():
        done = run_scaled(row, steps=2)
        assert done.config.tier == P.scaled_tier(row)[0]
        frame = done.frame
        assert set(frame["rank"]) == set(range(done.config.world_size)), name
        assert {"parameters", "optimizer_state", "activations"} <= set(frame["kind"]), name
        assert (frame["error"] == 0).all(), f"{name}:\n{frame}"  # every rank and kind, to the byte
    assert done.figure().axes[0].get_ylabel().startswith("bytes per rank (")


def test_the_panel_plans_labels_a_projection_and_names_bad_input():
    import dtlab

    panel = dtlab.widgets.planner(model="70B", cluster="A100", gpus=64, global_batch=512)
    assert "PROJECTION" in panel.message.value and panel.plan.model is P.LLAMA2_70B
    assert panel.pick.options and "<table>" in panel.table.value and panel.bars_image.value
    panel.cluster_fields["GPU memory (GB)"].value = 40.0  # a typed figure: no longer the preset's
    assert panel.cluster_preset.value == "custom"
    panel.update()
    assert panel.plan.cluster.gpu_memory_bytes == 40e9
    assert len(panel.plan.feasible()) < len(P.search(P.LLAMA2_70B, P.A100_80GB, gpus=64, global_batch=512).feasible())
    panel.model_fields["heads"].value = 7
    panel.update()
    assert "cannot plan this" in panel.message.value and "heads" in panel.message.value
    with pytest.raises(ValueError, match="no such setting"):
        dtlab.widgets.planner(colour="red")
