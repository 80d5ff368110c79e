"""On a CUDA device, dtlab's timings are the GPU's, not the kernel launches' (skipped without one).

Run them with ``tests/gpu/run.sh`` on a machine with a GPU. One GPU shows NCCL at
world size 1 only: no speedup is measured or claimed here.
"""

from __future__ import annotations

import pytest
import torch

from dtlab import RunConfig
from dtlab.core.memory import peak_process_bytes
from dtlab.core.timing import StepClock
from dtlab.train import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _work(a: torch.Tensor, n: int = 50) -> torch.Tensor:
    for _ in range(n):
        a = torch.tanh(a @ a)
    return a


def test_marks_are_the_gpus_times_not_the_launches():
    a = torch.randn(2048, 2048, device="cuda") / 64
    _work(a, 3)
    torch.cuda.synchronize()
    clock = StepClock("cuda")
    start = clock.mark()
    _work(a)
    end = clock.mark()  # the CPU gets here long before the GPU does
    launched = end - start
    times = clock.resolve()
    measured = times[end] - times[start]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _work(a)
        torch.cuda.synchronize()
    # the kernels themselves (not the CPU-side ops that launched them), back to back on one stream
    kernels = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    assert measured == pytest.approx(kernels, rel=0.10)
    assert measured > launched  # what the CPU alone would have reported is the launch time
    print(f"GPU span {measured * 1e3:.2f} ms, profiler kernels {kernels * 1e3:.2f} ms, "
          f"CPU launch {launched * 1e3:.2f} ms")


def test_a_run_on_cuda_reports_gpu_phases_nccl_events_and_allocator_memory():
    cfg = RunConfig(tier="ddp", world_size=1, device="cuda", backend="nccl", model_size=2048, model_depth=4,
                    dataset="synthetic", global_batch_size=512, steps=10, optimizer="sgd", lr=0.01)
    result = run(cfg, progress=False)
    steps = result.steps_frame().query("step >= 1")
    parts = steps[["data", "forward", "backward", "comm", "optimizer"]].sum(axis=1)
    assert ((parts - steps["total"]).abs() <= 0.05 * steps["total"]).all()
    assert (steps["backward"] > steps["forward"] * 0.5).all()  # backward is real GPU work, not a launch
    ev = result.events_frame()
    assert not ev.empty and (ev["end"] >= ev["start"]).all()
    memory = result.ranks[0].memory
    for key in ("cuda_allocated", "cuda_max_allocated", "cuda_reserved", "cuda_max_reserved"):
        assert memory[key] > 0
    assert memory["cuda_max_reserved"] >= memory["cuda_max_allocated"]
    print(f"median step {steps['total'].median() * 1e3:.2f} ms; forward {steps['forward'].median() * 1e3:.2f} ms, "
          f"backward {steps['backward'].median() * 1e3:.2f} ms; peak allocated {memory['cuda_max_allocated']} B")


def test_allocator_statistics_on_cuda():
    x = torch.empty(1 << 20, device="cuda")
    stats = peak_process_bytes(torch.device("cuda"))
    assert stats["cuda_allocated"] >= x.numel() * 4
    del x
