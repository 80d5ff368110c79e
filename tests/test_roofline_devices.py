"""The GPU devices the planner times a step on: datasheet peaks, the GEMM curve's tile and wave quantisation,
and the roofline's attention kind (executed FLOPs timed, counted FLOPs kept)."""

from __future__ import annotations

import pytest

from dtlab.cost.roofline import ATTENTION, GEMM, MEMORY, Device, Op, compute_time, devices, gemm, op_seconds


def test_peaks_and_bandwidths_are_the_datasheets():
    assert devices.A100_80GB.peak("bf16") == 312e12 and devices.A100_80GB.peak("fp32") == 19.5e12
    assert devices.H100_SXM.peak("bf16") == pytest.approx(989.4e12) and devices.H100_SXM.peak("fp8") == 2 * 989.45e12
    assert devices.H200_SXM.peak_flops == devices.H100_SXM.peak_flops  # the same die
    assert devices.H200_SXM.memory_bandwidth > devices.H100_SXM.memory_bandwidth > devices.A100_80GB.memory_bandwidth
    with pytest.raises(ValueError, match="no peak for dtype 'fp8'"):
        devices.A100_80GB.peak("fp8")
    with pytest.raises(ValueError, match="unknown GPU 'V100'"):
        devices.get("V100")
    for device in devices.DEVICES.values():
        assert any("datasheet" in s for s in device.sources) and any("MAMF" in s for s in device.sources)


def test_a_large_gemm_reaches_the_sustained_mamf_and_a_small_one_far_less():
    a100 = devices.A100_80GB
    ceiling = 267.9 / 312 * devices.SUSTAINED["A100"]
    big = a100.gemm_efficiency(8192, 8192, 8192, "bf16")
    assert 0.95 * ceiling < big <= ceiling
    assert a100.gemm_efficiency(512, 512, 512, "bf16") < big / 3  # the kernel's fixed cost and few tiles
    sizes = [a100.gemm_efficiency(n, n, n, "bf16") for n in (256, 1024, 4096)]
    assert sizes == sorted(sizes)


def test_tile_and_wave_quantisation():
    sms = 108
    assert devices.tiled_efficiency(4096, 4096, 4096, sms) == pytest.approx(1.0, abs=0.06)
    # one row more than the smallest tile: the second row of tiles does 1/64 of its work
    assert devices.tiled_efficiency(65, 128 * 108, 4096, sms) < 0.55
    # 108 tiles fill one wave of 108 SMs; 109 leave the last wave part-empty whatever the tile
    full = devices.tiled_efficiency(128 * 108, 256, 4096, sms)
    assert full == pytest.approx(1.0)
    assert devices.tiled_efficiency(128 * 108 + 128, 256, 4096, sms) < 0.85 * full
    assert devices.tiled_efficiency(4096, 4096, 4096 + 1, sms) < devices.tiled_efficiency(4096, 4096, 4096, sms)
    with pytest.raises(ValueError, match="every dimension"):
        devices.tiled_efficiency(0, 4, 4, sms)


def test_attention_ops_time_their_executed_flops_on_the_attention_curve():
    device = Device("toy", {"bf16": 1e12}, 1e12, lambda m, n, k, t: 0.5, attention_efficiency=lambda s, k, d, t: 0.25)
    full = Op("attention", ATTENTION, 1e12, 1.0, shape=(1024, 1024, 128))
    causal = Op("attention", ATTENTION, 1e12, 1.0, shape=(1024, 1024, 128), executed=0.5)
    assert op_seconds(full, device) == pytest.approx(4.0) and op_seconds(causal, device) == pytest.approx(2.0)
    timed = compute_time([causal, gemm("mm", 1000, 1000, 1000), Op("norm", MEMORY, 0.0, 1e12)], device)
    assert timed.model_flops == timed.hardware_flops == pytest.approx(1e12 + 2e9)  # counted, not executed
    assert timed.seconds == pytest.approx(2.0 + 2e9 / 0.5e12 + 1.0)
    assert op_seconds(full, Device("no curve", {"bf16": 1e12}, 1e12, lambda m, n, k, t: 0.5)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs its shape"):
        Op("attention", ATTENTION, 1.0, 1.0)
    with pytest.raises(ValueError, match="kind='conv' is invalid"):
        Op("x", "conv", 1.0, 1.0)
    assert GEMM in (gemm("mm", 2, 2, 2).kind,)


def test_each_die_reads_its_own_fitted_constant_when_called(monkeypatch):
    """A fit moves one die's constant; the other die's GPUs do not move, and the H200 follows the H100."""
    shape = (8192, 8192, 8192, "bf16")
    before = {name: device.gemm_efficiency(*shape) for name, device in devices.DEVICES.items()}
    monkeypatch.setitem(devices.SUSTAINED, "H100", devices.SUSTAINED["H100"] / 2)
    assert devices.A100_80GB.gemm_efficiency(*shape) == before["A100_80GB"]
    for name in ("H100_SXM", "H200_SXM"):
        assert devices.DEVICES[name].gemm_efficiency(*shape) == pytest.approx(before[name] / 2, rel=0.01)
    assert devices.H100_SXM.attention_efficiency(4096, 4096, 128, "bf16") == pytest.approx(
        0.35 * devices.SUSTAINED["H100"])
    assert set(devices.DIES.values()) == set(devices.SUSTAINED) and set(devices.DIES) == set(devices.DEVICES)
