"""Clusters to plan for: one GPU's memory and FLOPs, and the two links between GPUs.

Every figure of a preset names the document it comes from (``Cluster.source``).
Two kinds of figure are kept apart:

* the **line rate** a datasheet gives (NVLink's per-direction bandwidth, a NIC's
  Gb/s), and
* the **bus bandwidth NCCL achieves** on it (nccl-tests' ``busbw``, the
  number the ring formulas take as 1/beta), from a published measurement or a
  maintainer's statement of what the hardware should reach.

The ratio of the two is the bandwidth efficiency the planner assumes; it is
shown, never folded in silently (``Cluster.describe``). The latencies are NCCL's
own tuning-model constants for one ring step of the Simple protocol (the one
large messages use). The GPU itself is a roofline ``Device``
(``dtlab.cost.roofline.devices``): its peaks per dtype, its memory bandwidth and
its GEMM efficiency curve, each cited there. How much of the peak a step achieves
is not a figure of the cluster: the planner works it out (``planner.step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.roofline import devices
from dtlab.cost.roofline.model import Device

GB = 1e9  # bytes: vendors quote memory in GB of 10^9 bytes

__all__ = ["A100_80GB", "BY_GPU", "CLUSTERS", "Cluster", "H100_SXM", "H200_SXM", "by_gpu", "get"]


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"Cluster.{name}={value!r} is invalid: must be a number > 0")


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` identical GPUs; one NIC per GPU between nodes (rail-optimised).

    Bandwidths are in bytes per second per GPU, latencies in seconds per ring step.
    ``*_line_rate`` is the datasheet's figure, ``*_bus_bandwidth`` what NCCL
    achieves on it (nccl-tests' busbw), which the step model uses.
    """

    name: str
    gpu_memory_bytes: float
    gpus_per_node: int
    device: Device  # the GPU: peaks per dtype, memory bandwidth, GEMM efficiency (roofline.devices)
    intra_line_rate: float  # NVLink, one direction, per GPU
    intra_bus_bandwidth: float
    intra_latency_s: float
    inter_line_rate: float  # the GPU's NIC
    inter_bus_bandwidth: float
    inter_latency_s: float
    source: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Cluster.name is empty: give the cluster a name")
        if not isinstance(self.device, Device):
            raise ValueError(f"Cluster.device={self.device!r} is invalid: give a roofline Device")
        for field in ("gpu_memory_bytes", "peak_flops", "peak_flops_fp32", "intra_line_rate",
                      "intra_bus_bandwidth", "inter_line_rate", "inter_bus_bandwidth"):
            _positive(field, getattr(self, field))
        for field in ("intra_latency_s", "inter_latency_s"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Cluster.{field}={value!r} is invalid: must be >= 0 seconds")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Cluster.gpus_per_node={self.gpus_per_node!r} is invalid: must be an integer >= 1")

    @property
    def peak_flops(self) -> float:
        """bf16 dense tensor-core FLOP/s of one GPU (no sparsity)."""
        return self.device.peak("bf16")

    @property
    def peak_flops_fp32(self) -> float:
        """fp32 FLOP/s without tensor cores (PyTorch's default for fp32 matmuls)."""
        return self.device.peak("fp32")

    @property
    def intra_efficiency(self) -> float:
        return self.intra_bus_bandwidth / self.intra_line_rate

    @property
    def inter_efficiency(self) -> float:
        return self.inter_bus_bandwidth / self.inter_line_rate

    def intra_link(self) -> LinkModel:
        """NVLink inside a node, as an alpha-beta link with the textbook ring algorithms."""
        return LinkModel(self.intra_latency_s, 1.0 / self.intra_bus_bandwidth, backend="ring",
                         label=f"{self.name}: intra-node")

    def inter_link(self, gpus_per_node_in_group: int = 1) -> LinkModel:
        """Between nodes, for a group with ``gpus_per_node_in_group`` members on each node.

        NCCL spreads a ring's channels over the NICs of the group's GPUs on a node,
        so k members per node move up to k NICs' worth, never more than NVLink
        carries (a NCCL maintainer's DGX A100 figure: 8 x 200 Gb/s NICs, 192 GB/s
        all-reduce busbw, NVIDIA/nccl issue 812, quoted in issue 1576).
        """
        k = max(1, int(gpus_per_node_in_group))
        bandwidth = min(self.intra_bus_bandwidth, k * self.inter_bus_bandwidth)
        return LinkModel(self.inter_latency_s, 1.0 / bandwidth, backend="ring",
                         label=f"{self.name}: inter-node, {k} NIC(s)")

    def describe(self) -> str:
        """The figures and the efficiencies they imply, in one paragraph."""
        return (f"{self.name}: {self.gpus_per_node} GPUs per node, {self.gpu_memory_bytes / GB:.0f} GB each, "
                f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16 dense ({self.peak_flops_fp32 / 1e12:.1f} fp32); "
                f"intra-node {self.intra_line_rate / GB:.0f} GB/s line rate, {self.intra_bus_bandwidth / GB:.0f} GB/s "
                f"NCCL bus bandwidth ({self.intra_efficiency:.0%}), {self.intra_latency_s * 1e6:.1f} us per step; "
                f"inter-node {self.inter_line_rate / GB:.0f} GB/s per GPU line rate, "
                f"{self.inter_bus_bandwidth / GB:.0f} GB/s achieved ({self.inter_efficiency:.0%}), "
                f"{self.inter_latency_s * 1e6:.1f} us per step.")


# NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, hwLat[...][Ring][Simple] at commit 01afd20): 3.4 us per
# ring step over NVLink, 9.6 us over the network. Newer NCCL releases tune these constants differently.
_NCCL_LATENCY = ("latency: NCCL's own tuning model, src/graph/tuning.cc (hwLat, Ring/Simple: 3.4 us per NVLink step, "
                 "9.6 us per network step; github.com/NVIDIA/nccl at commit 01afd20, later releases differ)")
_HOPPER_LINKS = (
    "NVLink 4: 900 GB/s per GPU in both directions, 450 GB/s each way (NVIDIA DGX SuperPOD reference architecture, "
    "DGX H100: docs.nvidia.com/dgx-superpod/reference-architecture-scalable-infrastructure-h100, 'Key Components'); "
    "NCCL reaches 370 GB/s bus bandwidth on it with the ring algorithm (~20% protocol overhead; NVIDIA's "
    "S. Jeaugey in github.com/NVIDIA/nccl-tests/issues/212; NVLink SHARP all-reduce shows ~480 GB/s busbw, "
    "not modelled). Between nodes: one ConnectX-7 NIC per GPU at 400 Gb/s NDR InfiniBand = 50 GB/s (DGX BasePOD "
    "reference architecture, docs.nvidia.com/dgx-basepod/.../core-components.html: 'Four OSFP ports serving eight "
    "single-port NVIDIA ConnectX-7 VPI ... up to 400 Gb/s'); 'CX-7 NICs at NDR rate should achieve up to 48-49 GB/s "
    "per NIC' (NCCL maintainer AddyLaddy, github.com/NVIDIA/nccl-tests/issues/267): 48 GB/s used.")

H100_SXM = Cluster(
    name="8x H100 SXM 80GB, NVLink 4 + 400 Gb/s NDR",
    gpu_memory_bytes=80 * GB, gpus_per_node=8, device=devices.H100_SXM,
    intra_line_rate=450 * GB, intra_bus_bandwidth=370 * GB, intra_latency_s=3.4e-6,
    inter_line_rate=50 * GB, inter_bus_bandwidth=48 * GB, inter_latency_s=9.6e-6,
    source=("GPU: 80 GB HBM3 (DGX BasePOD reference architecture: '640 GB total GPU memory' for 8 GPUs); "
            "989 TFLOP/s bf16 dense and 67 TFLOP/s fp32 (NVIDIA H100 Tensor Core GPU datasheet, "
            "nvidia.com/en-us/data-center/h100: 1,979 TFLOP/s bf16 'with sparsity', half of it dense; "
            "table in glennklockwood.com/garden/processors/h100). " + _HOPPER_LINKS + " " + _NCCL_LATENCY))

H200_SXM = Cluster(
    name="8x H200 SXM 141GB, NVLink 4 + 400 Gb/s NDR",
    gpu_memory_bytes=141 * GB, gpus_per_node=8, device=devices.H200_SXM,
    intra_line_rate=450 * GB, intra_bus_bandwidth=370 * GB, intra_latency_s=3.4e-6,
    inter_line_rate=50 * GB, inter_bus_bandwidth=48 * GB, inter_latency_s=9.6e-6,
    source=("GPU: 141 GB HBM3e (DGX BasePOD reference architecture: '1,128 GB total GPU memory for H200' over 8 "
            "GPUs; MLCommons inference v4.1 system description H200-SXM-141GBx8: 141 GB, '18x 4th Gen NVLink, "
            "900GB/s'); the same GH100 compute die as the H100, so the H100's 989 TFLOP/s bf16 dense and 67 TFLOP/s "
            "fp32 (NVIDIA H200 datasheet, nvidia.com/en-us/data-center/h200: 1,979 TFLOP/s bf16 with sparsity). "
            + _HOPPER_LINKS + " " + _NCCL_LATENCY))

A100_80GB = Cluster(
    name="8x A100 SXM 80GB, NVLink 3 + 200 Gb/s HDR",
    gpu_memory_bytes=80 * GB, gpus_per_node=8, device=devices.A100_80GB,
    intra_line_rate=300 * GB, intra_bus_bandwidth=230 * GB, intra_latency_s=3.4e-6,
    inter_line_rate=25 * GB, inter_bus_bandwidth=24 * GB, inter_latency_s=9.6e-6,
    source=("GPU: 80 GB HBM2e, 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32, NVLink 3 at 600 GB/s both ways = 300 GB/s "
            "each way (NVIDIA A100 Tensor Core GPU datasheet, nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
            "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf). NCCL on 8 A100 SXM 80GB over NVLink: "
            "232.5 GB/s all-reduce busbw measured (github.com/NVIDIA/nccl-tests/issues/175): 230 GB/s used. "
            "Between nodes: DGX A100 has one 200 Gb/s HDR InfiniBand NIC per GPU (the DGX H100 RA: DGX H100 has "
            "'2X faster networking ... @ 400 Gbps' than DGX A100) = 25 GB/s; 'the peak for 200G HDR is 24GB/s' "
            "(NVIDIA's S. Jeaugey, github.com/NVIDIA/nccl/issues/412). " + _NCCL_LATENCY))

CLUSTERS: dict[str, Cluster] = {"H100": H100_SXM, "H200": H200_SXM, "A100": A100_80GB}
BY_GPU: dict[str, Cluster] = {"H100_SXM": H100_SXM, "H200_SXM": H200_SXM, "A100_80GB": A100_80GB}


def get(name: str) -> Cluster:
    """A preset by its short name (``H100``, ``H200``, ``A100``)."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster preset {name!r}: choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def by_gpu(name: str) -> Cluster:
    """A preset by its GPU's key (``A100_80GB``, ``H100_SXM``, ``H200_SXM``), as ``data/published_runs.csv``
    names it."""
    if name not in BY_GPU:
        raise ValueError(f"unknown gpu {name!r}: choose one of {', '.join(BY_GPU)}")
    return BY_GPU[name]
