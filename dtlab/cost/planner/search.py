"""Every way to lay a transformer out on N GPUs, ranked by its predicted step time: a projection.

``layouts`` (``planner.layout``) enumerates dp x tp x pp = N (Megatron's rank order), for a mixture of
experts an expert-parallel degree ``ep`` that divides dp, a ZeRO stage (3 = FSDP), activation checkpointing
(none, selective or full), a micro-batch size, a precision and, with pipeline stages, 1F1B or the interleaved
schedule. ``evaluate`` gives each one its memory per GPU by kind (``planner.memory``) and its step time
(``planner.step``: the roofline's compute, each strategy's exposed communication, the bubble, the
optimizer; MFU and HFU come out of it). ``assumptions(...)`` lists all of it in words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dtlab.cost.planner.clusters import Cluster
from dtlab.cost.planner.experts import ep_assumptions
from dtlab.cost.planner.layout import Layout, check_layout, layouts, positive_int
from dtlab.cost.planner.memory import BUCKET_BYTES, memory
from dtlab.cost.planner.step import step_time
from dtlab.cost.planner.transformer import TransformerSpec

__all__ = ["BUCKET_BYTES", "KINDS", "Layout", "Plan", "assumptions", "check_layout", "evaluate", "layouts", "memory",
           "search"]

KINDS = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers")


# -- the table ------------------------------------------------------------------------------
def evaluate(model: TransformerSpec, cluster: Cluster, layout: Layout, global_batch: int) -> dict[str, Any]:
    """One row: the layout, its memory by kind, whether it fits, and its step time (with MFU and HFU)."""
    check_layout(model, cluster, layout, global_batch)
    kinds = memory(model, layout, global_batch)
    peak = sum(kinds.values())
    row: dict[str, Any] = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "cp": layout.cp,
                           "zero": layout.zero, "checkpointing": layout.checkpointing,
                           "micro_batch": layout.micro_batch, "micro_batches": layout.micro_batches(global_batch),
                           "precision": layout.precision, "schedule": layout.schedule,
                           "interleave": layout.interleave, **kinds, "peak_bytes": peak,
                           "feasible": peak <= cluster.gpu_memory_bytes}
    row.update(step_time(model, cluster, layout, global_batch))
    return row


@dataclass
class Plan:
    """A projection: the ranked table (feasible first, then by step time) and what it assumes."""

    model: TransformerSpec
    cluster: Cluster
    gpus: int
    global_batch: int
    table: pd.DataFrame
    assumptions: list[str] = field(default_factory=list)

    def feasible(self) -> pd.DataFrame:
        return self.table[self.table["feasible"]]

    def best(self) -> pd.Series:
        """The fastest feasible layout (ValueError if none fits)."""
        ok = self.feasible()
        if ok.empty:
            raise ValueError(f"no layout of {self.model.name} fits {self.gpus} GPU(s) of {self.cluster.name}: "
                             f"the smallest needs {self.table['peak_bytes'].min() / 1e9:.0f} GB per GPU")
        return ok.iloc[0]

    def __repr__(self) -> str:
        return (f"Plan(PROJECTION: {self.model.name} on {self.gpus} GPU(s) of {self.cluster.name}, global batch "
                f"{self.global_batch}: {len(self.feasible())} of {len(self.table)} layouts fit)")


def search(model: TransformerSpec, cluster: Cluster, gpus: int, global_batch: int) -> Plan:
    """Every layout of ``gpus`` GPUs, ranked: feasible ones first, then by predicted step time."""
    _check_job(cluster, gpus, global_batch)
    rows = [evaluate(model, cluster, layout, global_batch) for layout in layouts(model, cluster, gpus, global_batch)]
    if not rows:
        raise ValueError(f"gpus={gpus} is invalid for global_batch={global_batch}: no layout divides the batch and "
                         f"the model (try a global batch divisible by the GPU count)")
    # ties in time (a collective hidden either way) go to the layout that needs less memory
    table = pd.DataFrame(rows).sort_values(["feasible", "step_s", "peak_bytes"], ascending=[False, True, True],
                                           kind="stable")
    table = table.reset_index(drop=True)
    table.insert(0, "rank", range(1, len(table) + 1))
    return Plan(model, cluster, gpus, global_batch, table, assumptions(model, cluster, gpus, global_batch))


def _check_job(cluster: Cluster, gpus: Any, global_batch: Any) -> None:
    positive_int("gpus", gpus)
    positive_int("global_batch", global_batch)
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise ValueError(f"gpus={gpus} is invalid: beyond one node, whole nodes of {cluster.gpus_per_node} GPUs")


def assumptions(model: TransformerSpec, cluster: Cluster, gpus: int, global_batch: int) -> list[str]:
    """What every number of the plan rests on, one sentence each."""
    nodes = max(1, gpus // cluster.gpus_per_node)
    return [
        "PROJECTION: arithmetic on published figures, not a measurement; nothing here ran on this cluster.",
        *model.assumptions(),
        f"cluster: {nodes} node(s) x {min(gpus, cluster.gpus_per_node)} GPU(s). {cluster.describe()}",
        f"cluster figures: {cluster.source}",
        f"GPU: {'; '.join(cluster.device.sources)}",
        f"global batch {global_batch} sequences of {model.seq} tokens; Adam; layouts dp x tp x pp = {gpus}, "
        "tp inside a node (Megatron rank order: tp, then cp, then dp, then pp)",
        "compute: every op of a step (QKV, attention output, MLP and vocabulary GEMMs; flash attention; norms, "
        "activations, residual adds, the loss; Adam over the GPU's shard) timed on the GPU's roofline: a GEMM at "
        "the MAMF asymptote times tile and wave quantisation of its shape, less a fixed kernel cost, times one "
        "fitted factor per GPU die for sustained training (roofline.devices.SUSTAINED); memory-bound ops at the HBM "
        "bandwidth; fp32 runs on the fp32 peak (no TF32); full recomputation replays every block's forward, "
        "selective the attention core; MFU and HFU come out of the step time, never assumed; data loading is not "
        "counted",
        "pipeline: 1F1B, or interleaved with 2 chunks per GPU; bubble (pp - 1) x one micro-batch on the slowest "
        "stage (/ v interleaved; (t_F + t_B - t_W) for zero bubble) (Narayanan et al. 2021; Qi et al. 2023); each "
        "micro-batch's activation and its gradient cross a stage boundary on the critical path, not overlapped",
        "tensor parallel with sequence parallelism: an all-gather and a reduce-scatter of b x s x h activations "
        "around attention and the MLP, forward exposed, backward overlapping the weight-gradient GEMMs "
        "(Korthikanti et al. 2022), on NVLink; more when the forward is recomputed",
        *ep_assumptions(model),
        "data parallel: NCCL ring (or tree, for an all-reduce across nodes, whichever is faster) on NVLink inside a "
        "node, else on the NICs of the group's GPUs on each node; gradients reduced in fp32; ZeRO 0 all-reduces "
        "them, ZeRO 1-2 reduce-scatter them and all-gather the parameters, bucket by bucket under the last "
        "micro-batch's backward and the next forward; ZeRO 3 (FSDP) gathers each layer's parameters for forward "
        "and backward and reduce-scatters its gradients every micro-batch, prefetched under the layer before",
        "memory: ZeRO's 2 + 2 + 12 bytes per parameter in bf16 mixed precision (4 + 4 + 8 in fp32), sharded by "
        "stage; activations after Korthikanti et al. 2022 on the stage that holds the most; nothing counted for the "
        "CUDA context, the allocator's fragmentation or library workspaces: leave headroom under the line",
    ]
