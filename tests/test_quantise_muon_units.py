"""No processes: the quantisation codes, Muon's arithmetic against reference computations, the overlap of a
synthetic timeline with a known answer, and one-line errors for the new options' bad combinations."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dtlab import RunConfig
from dtlab.app.cli import main as cli_main
from dtlab.core import models, muon
from dtlab.core.charformer import CharFormer
from dtlab.core.quantise import COMM_DTYPES, decode, encode, encoded_bytes
from dtlab.read import overlap as ov
from dtlab.tiers import ddp, fsdp, fsdp_tp, tp
from dtlab.tiers.parts.fsdp_muon import rows_on


# -- the codes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", COMM_DTYPES)
@pytest.mark.parametrize("numel", [1, 127, 128, 1000])
def test_a_code_round_trips_within_its_precision_in_the_bytes_it_promises(dtype, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-3, 2, numel)  # magnitudes spread over five decades
    buf = encode(x, dtype, block=64)
    assert buf.dtype == torch.uint8 and buf.numel() == encoded_bytes(numel, dtype, 64)
    y = decode(buf, numel, dtype, 64)
    blocks = torch.nn.functional.pad(x, (0, -numel % 64)).view(-1, 64).abs().amax(1).repeat_interleave(64)[:numel]
    err = (y - x).abs()
    if dtype == "fp32":
        assert torch.equal(y, x)
    elif dtype == "bf16":
        assert (err <= x.abs() * 2 ** -8).all()
    elif dtype == "int8":  # half a step of its block's scale
        assert (err <= blocks / 127 / 2 * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits (half an ulp: 2^-4 of the value), or the subnormal step near zero
        assert (err <= torch.maximum(x.abs() * 2 ** -4, blocks / 448 * 2 ** -10) * (1 + 1e-6)).all()
    assert not torch.equal(y, x) or dtype == "fp32" or numel == 1


def test_codes_are_a_quarter_or_half_of_fp32_plus_one_scale_per_block():
    assert encoded_bytes(1000, "fp32") == 4000 and encoded_bytes(1000, "bf16") == 2000
    assert encoded_bytes(1000, "int8", 128) == encoded_bytes(1000, "fp8", 128) == 8 * 128 + 8 * 4
    zeros = decode(encode(torch.zeros(10), "int8", 8), 10, "int8", 8)  # an all-zero block: no division by 0
    assert torch.equal(zeros, torch.zeros(10))
    x64 = torch.randn(100, dtype=torch.float64)
    assert decode(encode(x64, "int8", 16), 100, "int8", 16, torch.float64).dtype == torch.float64


# -- Muon ---------------------------------------------------------------------------------------------------
def _reference_orthogonalisation(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The same quintic applied to each singular value of g / ||g||, through an SVD (float64)."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    a, b, c = muon.NS_COEFFICIENTS
    s = s / (g.norm() + 1e-7)
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape", [(8, 8), (16, 5), (5, 16)])
def test_newton_schulz_is_the_quintic_on_the_singular_values(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape, dtype=torch.float64)
    out = muon.newton_schulz(g)
    assert torch.allclose(out, _reference_orthogonalisation(g), atol=1e-12)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.25  # about U Vᵀ: every direction the same size
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.allclose(out, u @ vh, atol=0.35)


def test_muon_steps_matrices_by_hand_and_the_rest_as_torch_adamw():
    torch.manual_seed(1)
    w, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    p_w, p_b, q_b = (torch.nn.Parameter(t.clone()) for t in (w, b, b))
    opt = muon.Muon([{"params": [p_w], "use_muon": True}, {"params": [p_b], "use_muon": False}], lr=0.02,
                    weight_decay=0.1)
    adamw = torch.optim.AdamW([q_b], lr=0.02, weight_decay=0.1, foreach=False)
    buf, ref = torch.zeros_like(w), w.clone()
    for _ in range(3):
        g_w, g_b = torch.randn_like(w), torch.randn_like(b)
        p_w.grad, p_b.grad, q_b.grad = g_w.clone(), g_b.clone(), g_b.clone()
        opt.step()
        adamw.step()
        buf = 0.95 * buf + g_w  # Nesterov momentum, orthogonalised, scaled to AdamW's size, decoupled decay
        ref = ref * (1 - 0.02 * 0.1) - 0.02 * 0.2 * 6 ** 0.5 * _reference_orthogonalisation(g_w + 0.95 * buf)
    assert torch.allclose(p_w, ref, atol=1e-12)
    assert torch.equal(p_b, q_b)
    assert set(opt.state[p_w]) == {"momentum_buffer"} and set(opt.state[p_b]) == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_takes_the_hidden_matrices_and_leaves_embeddings_input_layer_head_and_vectors_to_adamw():
    mlp = models.mlp((64,), 10, width=32, depth=3)  # Flatten, then Linear 64-32, 32-32, 32-32, 32-10
    linears = [m for m in mlp if isinstance(m, torch.nn.Linear)]
    assert [id(p) for p in muon.hidden_matrices(mlp)] == [id(linears[1].weight), id(linears[2].weight)]
    groups = muon.param_groups(mlp)
    assert [g["use_muon"] for g in groups] == [True, False]
    rest = [id(p) for p in groups[1]["params"]]
    assert rest == [id(p) for m in linears for p in m.parameters() if p.ndim == 1 or m in (linears[0], linears[-1])]
    former = CharFormer(vocab=20, seq_len=8, width=16, layers=1, heads=2)
    hidden = {id(p) for p in muon.hidden_matrices(former)}
    names = {n for n, p in former.named_parameters() if id(p) in hidden}
    assert names == {n for n, p in former.named_parameters() if p.ndim == 2} - {"tok.weight", "pos.weight",
                                                                                 "head.weight"}
    assert names and all(n.startswith("blocks.") for n in names)
    assert muon.param_groups(models.mlp((64,), 10, width=32, depth=1))[0]["use_muon"] is False  # no hidden layer


def test_muon_refuses_groups_that_do_not_say_which_optimizer_steps_them():
    w, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="use_muon"):
        muon.Muon([w, b], lr=0.01)
    with pytest.raises(ValueError, match="not 2-D"):
        muon.Muon([{"params": [w, b], "use_muon": True}], lr=0.01)


def test_the_head_steps_as_torch_adamw_under_muon():
    torch.manual_seed(2)
    mlp = models.mlp((6,), 4, width=5, depth=2).double()
    head = [m for m in mlp if isinstance(m, torch.nn.Linear)][-1]
    ref = torch.nn.Parameter(head.weight.detach().clone())
    opt = muon.Muon(muon.param_groups(mlp), lr=0.02)
    adamw = torch.optim.AdamW([ref], lr=0.02, weight_decay=0.0, foreach=False)
    for _ in range(3):
        mlp(torch.randn(8, 6, dtype=torch.float64)).square().mean().backward()
        ref.grad = head.weight.grad.clone()
        opt.step()
        adamw.step()
        opt.zero_grad()
    assert torch.equal(head.weight, ref)


def test_owners_take_whole_matrices_largest_first_and_rows_follow_torch_chunk():
    assert muon.assign_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40, 30, then 20 and 10 to the lighter
    assert muon.assign_owners([5], 4) == [0]
    for rows in (1, 3, 7, 10, 64):
        for world in (2, 3, 4):
            assert [rows_on(rows, world, r) for r in range(world)] == [
                len(c) for c in torch.arange(rows).chunk(world)] + [0] * (world - len(torch.arange(rows).chunk(world)))


# -- overlap on a synthetic timeline -------------------------------------------------------------------------
def _timeline(events: list[tuple], phases: list[tuple]) -> tuple[pd.DataFrame, pd.DataFrame]:
    ev = pd.DataFrame(events, columns=["rank", "step", "start", "end", "async", "wait_s", "tag"])
    ph = pd.DataFrame(phases, columns=["rank", "step", "phase", "start", "end"])
    return ev, ph


def test_overlap_of_a_known_timeline():
    # forward 0-10, backward 10-30 (compute), one async transfer 5-15 waited on for its last 2 s (13-15),
    # one synchronous call 20-24 (blocks 4 s of backward): comm 14 s, under compute 5-13 = 8 s
    ev, ph = _timeline([(0, 1, 5.0, 15.0, True, 2.0, "tp_ring:forward:3"), (0, 1, 20.0, 24.0, False, 0.0, "")],
                       [(0, 1, "forward", 0.0, 10.0), (0, 1, "backward", 10.0, 30.0), (0, 1, "data", 30.0, 40.0)])
    got = ov.overlap(ev, ph)
    assert got["comm_s"] == pytest.approx(14.0) and got["overlapped_s"] == pytest.approx(8.0)
    assert got["overlap_pct"] == pytest.approx(100 * 8 / 14)


def test_ddp_buckets_overlap_backward_until_the_last_bucket_is_launched():
    # backward 0-10, optimizer 10-12; buckets launched at 2 and 6, complete at 7 and (seen late) 11: the last one
    # ends with backward at 10, and compute ends at 6 (the last launch): 4 of 8 s overlap
    ev, ph = _timeline([(0, 1, 2.0, 7.0, True, 0.0, "ddp_bucket:0"), (0, 1, 6.0, 11.0, True, 0.0, "ddp_bucket:1")],
                       [(0, 1, "backward", 0.0, 10.0), (0, 1, "optimizer", 10.0, 12.0)])
    assert ov.overlap(ev, ph)["overlap_pct"] == pytest.approx(100 * 4 / 8)
    assert ov.union([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert ov.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


# -- bad combinations, one line each, before any process starts ----------------------------------------------
@pytest.mark.parametrize(("changes", "match"), [
    (dict(tier="tp", world_size=2, optimizer="muon"), r"RunConfig.optimizer='muon' is invalid: the tp tier steps "
     r"sgd and adam only; muon runs on .*ddp.*zero.*fsdp"),
    (dict(tier="ddp", tier_options=ddp.Options(comm_dtype="int4")), r"ddp tier_options.comm_dtype='int4'"),
    (dict(tier="ddp", tier_options=ddp.Options(comm_dtype="int8", comm_hook="fp16")),
     r"comm_dtype='int8' is invalid with comm_hook='fp16'"),
    (dict(tier="ddp", tier_options=ddp.Options(comm_block=6)), r"comm_block=6 is invalid"),
    (dict(tier="fsdp", tier_options=fsdp.Options(reduce_comm_dtype="fp4")), r"fsdp tier_options.reduce_comm_dtype"),
    (dict(tier="fsdp", world_size=4, optimizer="muon", tier_options=fsdp.Options(replicate=2)),
     r"replicate=2 is invalid with RunConfig.optimizer='muon'"),
    (dict(tier="ddp", optimizer="muon", tier_options=ddp.Options(checkpoint_dir="/tmp/x")),
     r"checkpoint_dir/resume_from are invalid with RunConfig.optimizer='muon'"),
    (dict(tier="fsdp-tp", world_size=4, model="charformer", dataset="text",
          tier_options=fsdp_tp.Options(decomposed_mlp=True)), r"decomposed_mlp=True is invalid: the fsdp-tp tier"),
    (dict(tier="tp", world_size=2, model="charformer", dataset="text",
          tier_options=tp.Options(decomposed_mlp=True, sequence_parallel=True)),
     r"decomposed_mlp=True is invalid with sequence_parallel=True"),
    (dict(tier="tp", world_size=2, tier_options=tp.Options(ring_overlap=False)),
     r"ring_overlap=False is invalid without decomposed_mlp=True"),
])
def test_a_bad_combination_is_one_line_naming_the_field(changes, match):
    with pytest.raises(ValueError, match=match) as caught:
        RunConfig(**changes)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("argv", "start"), [
    (["--tier", "zero", "--world-size", "2", "--opt", "comm_dtype=int8"],
     "error: --opt comm_dtype=int8: tier 'zero' has no option 'comm_dtype'"),
    (["--tier", "tp", "--world-size", "2", "--optimizer", "muon"], "error: --optimizer: RunConfig.optimizer='muon'"),
    (["--tier", "ddp", "--world-size", "2", "--opt", "comm_dtype=fp4"], "error: --opt comm_dtype"),
])
def test_the_cli_refuses_in_one_line(argv, start, capsys):
    assert cli_main(["run", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1, err


def test_bytes_vs_drift_draws_a_point_per_variant(tmp_path):
    from dtlab import plots
    from tests.test_plots import assert_png

    table = pd.DataFrame({"variant": ["fsdp ag=fp32 rs=fp32", "fsdp ag=int8 rs=int8", "ddp fp32"],
                          "tier": ["fsdp", "fsdp", "ddp"], "sent_per_step": [4e5, 1e5, 2e5],
                          "drift_last": [0.0, 3e-3, 0.0]})
    fig = plots.bytes_vs_drift(table)
    points = [tuple(p) for c in fig.axes[0].collections for p in c.get_offsets()]
    assert sorted(points) == sorted([(400.0, 0.0), (100.0, 3e-3), (200.0, 0.0)])
    assert_png(fig, tmp_path / "q.png")
    with pytest.raises(ValueError, match="drift_last"):
        plots.bytes_vs_drift(table.drop(columns="drift_last"))


def test_the_quantised_variants_always_hold_their_fp32_reference():
    from dtlab.experiments import quantised

    labels = list(quantised.variants(quantised.base_job(10), [("int8", "int8")], ["fp8"]))
    assert labels == ["fsdp ag=fp32 rs=fp32", "fsdp ag=int8 rs=int8", "ddp fp32", "ddp fp8"]
