"""This machine's roofline: the op counter against hand counts, the fit, the saved roofline, the prediction, the CLI."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.cost.estimate import estimate
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.roofline import cpu, measure, ops, predict, saved
from dtlab.cost.roofline.__main__ import main, parse_placements
from dtlab.cost.roofline.model import GEMM, MEMORY, op_seconds
from dtlab.plots.roofline import roofline as roofline_figure


# -- the ops of a step, counted -----------------------------------------------------------------------------------
def _flops(op_list, phase=None, recomputed=None):
    return sum(o.flops * o.count for o in op_list if (phase is None or o.name.startswith(phase + ":"))
               and (recomputed is None or o.recomputed == recomputed))


@pytest.mark.parametrize("width, batch", [(96, 32), (200, 48)])
def test_an_mlps_flops_are_the_hand_count(width, batch):
    # 64 inputs -> width -> width -> 10 classes (the synthetic 8x8 data set)
    cfg = RunConfig(model="mlp", model_size=width, model_depth=2, global_batch_size=batch, dataset="synthetic")
    counted = ops.job_ops(cfg)
    layers = [(64, width), (width, width), (width, 10)]
    forward = sum(2 * batch * i * o for i, o in layers)
    # backward: every weight's gradient (2 B i o), every input's gradient but the first layer's (no one needs it)
    backward = forward + sum(2 * batch * i * o for i, o in layers[1:])
    assert _flops(counted, "forward") == forward
    assert _flops(counted, "backward") == backward
    assert _flops(counted, "optimizer") == _flops(counted, "data") == 0
    gemms = sorted((o.shape, o.count) for o in counted if o.kind == GEMM and o.name == "forward:addmm")
    assert gemms == sorted([((batch, width, 64), 1.0), ((batch, width, width), 1.0), ((batch, 10, width), 1.0)])
    # an addmm reads its bias, both operands and writes its result, fp32
    (first,) = [o for o in counted if o.name == "forward:addmm" and o.shape == (batch, width, 64)]
    assert first.bytes == 4 * (width + batch * 64 + 64 * width + batch * width) and first.dtype == "fp32"
    # Adam's step per parameter tensor (6 of them) is memory-bound work, never a GEMM
    assert all(o.kind == MEMORY for o in counted if o.name.startswith("optimizer:"))
    assert sum(o.count for o in counted if o.name == "optimizer:addcdiv_") == 6


def test_real_tensors_count_as_fake_ones_do():
    torch.manual_seed(0)
    model, x, y = models.mlp((64,), 10, 32, 2), torch.randn(16, 64), torch.randint(0, 10, (16,))
    real = ops.count_ops(model, x, y, functools.partial(torch.optim.SGD, lr=0.1))
    fake = ops.job_ops(RunConfig(model="mlp", model_size=32, global_batch_size=16, optimizer="sgd"))
    key = sorted((o.name, o.shape, o.flops, o.bytes, o.count) for o in real)
    assert key == sorted((o.name, o.shape, o.flops, o.bytes, o.count) for o in fake if not o.name.startswith("data"))


def test_recomputation_is_hardware_flops_not_model_flops():
    cfg = RunConfig(model="charformer", dataset="text", model_size=32, model_depth=2, global_batch_size=4)
    plain, again = ops.job_ops(cfg), ops.job_ops(cfg.replace(activation_checkpointing=True))
    assert any(o.name == "forward:_scaled_dot_product_flash_attention_for_cpu" and o.flops > 0 for o in plain)
    assert _flops(again, recomputed=False) == _flops(plain)  # model FLOPs: the same job
    # hardware FLOPs add each block's forward once more (all of the forward but the head's product), less what
    # torch's checkpoint need not run again: it stops once it has every tensor backward saved
    blocks = _flops(plain, "forward") - 2 * 4 * 64 * 32 * 65  # batch 4 x 64 positions, width 32 -> 65 characters
    assert blocks / 2 < _flops(again, recomputed=True) <= blocks
    assert all(o.name.startswith("backward:") for o in again if o.recomputed)


def test_every_built_in_model_has_an_op_list():
    for kw in ({"model": "cnn", "model_size": 16}, {"model": "moe", "dataset": "text", "model_size": 32}):
        counted = ops.job_ops(RunConfig(global_batch_size=8, **kw))
        assert _flops(counted, "forward") > 0 and _flops(counted, "backward") > _flops(counted, "forward")
    with pytest.raises(ValueError, match="batch=-1"):
        ops.job_ops(RunConfig(), batch=-1)


# -- the fit -------------------------------------------------------------------------------------------------------
DIMS = (8, 64, 512)


def _efficiency(m, n, k):
    return 0.9 * (m * n * k / 512**3) ** 0.1


def synthetic_frame(threads=1, copies=1, peak=200e9, bandwidth=20e9, dispatch=1e-6, fixed=3e-5, per_op=5e-6):
    """What measure() returns, made from known constants."""
    rows = [{"kind": "dispatch", "seconds": dispatch},
            {"kind": "triad", "array_mib": cpu.BANDWIDTH_MIB, "flops": 2.0, "bytes": 12.0 * 2**20,
             "seconds": 12.0 * 2**20 / bandwidth}]
    for m, n, k in itertools.product(DIMS, repeat=3):
        rows.append({"kind": "gemm", "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "bytes": 1.0,
                     "seconds": dispatch + 2.0 * m * n * k / (peak * _efficiency(m, n, k))})
    for opt, depth in itertools.product(("sgd", "adam"), (1, 2, 4)):
        counts = {"data": 2, "forward": 2 * depth + 1, "backward": 4 * depth, "optimizer": 2 * depth * (1 + 4 * (
            opt == "adam"))}
        for phase, n in counts.items():
            rows.append({"kind": "loop", "optimizer": opt, "depth": depth, "phase": phase, "ops": n,
                         "seconds": fixed + per_op * n})
        rows.append({"kind": "loop", "optimizer": opt, "depth": depth, "phase": "total", "ops": sum(counts.values()),
                     "seconds": 4 * fixed + per_op * sum(counts.values()) + 1e-5})
    return pd.DataFrame(rows).assign(threads=threads, copies=copies).reindex(columns=list(measure.COLUMNS))


def test_the_fit_recovers_the_measured_constants():
    roof = cpu.fit(synthetic_frame(), machine={"cores": 2})
    place, scale = roof.placement(1, 1)
    assert scale == 1.0
    assert place.device.memory_bandwidth == pytest.approx(20e9)
    assert place.device.peak("fp32") == pytest.approx(200e9 * 0.9)  # the best shape measured (512^3)
    # at a measured shape: its efficiency (relative to the best); between shapes: log-linear
    assert place.curve(64, 64, 64) == pytest.approx(_efficiency(64, 64, 64) / 0.9)
    assert place.curve(64, 64, 181) == pytest.approx(_efficiency(64, 64, 181) / 0.9, rel=1e-6)
    assert place.curve(4096, 4096, 4096) == pytest.approx(1.0)  # held at the grid's edge
    # the loop: 30 us fixed and 5 us per op in every phase; the 10 us between phases go to data
    assert place.overhead.per_op_s["forward"] == pytest.approx(5e-6)
    assert place.overhead.fixed_s["backward"] == pytest.approx(3e-5)
    assert place.overhead.fixed_s["data"] == pytest.approx(3e-5 + 2 * 5e-6 + 1e-5)
    with pytest.raises(ValueError, match="every .m, n, k. of one grid"):
        cpu.fit(synthetic_frame().drop(index=5))


def test_a_saved_roofline_predicts_what_the_fitted_one_does(tmp_path):
    roof = cpu.fit(pd.concat([synthetic_frame(), synthetic_frame(threads=2, peak=400e9)]), machine=cpu.machine_info())
    again = cpu.Roofline.load(roof.save(tmp_path / "r.json"))
    assert again.matches_this_machine()
    cfg = RunConfig(model="mlp", model_size=96, global_batch_size=64, threads_per_rank=1)
    assert predict.predicted_phases(cfg, again) == predict.predicted_phases(cfg, roof)
    with pytest.raises(ValueError, match="no roofline at"):
        cpu.Roofline.load(tmp_path / "none.json")


def test_placements_measured_scaled_when_oversubscribed_or_named():
    roof = cpu.fit(pd.concat([synthetic_frame(copies=2), synthetic_frame(threads=2)]), machine={"cores": 2})
    place, scale = roof.placement(1, 4)  # 4 single-threaded ranks on 2 cores: 1 x 2's times, doubled
    assert (place.threads, place.copies, scale) == (1, 2, 2.0)
    with pytest.raises(ValueError, match="--placements 1x1"):
        roof.placement(1, 1)


def test_a_phase_is_its_ops_on_the_roofline_plus_the_overhead():
    place = cpu.fit(synthetic_frame()).placements[(1, 1)]
    counted = ops.job_ops(RunConfig(model="mlp", model_size=64, global_batch_size=32, threads_per_rank=1))
    forward = [o for o in counted if o.name.startswith("forward:")]
    want = 3e-5 + sum(o.count * (5e-6 + op_seconds(o, place.device)) for o in forward)
    assert predict.op_phase_seconds(counted, place)["forward"] == pytest.approx(want)
    roof = cpu.Roofline({(1, 1): place})
    with pytest.raises(ValueError, match="precision='bf16'"):
        predict.predicted_phases(RunConfig(precision="bf16", threads_per_rank=1), roof)


def test_the_estimator_predicts_compute_on_a_roofline_or_times_it():
    roof = cpu.fit(pd.concat([synthetic_frame(copies=2), synthetic_frame(threads=2)]), machine={"cores": 2})
    link = LinkModel.from_bandwidth(1000, 50e-6)
    single = RunConfig(model="mlp", model_size=128, global_batch_size=64, threads_per_rank=2)
    est = estimate(single, link, compute=roof)
    assert est.step_ms == pytest.approx(sum(predict.predicted_phases(single, roof).values()) * 1e3)
    assert any("compute predicted, not timed" in a for a in est.assumptions)
    ddp = single.replace(tier="ddp", world_size=2, threads_per_rank=1)
    assert estimate(ddp, link, compute=roof).step_ms > sum(predict.predicted_phases(ddp, roof).values()) * 1e3
    with pytest.raises(ValueError, match="compute='fast' is invalid"):
        estimate(single, link, compute="fast")
    with pytest.raises(ValueError, match="tier 'fsdp' needs compute='timed'"):
        estimate(single.replace(tier="fsdp"), link, compute=roof)


def test_the_saved_roofline_is_reused_and_a_quick_one_never_saved(tmp_path, monkeypatch):
    path = tmp_path / "roofline.json"
    monkeypatch.setattr(saved, "DEFAULT_PATH", path)
    monkeypatch.setattr(saved, "measure", lambda quick, log: synthetic_frame())
    first = saved.machine_roofline(quick=True)
    assert not path.exists() and first.placements
    second = saved.machine_roofline()  # measured in full (here: the synthetic frame) and saved
    assert path.exists() and second.matches_this_machine()
    monkeypatch.setattr(saved, "measure", lambda quick, log: pytest.fail("measured again"))
    assert saved.machine_roofline().to_dict() == second.to_dict()
    assert saved.machine_roofline(path).to_dict() == second.to_dict() and saved.machine_roofline(first) is first


# -- measuring, the figure and the command ---------------------------------------------------------------------------
def test_a_quick_measurement_in_this_process():
    frame = measure.measure([(1, 1)], quick=True)
    assert set(frame["kind"]) == {"dispatch", "triad", "copy", "gemm", "loop"}
    gemms = frame[frame["kind"] == "gemm"]
    assert len(gemms) == len(measure.QUICK_DIMS) ** 3 and (gemms["seconds"] > 0).all()
    big = gemms[(gemms["m"] == 1024) & (gemms["n"] == 1024) & (gemms["k"] == 1024)].iloc[0]
    assert big["flops"] / big["seconds"] > 1e9  # a 1024^3 fp32 product runs at GFLOP/s on any CPU
    roof = cpu.fit(frame)
    place = roof.placements[(1, 1)]
    assert 0 < place.curve(16, 16, 16) < place.curve(1024, 1024, 1024) <= 1
    assert place.device.memory_bandwidth > 1e9
    with pytest.raises(ValueError, match="placement"):
        measure.measure([(0, 1)])


def test_the_default_placements_fill_the_cores():
    assert measure.default_placements(2) == [(1, 1), (1, 2), (2, 1)]
    assert measure.default_placements(4) == [(1, 1), (1, 4), (2, 1), (2, 2), (4, 1)]


def test_the_figure_draws_each_placements_roofs_and_points():
    frame = pd.concat([synthetic_frame(), synthetic_frame(threads=2, peak=400e9)])
    frame["placement"] = np.where(frame["threads"] == 1, "1 thread", "2 threads")
    roofs = pd.DataFrame({"placement": ["1 thread", "2 threads"], "peak_flops": [180e9, 360e9],
                          "bandwidth": [20e9, 20e9]})
    ax = roofline_figure(frame, roofs).axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert "FLOP per byte" in ax.get_xlabel() and "GFLOP/s" in ax.get_ylabel()
    (roof,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("roofs, 2 threads")]
    x, y = roof.get_xdata(), roof.get_ydata()
    assert y == pytest.approx(np.minimum(360, 20 * x))  # GFLOP/s: min(peak, bandwidth x intensity)
    assert sum(len(c.get_offsets()) for c in ax.collections) == 2 * len(DIMS) ** 3 + 2  # GEMMs and a triad each
    with pytest.raises(ValueError, match="peak_flops"):
        roofline_figure(frame, roofs.drop(columns="peak_flops"))


def test_the_command_writes_the_table_the_roofline_and_the_figure(tmp_path, capsys):
    assert main(["--quick", "--placements", "1x1", "--out", str(tmp_path)]) == 0
    table = pd.read_csv(tmp_path / "roofline.csv")
    assert set(table["kind"]) >= {"gemm", "triad", "loop"}
    roof = cpu.Roofline.load(tmp_path / "roofline.json")
    assert list(roof.placements) == [(1, 1)] and roof.machine["quick"] is True
    assert (tmp_path / "roofline.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "1 thread × 1 copy: peak" in out and "GB/s" in out and "load average" in out
    assert parse_placements("1x1, 2x1") == [(1, 1), (2, 1)]
    for bad in ("2", "0x1", "ax2"):
        with pytest.raises(ValueError, match="--placements"):
            parse_placements(bad)
    assert math.isfinite(float(table["seconds"].sum()))


def test_copies_are_measured_at_once_in_child_processes(no_survivors):
    frame = measure.measure([(1, 2)], quick=True)
    assert set(frame["copies"]) == {2} and (frame.loc[frame["kind"] == "gemm", "seconds"] > 0).all()
