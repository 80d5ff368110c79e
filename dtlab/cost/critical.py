"""When a strategy becomes communication-bound: arithmetic intensity against a device's FLOP/s and a link's bandwidth.

A roofline compares an op's **arithmetic intensity** (FLOPs per byte it moves) with the device's
ridge, ``C / W``: below it the bytes take longer than the arithmetic. The same comparison holds for
a link: a parallel strategy's intensity is the FLOPs a GPU computes per byte it sends, and below
``C / W_link`` the communication takes longer than the compute it could hide under. With ``b``
bytes per value, ``P`` parameters, ``B`` tokens per GPU per step and a ring's bytes per GPU
(``2 (n-1)/n S`` for an all-reduce of S bytes, ``(n-1)/n S`` for an all-gather or a reduce-scatter;
``W`` is the bus bandwidth those formulas take, nccl-tests' busbw):

* a GEMM ``(B x h) @ (h x f)``: ``2 B h f`` FLOPs over ``b (B h + h f + B f)`` bytes, about ``2B / b``
  when ``B`` is small against h and f: compute-bound from ``B = b C / (2 W_hbm)`` rows;
* data parallelism: ``6 B P`` FLOPs against one all-reduce of the gradients, ``2 (n-1)/n b P``
  bytes: compute-bound from ``B = (n-1)/n x b C / (3 W)`` tokens per GPU;
* fully sharded (ZeRO-3, FSDP): the parameters gathered for forward and again for backward, the
  gradients reduce-scattered, ``3 (n-1)/n b P`` bytes: from ``B = (n-1)/n x b C / (2 W)``;
* tensor parallelism over ``t`` GPUs (Megatron-LM): a layer's ``6 B P_layer / t`` FLOPs against four
  all-reduces of the ``B x h`` activations (two forward, two backward), ``8 (t-1)/t b B h`` bytes: the
  batch cancels, and the layer stays compute-bound while ``P_layer / h >= 4/3 (t-1) b C / W``, that is
  up to ``t = 1 + 3 P_layer W / (4 h b C)`` GPUs.

Each is where the two times are equal, with nothing overlapped; overlap moves the point by the share of
the compute the communication can hide under, never past it.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from dtlab.cost.planner.clusters import Cluster
from dtlab.cost.planner.transformer import TransformerSpec

__all__ = ["STRATEGIES", "critical_table", "critical_tokens", "gemm_intensity", "tp_degree"]

STRATEGIES = {"dp": 3.0, "fsdp": 2.0}  # FLOPs per token per parameter over bytes per parameter: 6 / 2, 6 / 3


def _factor(n: int | None) -> float:
    """``(n-1)/n``, the ring's share; 1 for a large (or unknown) n."""
    if n is None:
        return 1.0
    if n < 2:
        raise ValueError(f"n={n!r} is invalid: a ring needs at least 2 GPUs")
    return (n - 1) / n


def gemm_intensity(m: int, n: int, k: int, itemsize: int) -> float:
    """FLOPs per byte of an (m x k) @ (k x n) GEMM reading both operands and writing its result once."""
    return 2.0 * m * n * k / (itemsize * (m * k + k * n + m * n))


def critical_tokens(strategy: str, flops: float, bandwidth: float, itemsize: int, n: int | None = None) -> float:
    """Tokens (or samples) per GPU per step from which ``strategy``'s compute outlasts its communication:
    ``dp`` ``(n-1)/n b C / (3 W)``, ``fsdp`` ``(n-1)/n b C / (2 W)``; ``bandwidth`` is the bus bandwidth."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is invalid: choose {' or '.join(STRATEGIES)}")
    return _factor(n) * itemsize * flops / (STRATEGIES[strategy] * bandwidth)


def tp_degree(model: TransformerSpec, flops: float, bandwidth: float, itemsize: int) -> float:
    """The tensor-parallel degree up to which a layer of ``model`` stays compute-bound: ``1 + 3 P_layer W / (4 h b
    C)`` (any batch), ``P_layer`` its weight matrices' elements."""
    return 1 + 3 * model.layer_matmul() * bandwidth / (4 * model.hidden * itemsize * flops)


def critical_table(clusters: Mapping[str, Cluster], model: TransformerSpec, dtype: str = "bf16") -> pd.DataFrame:
    """Per cluster and link (NVLink inside a node, a NIC between nodes): the GPU's FLOP/s and the link's bus
    bandwidth, the ridge C / W, the tokens per GPU a GEMM, data parallelism and FSDP need to be compute-bound
    (n large) and the largest tensor-parallel degree that keeps ``model``'s layers compute-bound."""
    rows = []
    for name, cluster in clusters.items():
        flops, b = cluster.device.peak(dtype), 2 if dtype in ("bf16", "fp16") else 4
        gemm = b * flops / (2 * cluster.device.memory_bandwidth)
        for link, bandwidth in (("NVLink", cluster.intra_bus_bandwidth), ("NIC", cluster.inter_bus_bandwidth)):
            rows.append({"cluster": name, "link": link, "TFLOP/s": flops / 1e12, "GB/s": bandwidth / 1e9,
                         "ridge C/W": flops / bandwidth, "GEMM rows (HBM)": gemm,
                         "dp tokens/GPU": critical_tokens("dp", flops, bandwidth, b),
                         "fsdp tokens/GPU": critical_tokens("fsdp", flops, bandwidth, b),
                         f"tp degree ({model.name})": tp_degree(model, flops, bandwidth, b)})
    return pd.DataFrame(rows)
