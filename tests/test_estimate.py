"""The memory estimator: counted on fake tensors, it must agree with what a run counts on real ones."""

from __future__ import annotations

import json

import pytest
import torch

from dtlab import RunConfig, run
from dtlab.app.cli import main
from dtlab.core import models
from dtlab.core.job import build_job
from dtlab.core.memory import SavedActivations
from dtlab.cost.estimate import KINDS, compare, estimate
from dtlab.cost.estimate.activations import activation_bytes, shapes
from dtlab.cost.estimate.memory import ADAM_STEP_BYTES, zero_partition
from dtlab.tiers import ddp, fsdp, pipeline

JOBS = {
    "mlp": {"model": "mlp", "model_size": 96},
    "cnn-bn": {"model": "cnn-bn", "model_size": 16},
    "charformer": {"model": "charformer", "dataset": "text", "model_size": 32},
    "charformer-recompute": {"model": "charformer", "dataset": "text", "model_size": 32, "model_depth": 3,
                             "activation_checkpointing": True},
    "charformer-bf16": {"model": "charformer", "dataset": "text", "model_size": 32, "precision": "bf16"},
    "mlp-float64": {"model": "mlp", "model_size": 96, "dtype": "float64"},
    "charformer-float64": {"model": "charformer", "dataset": "text", "model_size": 32, "dtype": "float64"},
}


@pytest.mark.parametrize("job", JOBS.values(), ids=JOBS.keys())
def test_fake_forward_saves_what_a_real_forward_saves(job):
    cfg = RunConfig(global_batch_size=16, **job)
    model, data = build_job(cfg, torch.device("cpu"))
    x, y = data.train_x[:16].clone(), data.train_y[:16].clone()  # a copy, as the loop's indexing makes
    with SavedActivations() as acts, torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        models.loss(model(x), y)
    measured = acts.bytes(exclude=model.parameters())
    assert measured > 0
    assert activation_bytes(cfg, shapes(cfg), 16) == measured


def test_float64_doubles_the_parameters_and_their_state():
    base = {"model": "charformer", "dataset": "text", "model_size": 32, "tier": "ddp", "world_size": 2}
    single, double = (estimate(RunConfig(**base, dtype=d)).memory for d in ("float32", "float64"))
    for kind in ("parameters", "gradients"):  # activations hold integer tensors too: the fake-forward test above
        assert double[kind] == 2 * single[kind], kind
    # Adam's moments double; its per-parameter step count stays a float32 scalar
    tensors = len(list(build_job(RunConfig(**base), torch.device("cpu"))[0].parameters()))
    assert double["optimizer_state"] == 2 * single["optimizer_state"] - ADAM_STEP_BYTES * tensors


def test_recompute_and_bf16_are_seen():
    base = {"model": "charformer", "dataset": "text", "model_size": 32, "model_depth": 3}
    full = estimate(RunConfig(**base)).memory["activations"]
    assert estimate(RunConfig(**base, activation_checkpointing=True)).memory["activations"] < full / 2
    assert estimate(RunConfig(**base, precision="bf16")).memory["activations"] < full


def test_zero_partition_is_greedy_by_size():
    sizes = [torch.empty(n) for n in (10, 7, 5, 4, 1)]
    parts = zero_partition(sizes, 2)
    assert [sum(t.numel() for t in p) for p in parts] == [14, 13]  # 10+4 | 7+5+1


def test_pipeline_1f1b_keeps_fewer_micro_batches_than_gpipe():
    def acts(schedule):
        cfg = RunConfig(tier="pipeline", world_size=2, model_depth=4,
                        tier_options=pipeline.Options(schedule=schedule, microbatches=8))
        return estimate(cfg).per_rank[0].memory["activations"]
    gpipe, one_f_one_b = acts("gpipe"), acts("1f1b")
    assert one_f_one_b < gpipe  # stage 0 of 2: 2 micro-batches in flight against all 8 (the batch they slice once)


def test_an_unestimated_tier_is_named():
    with pytest.raises(ValueError, match="tier 'dp' has no memory rule"):
        estimate(RunConfig(tier="dp", world_size=2))


def test_cli_json_has_the_documented_keys(capsys):
    assert main(["estimate", "--tier", "zero", "--world-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"memory", "peak_bytes", "step_ms", "assumptions"} <= out.keys()
    assert set(out["memory"]) == set(KINDS) and out["peak_bytes"] == sum(out["memory"].values())
    assert len(out["per_rank"]) == 2 and out["step_ms"] is None


def test_cli_json_has_memory_max_over_ranks_each_kinds_own_maximum(capsys):
    # a charformer pipeline: stage 0 holds more parameters, stage 1 more activations
    assert main(["estimate", "--tier", "pipeline", "--world-size", "2", "--model", "charformer", "--dataset", "text",
                 "--model-size", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ranks = [r["memory"] for r in out["per_rank"]]
    assert out["memory_max_over_ranks"] == {k: max(m.get(k, 0) for m in ranks) for k in KINDS}
    assert out["memory_max_over_ranks"] != out["memory"]  # not one rank's breakdown, which "memory" stays
    assert set(out["memory"]) == set(KINDS)


@pytest.mark.slow
def test_memory_max_over_ranks_lines_up_with_result_json_by_name(no_survivors):
    cfg = RunConfig(tier="zero", world_size=2, steps=2, global_batch_size=32)  # ranks differ in optimizer_state
    predicted = json.loads(estimate(cfg).to_json())["memory_max_over_ranks"]
    measured = run(cfg, progress=False).summary()["memory_max_over_ranks"]
    assert set(predicted) == set(KINDS) and set(predicted) <= set(measured)
    assert {kind: measured[kind] for kind in predicted} == predicted


def test_cli_predicts_the_step_on_a_given_link_and_names_a_bad_one(capsys):
    assert main(["estimate", "--tier", "ddp", "--world-size", "2", "--model-size", "64", "--link", "1000:80",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_ms"] > 0 and any("1000 Mbit/s, alpha 80 us" in a for a in out["assumptions"])
    assert main(["estimate", "--link", "fast"]) == 2
    assert "--link='fast' is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("tier, extra", [
    ("ddp", {}), ("zero", {}), ("fsdp", {"model": "charformer", "dataset": "text", "model_size": 32}),
    ("ddp", {"tier_options": ddp.Options(gradient_as_bucket_view=True)}),
    ("fsdp", {"model_depth": 4, "tier_options": fsdp.Options(reshard_after_forward=False)}),
    ("pipeline", {"model_depth": 4, "tier_options": pipeline.Options(schedule="gpipe", microbatches=8)}),
    ("pipeline", {"model": "charformer", "dataset": "text", "model_size": 32,
                  "tier_options": pipeline.Options(schedule="1f1b", microbatches=4)}),
])
def test_predicted_equals_measured_kind_by_kind(tier, extra, no_survivors):
    cfg = RunConfig(tier=tier, world_size=2, steps=2, global_batch_size=32, **extra)
    table = compare(estimate(cfg), run(cfg, progress=False))
    counted = {"parameters", "gradients", "optimizer_state", "activations"}
    if tier != "pipeline":  # a pipeline's transfers land in tensors autograd saves: counted as activations
        counted.add("comm_buffers")
    assert set(table["kind"]) >= counted
    assert (table["error"] == 0).all(), table.to_string()  # every rank and kind, to the byte


def test_step_time_needs_a_link_and_says_so():
    est = estimate(RunConfig())
    assert est.step_ms is None and any("give a link" in a for a in est.assumptions)


@pytest.fixture
def fixed_loop(monkeypatch):
    """A rank's loop phases fixed: the rules are checked on set compute times, since timed ones on a loaded
    machine could reorder them."""
    from dtlab.cost.estimate import probe

    monkeypatch.setattr(probe, "loop_phases", lambda cfg, copies: {"data": 1e-4, "forward": 1e-3,
                                                                   "backward": 2e-3, "optimizer": 5e-4})


def test_step_time_grows_with_a_slower_link_and_naive_pays_the_bubble(monkeypatch, fixed_loop):
    from dtlab.cost.estimate import compute
    from dtlab.cost.links.alpha_beta import LinkModel

    stage = {"forward": 1e-3, "backward": 2e-3, "optimizer": 1e-4, "out_bytes": 4096.0}
    monkeypatch.setattr(compute, "stage_phases", lambda cfg, ranks=1: [dict(stage), dict(stage)])
    fast, slow = LinkModel.from_bandwidth(10_000, 50e-6), LinkModel.from_bandwidth(100, 50e-6)
    cfg = RunConfig(tier="ddp", world_size=2, model_size=256)
    assert estimate(cfg, slow).step_ms > estimate(cfg, fast).step_ms > 0
    def pipe(schedule):
        opts = pipeline.Options(schedule=schedule, microbatches=4)
        return estimate(RunConfig(tier="pipeline", world_size=2, model_depth=4, tier_options=opts), fast).step_ms
    assert pipe("naive") > pipe("gpipe") == pytest.approx(pipe("1f1b"))


def test_busy_s_is_paid_once_per_collective_the_training_thread_blocks_on(monkeypatch, fixed_loop):
    import dataclasses

    from dtlab.cost.estimate import compute, probe
    from dtlab.cost.links.alpha_beta import LinkModel

    monkeypatch.setattr(compute, "copy_seconds_per_byte", lambda: 1e-10)  # timed otherwise: fixed here
    collectives = [("all_gather_into_tensor", 4096, 2)] * 4 + [("reduce_scatter_tensor", 4096, 2), ("barrier", 0, 2),
                                                               ("isend", 4096, 2), ("irecv", 4096, 2)]
    monkeypatch.setattr(probe, "probe", lambda cfg: probe.Probe(0.01, {}, collectives))
    link = LinkModel.from_bandwidth(1000, 50e-6)

    def extra_ms_with(cfg, busy_s):
        return estimate(cfg, dataclasses.replace(link, busy_s=busy_s)).step_ms - estimate(cfg, link).step_ms

    def extra_ms(cfg):
        return extra_ms_with(cfg, 0.01)

    zero = RunConfig(tier="zero", world_size=2, model_size=64, model_depth=2)
    params = len(list(build_job(zero, torch.device("meta"))[0].parameters()))
    assert params > 1
    assert extra_ms(zero) == pytest.approx(10 * 2)  # DDP's one wait, then one for all of ZeRO's broadcasts
    assert extra_ms(zero.replace(tier="ddp")) == pytest.approx(10)
    assert extra_ms(zero.replace(tier="ddp", world_size=1)) == 0  # one rank waits for no one
    # six waits: five collectives and the ring's exchange (its isend; the irecv is the same hop, the barrier
    # has no price)
    assert extra_ms(zero.replace(tier="fsdp")) == pytest.approx(10 * 6)
    # 10 ms of work over those six: 1.67 ms apart, between the two spacings measured (0.5 and 5 ms), so each
    # pays busy_at's straight line between the short and the long figure
    both = dataclasses.replace(link, busy_s=0.01, busy_short_s=0.001)
    short_fsdp = estimate(zero.replace(tier="fsdp"), both).step_ms - estimate(zero.replace(tier="fsdp"), link).step_ms
    assert short_fsdp == pytest.approx(6 * (1 + 9 * (10 / 6 - 0.5) / (5 - 0.5)))
    # a fit that overprices the all-reduce leaves a negative excess (costmodel.with_busy), which takes it back
    assert extra_ms(zero.replace(tier="ddp")) == -extra_ms_with(zero.replace(tier="ddp"), -0.01)


def test_a_probed_tier_at_world_one_is_its_own_probe_with_nothing_to_pay(monkeypatch):
    """FSDP2 at world 1 still wraps and copies (its probe's step, not the single tier's loop), and its group of
    one moves nothing and waits for no one."""
    import dataclasses

    from dtlab.cost.estimate import probe
    from dtlab.cost.links.alpha_beta import LinkModel

    alone = [("all_gather_into_tensor", 4096, 1), ("reduce_scatter_tensor", 4096, 1)]
    monkeypatch.setattr(probe, "probe", lambda cfg: probe.Probe(0.0123, {}, alone))
    link = dataclasses.replace(LinkModel.from_bandwidth(1000, 50e-6), busy_s=0.01, busy_short_s=0.001)
    est = estimate(RunConfig(tier="fsdp", world_size=1, model_size=64, model_depth=2), link)
    assert est.step_ms == pytest.approx(12.3)


def test_the_pipeline_bubble_follows_the_schedule():
    from dtlab.cost.estimate.step import schedule_seconds

    assert schedule_seconds([1.0, 3.0], 4, "naive") == 16.0
    assert schedule_seconds([1.0, 3.0], 4, "gpipe") == schedule_seconds([1.0, 3.0], 4, "1f1b") == 3 * 3.0 + 4.0


def test_probe_prices_a_links_own_collectives():
    from dtlab.cost.estimate.probe import link_op

    assert [link_op(op) for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "isend",
                                   "irecv", "barrier")] == ["all_gather", "reduce_scatter", "all_reduce",
                                                            "send_recv", None, None]


@pytest.mark.slow
def test_fake_backend_probe_sees_the_tiers_own_collectives(no_survivors):
    """FSDP2 and tp run on torch's fake backend at world 2: the collectives they call per step are the ones the
    tiers' rules say (an all-gather per unit and pass, a reduce-scatter per unit; Megatron's all-reduces)."""
    from dtlab.cost.estimate.probe import probe
    from dtlab.cost.links.alpha_beta import LinkModel
    from dtlab.cost.tp import textbook_collectives

    cfg = RunConfig(tier="fsdp", world_size=2, model_size=64, model_depth=2, steps=4)
    units = len(fsdp.shard_units(build_job(cfg, torch.device("meta"))[0]))  # the mlp's root holds no parameters
    ops = [op for op, _, _ in probe(cfg).collectives]
    assert ops.count("all_gather_into_tensor") == 2 * units  # before forward, and again before backward
    assert ops.count("reduce_scatter_tensor") == units
    tp_cfg = cfg.replace(tier="tp", model_depth=3)
    seen = sorted((op, size) for op, size, group in probe(tp_cfg).collectives if group == 2)
    book = textbook_collectives(tp_cfg)
    assert seen == sorted((op, int(b)) for op, calls, b in book[["op", "calls", "bytes"]].values for _ in range(calls))
    # 50 ms per collective on the slow link: far beyond what timing noise on a loaded machine can reorder
    slow, fast = LinkModel.from_bandwidth(50, 50e-3), LinkModel.from_bandwidth(50_000, 1e-5)
    est = estimate(cfg, slow)
    assert est.step_ms > estimate(cfg, fast).step_ms > 0
    assert any("fake backend" in a for a in est.assumptions)
