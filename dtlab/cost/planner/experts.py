"""Expert parallelism in the planner: a mixture of experts' weights, all-to-alls and assumptions.

A layout's ``ep`` divides its dp: each group of ep data-parallel GPUs shares a layer's experts out
(``experts / ep`` each), as Megatron-LM and DeepSpeed-MoE (Rajbhandari et al. 2022) place them; an
expert's weights are then data-parallel over the dp / ep GPUs that hold the same expert, so ZeRO
shards them over those. Each MoE layer's tokens travel in two
all-to-alls (dispatch, combine) in forward and two in backward (GShard, Lepikhin et al. 2020).
"""

from __future__ import annotations

from dtlab.cost.planner.clusters import Cluster
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.network import group, seconds
from dtlab.cost.planner.transformer import TransformerSpec

__all__ = ["all_to_all_bytes", "ep_assumptions", "ep_time", "per_gpu"]

VALUE_BYTES = {"bf16": 2, "fp32": 4}  # activations' bytes per value (memory.ACTIVATION_BYTES)


def per_gpu(dense: float, expert: float, layout: Layout, nbytes: int, stage: int) -> float:
    """Bytes per GPU of ``nbytes`` per parameter, ZeRO sharding from ``stage`` on: the dense weights over the dp
    GPUs, the experts over the dp / ep GPUs that hold the same ones."""
    sharded = layout.zero >= stage
    return dense * nbytes / (layout.dp if sharded else 1) + expert * nbytes / (layout.dp // layout.ep if sharded
                                                                               else 1)


def all_to_all_bytes(model: TransformerSpec, layout: Layout) -> float:
    """One dispatch's bytes per GPU: a micro-batch's tokens (this tp rank's share of them, under sequence
    parallelism) x top_k rows of hidden values."""
    tokens = layout.micro_batch * model.seq / (layout.tp * layout.cp)
    return tokens * model.top_k * model.hidden * VALUE_BYTES[layout.precision]


def ep_time(model: TransformerSpec, cluster: Cluster, layout: Layout, micro_batches: int) -> float:
    """Seconds of all-to-all per step: dispatch and combine in forward, again in backward (and in a replayed
    forward), every MoE layer of a stage and micro-batch, none overlapped (``network.seconds``: the share for
    the node's other GPUs over NVLink, the rest over the NICs)."""
    if layout.ep == 1:
        return 0.0
    count = 4 + (2 if layout.checkpointing == "full" else 0)
    ranks = group(cluster, layout.ep, layout.tp * layout.cp)
    per = seconds(cluster, "all_to_all", all_to_all_bytes(model, layout), ranks)
    return micro_batches * layout.stage_layers(model.layers) * count * per


def ep_assumptions(model: TransformerSpec) -> list[str]:
    if model.experts == 1:
        return []
    return [f"expert parallel: ep divides dp and the {model.experts} experts; each MoE layer's dispatch and combine "
            "all-to-alls (forward, backward, and a replayed forward) exposed, priced as pairwise exchanges on NVLink "
            "inside a node and on the NICs between nodes; expert weights data-parallel (and ZeRO-sharded) over "
            "dp / ep GPUs; the router's load taken as even"]
