"""Context parallelism's two methods (ring, Ulysses) and two balances (contiguous, zig-zag): each trains the single
device's charformer at world 2 and 4; the recorder sees Ulysses' all-to-alls; each rank's attention work and each
method's bytes per step equal their formulas. The heads knob (``RunConfig.model_heads``) leaves today's model as it
was, takes tp to 4 ranks, and bad combinations fail in one line before any process starts.

Measured here (one CPU model, x86_64), 20 Adam steps at lr 0.003: ring 2.3e-6 and 4.5e-6 (world 2, 4), ring zig-zag
2.9e-6, 2.6e-6, Ulysses 2.9e-6, 3.8e-6, Ulysses zig-zag 1.5e-6, 3.9e-6; tp at world 4 with 4 heads 1.6e-6.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from dtlab import RunConfig
from dtlab.app.cli import main as cli_main
from dtlab.core import models
from dtlab.core.data import SEQ_LEN
from dtlab.core.job import build_job
from dtlab.core.results import RunResult
from dtlab.cost.cp import attention_bytes
from dtlab.experiments.cp_work import work_table
from dtlab.read.cp import bytes_table, recorded_bytes
from dtlab.tiers import cp
from dtlab.train import run
from tests.parity import TOL, job

# Adam at lr 0.003 as the charformer's other parity tests (tests/parity.py says why); 4 heads, so Ulysses runs at 4
HEADS = 4
TEXT = dict(model="charformer", dataset="text", model_heads=HEADS, lr=0.003)
CASES = list(itertools.product((2, 4), cp.METHODS, cp.BALANCES))


@functools.cache
def reference() -> RunResult:
    return run(job("adam", **TEXT), progress=False)


@functools.cache
def cp_run(n: int, method: str, balance: str) -> RunResult:
    return run(job("adam", tier="cp", world_size=n, tier_options=cp.Options(method, balance), **TEXT), progress=False)


@pytest.mark.parametrize(("n", "method", "balance"), CASES, ids=[f"{m}-{b}-w{n}" for n, m, b in CASES])
def test_every_method_and_balance_trains_the_single_device_model(n, method, balance, no_survivors):
    ref, result = reference(), cp_run(n, method, balance)
    assert result.max_param_diff(ref) <= TOL
    assert len({r.params_checksum for r in result.ranks}) == 1
    ref_loss = [s["loss"] for s in ref.ranks[0].steps]
    assert [s["loss"] for s in result.ranks[0].steps] == pytest.approx(ref_loss, abs=TOL)
    facts = result.ranks[n - 1].strategy
    assert (facts["method"], facts["balance"]) == (method, balance)
    assert facts["chunks"] == ([n - 1] if balance == "contiguous" else [n - 1, n])  # the last rank's chunks
    # what the rank held for backward is its share of the sequence, whichever way it was cut
    assert facts["sequence_chunk"] == SEQ_LEN // n


@pytest.mark.parametrize("n", [2, 4])
def test_the_recorder_sees_ulysses_all_to_alls_and_no_ring(n, no_survivors):
    result = cp_run(n, "ulysses", "zigzag")
    cfg = result.config
    ev = result.events_frame()
    ev = ev[(ev["step"] >= 0) & (ev["step"] < cfg.steps)]
    assert not ev["op"].isin(["isend", "irecv"]).any()
    x = cfg.global_batch_size * (SEQ_LEN // n) * cfg.model_size * 4  # one rank's positions of q, k, v or output
    for r in range(n):
        a2a = ev[(ev["rank"] == r) & (ev["op"] == "all_to_all_single")]
        # per block and step: q, k, v out and the output back (forward); the output's gradient and dq, dk, dv
        for tag in (cp.FORWARD_TAG, cp.BACKWARD_TAG):
            mine = a2a[a2a["tag"] == tag]
            assert set(mine.groupby("step").size()) == {2 * cfg.model_depth}
            assert sorted(mine[mine["step"] == 0]["bytes"]) == sorted([x, 3 * x] * cfg.model_depth)
        assert {tuple(s) for s in a2a["input_splits"]} == {(1,) * n}  # an even split: h / n heads each
    assert result.ranks[0].strategy["heads_per_rank"] == HEADS // n


def test_bytes_per_step_of_ring_and_ulysses_equal_their_formulas(no_survivors):
    results = [cp_run(n, m, "contiguous") for n in (2, 4) for m in cp.METHODS]
    table = bytes_table(results)
    assert (table["counted"] == table["counted_formula"]).all(), table
    assert (table["sent"] == table["sent_formula"]).all(), table
    counted = table.set_index(["method", "degree"])["counted"]
    # equal at 2 ranks; from 4 the ring's grows, Ulysses' shrinks
    assert counted["ring", 2] == counted["ulysses", 2]
    assert counted["ring", 4] > counted["ring", 2] and counted["ulysses", 4] == counted["ulysses", 2] / 2
    # zig-zag moves the same bytes as contiguous chunks: only which positions travel changes
    for m in cp.METHODS:
        assert recorded_bytes(cp_run(4, m, "zigzag")).equals(recorded_bytes(cp_run(4, m, "contiguous")))


def test_each_ranks_attention_work_is_the_formulas():
    table = work_table(4, batch=8, heads=HEADS, width=32)
    assert (table["flops"] == table["formula"]).all(), table
    flops = table.pivot(index="rank", columns="balance", values="flops")
    assert list(flops["contiguous"]) == [flops["contiguous"][0] * (r + 1) for r in range(4)]  # rank 3 does 4x rank 0
    assert flops["zigzag"].nunique() == 1  # every rank the same
    assert flops["zigzag"].max() < flops["contiguous"].max() and flops["zigzag"].sum() < flops["contiguous"].sum()
    assert attention_bytes("ring", 1, 8, 32, 2) == {"counted": 0, "sent": 0}


def test_the_default_heads_build_todays_model_bitwise():
    cfg = RunConfig(model="charformer", dataset="text")
    assert cfg.model_heads == 2
    model, data = build_job(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.seed)
    before = models.CharFormer(data.num_classes, SEQ_LEN, cfg.model_size, cfg.model_depth)  # heads as it was
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    x = data.train_x[:4]
    assert torch.equal(model(x), before(x))
    four, _ = build_job(cfg.replace(model_heads=4), torch.device("cpu"))
    assert [b.attn.heads for b in four.blocks] == [4, 4]
    assert all(torch.equal(a, b) for a, b in zip(four.state_dict().values(), before.state_dict().values()))
    assert not torch.equal(four(x), before(x))  # the same weights, attended with 4 heads of 16


def test_four_heads_let_tp_split_the_charformer_over_four_ranks(no_survivors):
    """Whole heads per rank: 2 heads stop tp at 2 ranks (refused below), 4 heads take it to 4."""
    result = run(job("adam", tier="tp", world_size=4, **TEXT), progress=False)
    assert result.max_param_diff(reference()) <= TOL


TEXT_JOB = dict(model="charformer", dataset="text")


@pytest.mark.parametrize(("changes", "match"), [
    (dict(model_heads=3), r"^RunConfig.model_heads=3 is invalid: the charformer's width model_size=64 must split"),
    (dict(model_heads=0), r"^RunConfig.model_heads=0 is invalid: must be an integer >= 1"),
    (dict(tier="tp", world_size=4), r"^RunConfig.model_heads=2 is invalid for the tp tier: it splits whole "
                                    r"attention heads"),
    (dict(tier="cp", world_size=4, tier_options=cp.Options(method="ulysses")),
     r"^RunConfig.model_heads=2 is invalid for tier 'cp' with method='ulysses': fewer heads than the 4 ranks"),
    (dict(tier="cp", world_size=4, model_heads=2 * 3, model_size=48, tier_options=cp.Options(method="ulysses")),
     r"^RunConfig.model_heads=6 is invalid for tier 'cp' with method='ulysses': 6 heads do not divide over 4"),
    (dict(tier="cp", world_size=32, tier_options=cp.Options(balance="zigzag")),
     r"^cp tier_options.balance='zigzag' is invalid at world_size=32: .* 2 x world_size = 64 equal chunks"),
    (dict(tier="cp", world_size=2, tier_options=cp.Options(method="tree")),
     r"^cp tier_options.method='tree' is invalid: choose one of ring, ulysses"),
    (dict(tier="cp", world_size=2, tier_options=cp.Options(balance="striped")),
     r"^cp tier_options.balance='striped' is invalid: choose one of contiguous, zigzag"),
])
def test_a_bad_combination_is_one_line_naming_the_field(changes, match):
    with pytest.raises(ValueError, match=match) as caught:
        RunConfig(**{**TEXT_JOB, **changes})
    assert "\n" not in str(caught.value)


def test_the_cli_takes_heads_and_cp_options_and_names_the_flag(capsys):
    assert cli_main(["run", "--tier", "cp", "--world-size", "4", "--model", "charformer", "--dataset", "text",
                     "--opt", "method=ulysses", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --heads: RunConfig.model_heads=2 is invalid for tier 'cp'") and err.count("\n") == 1
    assert cli_main(["run", "--heads", "5", "--model", "charformer", "--dataset", "text", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: --heads: RunConfig.model_heads=5 is invalid")
    cfg = RunConfig(**TEXT_JOB, model_heads=4, tier="cp", world_size=2, tier_options=cp.Options("ulysses", "zigzag"))
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
