"""Data-centre GPUs as roofline devices: peaks per dtype, memory bandwidth, and how near a GEMM comes to them.

Every peak is NVIDIA's datasheet figure for dense math (no 2:4 sparsity); every bandwidth the
datasheet's HBM figure. How close a GEMM of a given shape comes to the peak is derived, not
assumed per shape:

* **the asymptote** is the best any GEMM reached on that GPU in a published scan of shapes
  (the "Maximum Achievable Matmul FLOPS", MAMF, of S. Bekman's *Machine Learning Engineering*,
  github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul
  FLOPS comparison table": A100 SXM 267.9 of 312 TFLOP/s bf16 = 85.9 %, H100 SXM 792.1 of 989 =
  80.1 %, H100/H200 SXM 794.5 = 80.3 %);
* **tile and wave quantisation** (NVIDIA, "Matrix Multiplication Background User's Guide",
  docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication): the output is
  cut into thread-block tiles (128 x 256, 256 x 128, 128 x 128, 128 x 64 or 64 x 128, the library picks the best), a
  partial tile costs a whole one, and the tiles run in waves of one per SM, a partial wave costing
  a whole one; the K dimension runs in steps of 64;
* **a fixed cost per kernel** (``KERNEL_OVERHEAD_S``: launch and the pipeline's fill and drain, a
  few microseconds), which is what makes a small GEMM slow however well it tiles.

A fused (flash) attention runs its executed FLOPs at a published fraction of the peak
(``attention_efficiency``): FlashAttention-2 reaches "50-73 % of the theoretical maximum FLOPs/s
on A100" (Dao 2023, arXiv 2307.08691, abstract; the lower end taken for forward and backward
together) and "only 35 % utilization on the H100" (Shah et al. 2024, FlashAttention-3, arXiv
2407.08608, abstract); the published runs the planner is checked against predate FlashAttention-3.
Nothing here is fitted to a training run but ``SUSTAINED`` (below), one constant per die, which says on
which rows.
"""

from __future__ import annotations

import math

from dtlab.cost.roofline.model import Device

__all__ = ["A100_80GB", "DEVICES", "DIES", "H100_SXM", "H200_SXM", "KERNEL_OVERHEAD_S", "SUSTAINED", "TILES",
           "attention_curve", "gemm_curve", "get", "tiled_efficiency"]

TILES = ((128, 256), (256, 128), (128, 128), (128, 64), (64, 128))  # cuBLAS / CUTLASS thread-block tiles
K_STEP = 64
KERNEL_OVERHEAD_S = 4e-6
# The fraction of its MAMF a GEMM keeps inside a training step (clocks held down by sustained power, SMs
# shared with NCCL's kernels, the MAMF being a best case over shapes): the constants fitted to training runs,
# one per die, because the two dies' power, clocks and software differ. Each is fitted on every scored row of
# data/published_runs.csv on its die, no row of the other (planner.fit; `python -m dtlab.cost.planner.validate
# --fit` prints them); the validation predicts each source with both refitted without it (docs/measurement.md,
# "The planner"). The H200 is the H100's die with more memory: it takes the H100's.
SUSTAINED: dict[str, float] = {"A100": 0.77, "H100": 0.594}
DIES = {"A100_80GB": "A100", "H100_SXM": "H100", "H200_SXM": "H100"}  # preset -> the die whose constant it takes

_DATASHEET_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/"
                   "pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): A100 80GB SXM, FP32 19.5, TF32 156, "
                   "BF16/FP16 312 TFLOP/s dense (twice with sparsity), HBM2e 2,039 GB/s, 108 SMs")
_DATASHEET_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): H100 SXM, FP32 67, "
                   "TF32 494.7, BF16/FP16 989.4, FP8 1,978.9 TFLOP/s dense (the sheet's 989 / 1,979 / 3,958 are "
                   "with sparsity), HBM3 3.35 TB/s, 132 SMs (table in glennklockwood.com/garden/processors/h100)")
_DATASHEET_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): the H100's compute "
                   "(same GH100 die, 132 SMs) with 141 GB of HBM3e at 4.8 TB/s")
_MAMF = ("asymptote: MAMF (S. Bekman, github.com/stas00/ml-engineering, compute/accelerator/README.md, 'Maximum "
         "Achievable Matmul FLOPS comparison table')")
_TILING = ("shape: tile and wave quantisation (NVIDIA, 'Matrix Multiplication Background User's Guide', "
           "docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication)")


def _quantised(size: int, step: int) -> float:
    """The fraction of the padded extent that is real work."""
    return size / (math.ceil(size / step) * step)


def tiled_efficiency(m: int, n: int, k: int, sms: int) -> float:
    """Tile x wave x K-step quantisation of an (m x k) @ (k x n) GEMM on ``sms`` SMs, the best tile taken."""
    if min(m, n, k) < 1:
        raise ValueError(f"GEMM shape ({m}, {n}, {k}) is invalid: every dimension must be >= 1")
    best = 0.0
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, _quantised(m, tm) * _quantised(n, tn) * tiles / (waves * sms))
    return best * _quantised(k, K_STEP)


def gemm_curve(m: int, n: int, k: int, dtype: str, *, sms: int, asymptote: float, peak: float, sustained: float,
               overhead_s: float = KERNEL_OVERHEAD_S) -> float:
    """The fraction of the dtype's peak an (m, n, k) GEMM reaches: asymptote x sustained x quantisation, less a
    fixed kernel cost (``peak`` in FLOP/s of that dtype: it turns the cost into an equivalent in FLOPs)."""
    rate = peak * asymptote * sustained * tiled_efficiency(m, n, k, sms)
    flops = 2.0 * m * n * k
    return rate / peak * flops / (flops + overhead_s * rate)


def attention_curve(s_q: int, s_kv: int, head_dim: int, dtype: str, *, efficiency: float, sustained: float) -> float:
    """A fused attention's fraction of the peak on its executed FLOPs: the published kernel efficiency times
    the sustained share, its short-sequence tail left to the causal mask's diagonal blocks (``Op.executed``)."""
    return efficiency * sustained


def _device(name: str, peaks: dict[str, float], bandwidth: float, sms: int, asymptote: float,
            attention: float, sources: tuple[str, ...], die: str) -> Device:
    # SUSTAINED[die] is read at each call, not bound here, so that a fit can try values on a built device
    def curve(m: int, n: int, k: int, dtype: str) -> float:
        return gemm_curve(m, n, k, dtype, sms=sms, asymptote=asymptote, peak=peaks[dtype], sustained=SUSTAINED[die])

    def attention_rate(s_q: int, s_kv: int, head_dim: int, dtype: str) -> float:
        return attention_curve(s_q, s_kv, head_dim, dtype, efficiency=attention, sustained=SUSTAINED[die])

    return Device(name, peaks, bandwidth, curve, sources, attention_rate)


A100_80GB = _device("A100 SXM 80GB", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
                    2.039e12, sms=108, asymptote=267.9 / 312, attention=0.50,
                    sources=(_DATASHEET_A100, _MAMF + ": A100 SXM 267.9 of 312 TFLOP/s (85.9 %), CUDA 12.1",
                             _TILING, "attention: FlashAttention-2, 50-73 % of peak on A100 (arXiv 2307.08691)"),
                    die="A100")
H100_SXM = _device("H100 SXM 80GB", {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12,
                                     "fp32": 66.9e12},
                   3.35e12, sms=132, asymptote=792.1 / 989.4, attention=0.35,
                   sources=(_DATASHEET_H100, _MAMF + ": H100 SXM 792.1 of 989 TFLOP/s (80.1 %), CUDA 12.1",
                            _TILING, "attention: FlashAttention-2 reaches 35 % of peak on H100 (FlashAttention-3 "
                                     "paper, arXiv 2407.08608)"),
                   die="H100")
H200_SXM = _device("H200 SXM 141GB", dict(H100_SXM.peak_flops), 4.8e12, sms=132, asymptote=794.5 / 989.4,
                   attention=0.35,
                   sources=(_DATASHEET_H200, _MAMF + ": H100/H200 SXM 794.5 of 989 TFLOP/s (80.3 %)", _TILING,
                            "attention: as the H100 (same die)"),
                   die="H100")

DEVICES: dict[str, Device] = {"A100_80GB": A100_80GB, "H100_SXM": H100_SXM, "H200_SXM": H200_SXM}


def get(name: str) -> Device:
    """A device by its key (``A100_80GB``, ``H100_SXM``, ``H200_SXM``)."""
    if name not in DEVICES:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(DEVICES)}")
    return DEVICES[name]
