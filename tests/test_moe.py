"""The moe model and the expert-parallel tier's pieces that run without processes."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dtlab import RunConfig
from dtlab.app.cli import main
from dtlab.core import models
from dtlab.core.job import build_job
from dtlab.core.memory import SavedActivations
from dtlab.core.moe import MoE, Routing, balance_loss
from dtlab.core.results import RankResult, RunResult
from dtlab.cost.estimate import estimate
from dtlab.cost.estimate.activations import activation_bytes, shapes
from dtlab.plots import experts as figs
from dtlab.read import ep as ex
from dtlab.tiers.ep import Options as EpOptions

MOE = dict(model="moe", dataset="text", model_size=32, global_batch_size=8)


def layer(**routing) -> MoE:
    torch.manual_seed(0)
    return MoE(16, Routing(**routing))


def by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token's k experts, one token at a time, weighted by their router probabilities."""
    probs = torch.softmax(moe.router(x), -1)
    weights, chosen = probs.topk(moe.routing.top_k, -1)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for w, e in zip(weights[b, t], chosen[b, t]):
                out[b, t] += w * moe.experts[str(int(e))](x[b, t])
    return out


def test_dropless_routing_sends_every_token_to_its_k_experts():
    moe = layer(experts=4, top_k=2)
    x = torch.randn(3, 5, 16)
    y = moe(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, by_hand(moe, x), atol=1e-6, rtol=1e-5)
    stats = moe.pop_step_stats()
    assert sum(stats[f"tokens_e{e}"] for e in range(4)) == 3 * 5 * 2 and stats["dropped_tokens"] == 0
    assert moe.pop_step_stats()["tokens_e0"] == 0  # popped: the next step starts from zero


def test_capacity_drops_overflow_and_counts_it():
    moe = layer(experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 8, 16)
    moe(x)
    stats = moe.pop_step_stats()
    capacity = 0.5 * 2 * 8 * 2 / 4  # 4 assignments per expert
    kept = [stats[f"tokens_e{e}"] for e in range(4)]
    assert max(kept) <= capacity and stats["dropped_tokens"] == 32 - sum(kept) > 0
    # first choices before second ones: 4 tokens pick (0, 1), (0, 2), (1, 0), (2, 0); 2 places per expert
    order, counts = layer(experts=4, top_k=2, capacity_factor=1.0).assign(torch.tensor([0, 0, 1, 2, 1, 2, 0, 0]))
    assert counts == [2, 2, 2, 0] and order.tolist() == [0, 1, 2, 4, 3, 5]  # expert 0's second choices dropped


def test_balance_loss_on_hand_made_routers():
    uniform = torch.full((1, 4, 2), 0.5)
    assert balance_loss(uniform, torch.tensor([[[0], [1], [0], [1]]])).item() == pytest.approx(1.0)
    probs = torch.tensor([[[0.9, 0.1], [0.6, 0.4]]])  # both tokens pick expert 0: f = (1, 0), P = (0.75, 0.25)
    assert balance_loss(probs, probs.topk(1, -1).indices).item() == pytest.approx(2 * 0.75)
    # a mean over sequences: any split of the batch averages to the whole batch's loss
    probs = torch.softmax(torch.randn(4, 6, 3), -1)
    chosen = probs.topk(2, -1).indices
    halves = [balance_loss(probs[i:i + 2], chosen[i:i + 2]) for i in (0, 2)]
    torch.testing.assert_close(balance_loss(probs, chosen), sum(halves) / 2)


def test_training_loss_adds_the_scaled_balance_loss_once():
    cfg = RunConfig(**MOE, aux_loss_coef=0.5)
    model, data = build_job(cfg, torch.device("cpu"))
    x, y = data.train_x[:8], data.train_y[:8]
    logits = model(x)
    total = models.training_loss(model, logits, y)
    stats = models.step_stats(model)
    assert total.item() == pytest.approx(models.loss(logits, y).item() + 0.5 * stats["balance_loss"], rel=1e-6)
    assert models.training_loss(model, logits, y).item() == pytest.approx(models.loss(logits, y).item())  # popped
    plain = build_job(RunConfig(model="charformer", dataset="text", model_size=32), torch.device("cpu"))[0]
    assert models.step_stats(plain) == {}


def test_checkpointed_blocks_give_the_same_gradients_and_count_tokens_once():
    grads, counts = [], []
    for ckpt in (False, True):
        cfg = RunConfig(**MOE, activation_checkpointing=ckpt)
        model, data = build_job(cfg, torch.device("cpu"))
        models.training_loss(model, model(data.train_x[:8]), data.train_y[:8]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        counts.append(models.step_stats(model)["tokens_e0"])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)
    assert counts[0] == counts[1]


def test_the_estimate_counts_what_a_moe_forward_saves():
    cfg = RunConfig(**MOE)
    model, data = build_job(cfg, torch.device("cpu"))
    with SavedActivations() as acts:
        models.training_loss(model, model(data.train_x[:8].clone()), data.train_y[:8].clone())
    assert activation_bytes(cfg, shapes(cfg), 8) == acts.bytes(exclude=model.parameters())


def test_ep_estimate_holds_the_replicated_part_and_a_share_of_the_experts():
    cfg = RunConfig(**MOE, tier="ep", world_size=2)
    model = build_job(cfg, torch.device("cpu"))[0]
    expert = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    whole = sum(p.numel() * 4 for p in model.parameters())
    ranks = estimate(cfg).per_rank
    assert [r.memory["parameters"] for r in ranks] == [whole - expert // 2] * 2
    single = estimate(cfg.replace(tier="single", world_size=1)).memory["activations"]
    assert sum(r.memory["activations"] for r in ranks) >= single  # the whole batch's tokens, on some rank


@pytest.mark.parametrize("changes, flag", [
    (dict(top_k=5), "top_k"), (dict(experts=0), "experts"), (dict(top_k=0), "top_k"),
    (dict(capacity_factor=-1.0), "capacity_factor"), (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
    (dict(dataset="digits"), "model"), (dict(tier="dp", world_size=2), "model"),
    (dict(tier="cp", world_size=2), "model"), (dict(tier="ep", world_size=3, global_batch_size=9), "experts"),
    (dict(tier="ep", world_size=2, tier_options=EpOptions(hot_expert=4)), "hot_expert"),
])
def test_bad_combinations_are_one_line_errors(changes, flag):
    with pytest.raises(ValueError, match=flag) as info:
        RunConfig(**{**MOE, **changes})
    assert "\n" not in str(info.value)


def test_ep_needs_the_moe_model_and_the_cli_names_the_flag(capsys):
    with pytest.raises(ValueError, match="use model='moe'"):
        RunConfig(tier="ep", world_size=2)
    assert main(["run", "--model", "moe", "--dataset", "text", "--top-k", "7", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --top-k:") and err.count("\n") == 1


def _result(tokens: list[list[float]]) -> RunResult:
    steps = [{"step": s, "loss": 1.0, **{f"tokens_e{e}": n for e, n in enumerate(row)}} for s, row in enumerate(tokens)]
    return RunResult(RunConfig(**MOE), [RankResult(0, steps, {}, [], [], 0.0)], 0.0)


def test_expert_load_and_imbalance_from_the_steps():
    result = _result([[10, 10, 10, 10], [40, 0, 0, 0]])
    assert ex.expert_load(result).loc[1].tolist() == [40, 0, 0, 0]
    assert ex.imbalance(result).tolist() == [1.0, 4.0]
    assert ex.dispatch_bytes(RunConfig(**MOE)) == 8 * 32 * 2 * 32 * 4


def test_expert_figures_draw():
    load = pd.DataFrame([[10, 20], [15, 15]], columns=[0, 1])
    assert figs.expert_load({"a": load, "b": load}).axes
    assert figs.router_heatmap(pd.DataFrame([[0.2, 0.8], [1.0, 0.0]], index=["a", " "])).axes
    steps = pd.DataFrame({"step": [0, 0, 1, 1], "kind": ["dispatch", "counts"] * 2, "bytes": [100, 8] * 2,
                          "sent_bytes": [50, 4] * 2})
    assert figs.all_to_all_bytes(steps, formula=100).axes
    assert figs.rank_load(pd.DataFrame({"rank": [0, 1], "tokens": [5, 3], "all_to_all_s": [0.1, 0.2]})).axes
    with pytest.raises(ValueError, match="missing column"):
        figs.all_to_all_bytes(steps.drop(columns="kind"), formula=1)


def test_the_planner_knows_mixtral_and_shares_its_experts_out():
    from dtlab.cost import planner as P
    from dtlab.cost.planner.search import Layout, check_layout, memory

    m = P.MIXTRAL_8X7B
    assert m.parameters() == 46_702_792_704  # Mixtral's 46.7B
    assert (m.active_matmul_parameters() + m.vocab * m.hidden) / 1e9 == pytest.approx(12.9, abs=0.05)  # 12.9B active
    states = [memory(m, Layout(8, 1, 1, 0, "selective", 1, "bf16", ep), 64)["parameters"] for ep in (1, 2, 8)]
    expert = m.layers * m.expert_parameters() * 2  # bf16
    assert states[0] - states[2] == pytest.approx(expert * 7 / 8) and states[0] > states[1] > states[2]
    plan = P.search(m, P.H100_SXM, gpus=16, global_batch=64)
    assert set(plan.table["ep"]) == {1, 2, 4, 8} and (plan.table.loc[plan.table["ep"] > 1, "ep_comm_s"] > 0).all()
    assert set(P.search(P.LLAMA2_7B, P.H100_SXM, gpus=8, global_batch=64).table["ep"]) == {1}
    with pytest.raises(ValueError, match="ep=3 is invalid"):
        check_layout(m, P.H100_SXM, Layout(6, 1, 1, 0, "none", 1, "bf16", 3), 60)
    row = plan.table[plan.table["ep"] == 2].iloc[0]
    cfg = P.scaled_down(row)
    assert (cfg.tier, cfg.model, cfg.world_size) == ("ep", "moe", 2)
