"""Every way to lay a transformer out on N GPUs, with its memory per GPU and its step time: a projection.

A layout is ``dp x tp x pp = N`` (Megatron's rank order: tensor-parallel ranks
adjacent, so a tp group never leaves a node; then data parallel; pipeline stages
outermost), for a mixture of experts an expert-parallel degree ``ep`` that divides dp
(``planner.experts``), a ZeRO stage (3 = FSDP), activation checkpointing (none, selective or
full), a micro-batch size (the global batch is cut into micro-batches: gradient
accumulation, and the pipeline's micro-batches) and a precision.

Memory per GPU, by the kinds ``dtlab.estimate`` uses, on the stage that needs the most:

* parameters, gradients, optimizer_state: Rajbhandari et al. 2020, "ZeRO" (sec. 3,
  5): mixed precision keeps 2 + 2 bytes per parameter (bf16 weights and gradients)
  and K = 12 for Adam (fp32 master weights, momentum, variance); fp32 training
  4 + 4 and K = 8. Stage 1 shards the optimizer state over dp, stage 2 the gradients
  too, stage 3 the parameters too.
* activations: ``TransformerSpec.activation_bytes`` (Korthikanti et al. 2022) per
  layer, times the stage's layers, times the micro-batches in flight (1F1B: pp on the
  first stage; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM").
* comm_buffers: stages 0-2: two gradient buckets (one reducing, one filling); stage 3:
  two layers' gathered parameters (one computing, one prefetched) and one layer's
  gathered gradients; a pipeline's send and receive buffers; expert parallelism's
  all-to-all send and receive buffers (a micro-batch's tokens x top_k rows each).

Step time: compute from FLOPs / (peak x MFU), the pipeline bubble, and the
collectives on the cluster's links (``Cluster.intra_link`` / ``inter_link``,
alpha-beta with ring formulas). ``assumptions(...)`` lists all of it in words.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dtlab.analysis.planner.clusters import Cluster
from dtlab.analysis.planner.experts import all_to_all_bytes, ep_assumptions, ep_time, per_gpu
from dtlab.analysis.planner.transformer import RECOMPUTE, TransformerSpec

__all__ = ["BUCKET_BYTES", "KINDS", "Layout", "MFU", "Plan", "assumptions", "evaluate", "layouts", "search"]

# Model FLOPs utilisation assumed for every layout: Llama 3's pretraining reached 38-43% BF16 MFU on 8K-16K H100s
# (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4).
MFU = 0.4
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
MICRO_BATCHES = (1, 2, 4, 8)  # micro-batch sizes (sequences) tried
ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("bf16", "fp32")
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers")
BACKWARD_SHARE = 2 / 3  # backward does twice the forward's FLOPs
# bytes per parameter: weights, gradients, optimizer state (ZeRO's K), per precision
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class Layout:
    """One way to run the job; ``micro_batch`` is in sequences."""

    dp: int
    tp: int
    pp: int
    zero: int
    checkpointing: str
    micro_batch: int
    precision: str
    ep: int = 1  # expert parallel: the experts shared out over ep of the dp ranks

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")


def check_layout(model: TransformerSpec, cluster: Cluster, layout: Layout, global_batch: int) -> None:
    """ValueError, one line naming the field, for a layout that cannot run."""
    for name in ("dp", "tp", "pp", "micro_batch", "ep"):
        _positive_int(name, getattr(layout, name))
    if layout.ep > 1 and (layout.dp % layout.ep or model.experts % layout.ep):
        raise ValueError(f"ep={layout.ep} is invalid: it must divide dp={layout.dp} and the model's "
                         f"{model.experts} expert(s)")
    if layout.tp > cluster.gpus_per_node or cluster.gpus_per_node % layout.tp:
        raise ValueError(f"tp={layout.tp} is invalid: a tensor-parallel group stays inside one node of "
                         f"{cluster.gpus_per_node} GPUs (tp must divide it)")
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        raise ValueError(f"tp={layout.tp} is invalid: it must divide the {model.heads} attention heads and the "
                         f"{model.kv_heads} key/value heads")
    if model.layers % layout.pp:
        raise ValueError(f"pp={layout.pp} is invalid: it must divide the {model.layers} layers into equal stages")
    if layout.zero not in ZERO_STAGES:
        raise ValueError(f"zero={layout.zero!r} is invalid: choose one of {ZERO_STAGES}")
    if layout.pp > 1 and layout.zero >= 2:
        raise ValueError(f"zero={layout.zero} is invalid with pp={layout.pp}: pipelines shard only the optimizer "
                         f"state (stage 1), as DeepSpeed and Megatron-LM do")
    if layout.checkpointing not in RECOMPUTE:
        raise ValueError(f"checkpointing={layout.checkpointing!r} is invalid: choose one of {', '.join(RECOMPUTE)}")
    if layout.precision not in PRECISIONS:
        raise ValueError(f"precision={layout.precision!r} is invalid: choose one of {', '.join(PRECISIONS)}")
    if global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"micro_batch={layout.micro_batch} is invalid: dp x micro_batch = "
                         f"{layout.dp * layout.micro_batch} must divide global_batch={global_batch}")
    if layout.pp > 1 and global_batch // (layout.dp * layout.micro_batch) < layout.pp:
        raise ValueError(f"micro_batch={layout.micro_batch} is invalid: 1F1B needs at least pp={layout.pp} "
                         f"micro-batches per step")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: TransformerSpec, cluster: Cluster, gpus: int, global_batch: int) -> Iterator[Layout]:
    """Every valid layout of ``gpus`` GPUs (ZeRO stages above 0 only where dp > 1: one rank has nothing to shard)."""
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            for ep in [e for e in _divisors(dp) if model.experts % e == 0]:
                for b in MICRO_BATCHES:
                    for zero in ZERO_STAGES if dp > 1 else (0,):
                        for ckpt in RECOMPUTE:
                            for precision in PRECISIONS:
                                layout = Layout(dp, tp, pp, zero, ckpt, b, precision, ep)
                                try:
                                    check_layout(model, cluster, layout, global_batch)
                                except ValueError:
                                    continue
                                yield layout


# -- memory -----------------------------------------------------------------------------
def _stage_parameters(model: TransformerSpec, layout: Layout) -> tuple[int, int]:
    """Parameters per GPU on the first and on the last pipeline stage (the same stage when pp = 1)."""
    layers = model.layers // layout.pp * model.layer_parameters(layout.tp, layout.ep)
    first = layers + model.embedding_parameters(layout.tp)
    last = layers + model.head_parameters(layout.tp)
    if layout.pp == 1:
        return first + model.head_parameters(layout.tp), first + model.head_parameters(layout.tp)
    return first, last


def memory(model: TransformerSpec, layout: Layout, global_batch: int) -> dict[str, float]:
    """Bytes per GPU by kind, on the stage whose total is largest."""
    p_bytes, g_bytes, o_bytes = STATE_BYTES[layout.precision]
    act_bytes = ACTIVATION_BYTES[layout.precision]
    dp, tp, pp, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m = global_batch // (dp * b)
    sp = tp > 1  # sequence parallelism whenever tensor parallelism: Megatron's recommended setting
    per_layer = model.activation_bytes(b, tp, sp, layout.checkpointing, act_bytes)
    stage_layers = model.layers // pp
    layer_params = model.layer_parameters(tp, layout.ep)
    expert = stage_layers * model.expert_parameters(tp, layout.ep)  # data-parallel over dp / ep ranks only
    stages = []
    for index, psi in enumerate(_stage_parameters(model, layout)):
        in_flight = min(m, pp - index * (pp - 1)) if pp > 1 else 1  # 1F1B: pp on the first stage, 1 on the last
        acts = in_flight * stage_layers * per_layer
        if index == 1 or pp == 1:
            acts += model.output_activation_bytes(b, tp, act_bytes)
        shares = (psi - expert, expert, layout)  # ZeRO shards the experts over dp / ep ranks
        kinds = {"parameters": per_gpu(*shares, p_bytes, 3), "gradients": per_gpu(*shares, g_bytes, 2),
                 "optimizer_state": per_gpu(*shares, o_bytes, 1), "activations": acts, "comm_buffers": 0.0}
        if dp > 1 and layout.zero >= 3:
            kinds["comm_buffers"] = layer_params * (2 * p_bytes + g_bytes)
        elif dp > 1:
            kinds["comm_buffers"] = 2 * min(BUCKET_BYTES, psi * g_bytes)
        if pp > 1:
            kinds["comm_buffers"] += 2 * model.seq * b * model.hidden * act_bytes / (tp if sp else 1)
        if layout.ep > 1:
            kinds["comm_buffers"] += 2 * all_to_all_bytes(model, layout)
        stages.append(kinds)
    return max(stages, key=lambda k: sum(k.values()))


# -- time ---------------------------------------------------------------------------------
def _dp_link(cluster: Cluster, layout: Layout) -> tuple[Any, str]:
    if layout.dp * layout.tp <= cluster.gpus_per_node:
        return cluster.intra_link(), "intra"
    return cluster.inter_link(cluster.gpus_per_node // layout.tp), "inter"


def step_time(model: TransformerSpec, cluster: Cluster, layout: Layout, global_batch: int,
              mfu: float = MFU) -> dict[str, float]:
    """Seconds per step and its parts (compute, bubble, exposed dp / tp / pp communication)."""
    dp, tp, pp, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m = global_batch // (dp * b)
    act_bytes = ACTIVATION_BYTES[layout.precision]
    peak = cluster.peak_flops if layout.precision == "bf16" else cluster.peak_flops_fp32
    tokens = global_batch * model.seq
    compute = model.flops_per_token(layout.checkpointing) * tokens / layout.gpus / (peak * mfu)
    per_micro = compute / m
    bubble = (pp - 1) * per_micro  # Narayanan et al. 2021: bubble fraction (p - 1) / m of the ideal time
    stage_layers = model.layers // pp
    # tensor parallel: 2 all-reduces forward and 2 backward per layer (Megatron), 2 more when the forward is replayed
    tp_comm = 0.0
    if tp > 1:
        count = 4 + (2 if layout.checkpointing == "full" else 0)
        size = b * model.seq * model.hidden * act_bytes
        tp_comm = m * stage_layers * count * cluster.intra_link().predict("all_reduce", size, tp)
    pp_comm = 0.0
    if pp > 1:  # an activation forward and its gradient back, per micro-batch on the critical path
        link = cluster.inter_link() if dp * tp >= cluster.gpus_per_node else cluster.intra_link()
        size = b * model.seq * model.hidden * act_bytes / (tp if tp > 1 else 1)
        pp_comm = 2 * (m + pp - 1) * link.predict("send_recv", size, 2)
    dp_comm, dp_exposed, where = _dp_time(model, cluster, layout, per_micro, m)
    ep_comm = ep_time(model, cluster, layout, m)
    step = compute + bubble + tp_comm + pp_comm + ep_comm + dp_exposed
    achieved = model.model_flops_per_token() * tokens / (step * layout.gpus * peak)
    return {"compute_s": compute, "bubble_s": bubble, "tp_comm_s": tp_comm, "pp_comm_s": pp_comm,
            "ep_comm_s": ep_comm, "dp_comm_s": dp_comm, "dp_exposed_s": dp_exposed, "step_s": step, "dp_link": where,
            "tokens_per_s": tokens / step, "mfu": achieved}


def _dp_time(model: TransformerSpec, cluster: Cluster, layout: Layout, per_micro: float,
             m: int) -> tuple[float, float, str]:
    """The data-parallel collectives' time, and how much of it is exposed."""
    dp = layout.dp
    if dp == 1:
        return 0.0, 0.0, "none"
    link, where = _dp_link(cluster, layout)
    p_bytes, g_bytes, _ = STATE_BYTES[layout.precision]
    expert = model.layers // layout.pp * model.expert_parameters(layout.tp, layout.ep)
    # the dense weights over all dp ranks, the experts over the dp / ep ranks holding the same ones
    groups = [(max(_stage_parameters(model, layout)) - expert, dp), (expert, dp // layout.ep)]
    groups = [(psi, n) for psi, n in groups if psi and n > 1]
    if layout.zero == 3:  # per micro-batch: gather for forward and backward, reduce-scatter the gradients
        per = sum(2 * link.predict("all_gather", psi * p_bytes, n) + link.predict("reduce_scatter", psi * g_bytes, n)
                  for psi, n in groups)
        return m * per, m * max(0.0, per - per_micro), where
    if layout.zero == 2:  # reduce-scatter the gradients, all-gather the updated parameters
        comm = sum(link.predict("reduce_scatter", psi * g_bytes, n) + link.predict("all_gather", psi * p_bytes, n)
                   for psi, n in groups)
    else:
        comm = sum(link.predict("all_reduce", psi * g_bytes, n) for psi, n in groups)
    return comm, max(0.0, comm - BACKWARD_SHARE * per_micro), where


# -- the table ------------------------------------------------------------------------------
def evaluate(model: TransformerSpec, cluster: Cluster, layout: Layout, global_batch: int,
             mfu: float = MFU) -> dict[str, Any]:
    """One row: the layout, its memory by kind, whether it fits, and its step time."""
    check_layout(model, cluster, layout, global_batch)
    kinds = memory(model, layout, global_batch)
    peak = sum(kinds.values())
    row: dict[str, Any] = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "zero": layout.zero,
                           "checkpointing": layout.checkpointing, "micro_batch": layout.micro_batch,
                           "micro_batches": global_batch // (layout.dp * layout.micro_batch),
                           "precision": layout.precision, **kinds, "peak_bytes": peak,
                           "feasible": peak <= cluster.gpu_memory_bytes}
    row.update(step_time(model, cluster, layout, global_batch, mfu))
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


def search(model: TransformerSpec, cluster: Cluster, gpus: int, global_batch: int, *, mfu: float = MFU) -> Plan:
    """Every layout of ``gpus`` GPUs, ranked: feasible ones first, then by predicted step time."""
    _check_job(model, cluster, gpus, global_batch, mfu)
    rows = [evaluate(model, cluster, layout, global_batch, mfu)
            for layout in layouts(model, cluster, gpus, global_batch)]
    if not rows:
        raise ValueError(f"gpus={gpus} is invalid for global_batch={global_batch}: no layout divides the batch and "
                         f"the model (try a global batch divisible by the GPU count)")
    # ties in time (a collective hidden either way) go to the layout that needs less memory
    table = pd.DataFrame(rows).sort_values(["feasible", "step_s", "peak_bytes"], ascending=[False, True, True],
                                           kind="stable")
    table = table.reset_index(drop=True)
    table.insert(0, "rank", range(1, len(table) + 1))
    return Plan(model, cluster, gpus, global_batch, table, assumptions(model, cluster, gpus, global_batch, mfu))


def _check_job(model: TransformerSpec, cluster: Cluster, gpus: Any, global_batch: Any, mfu: Any) -> None:
    _positive_int("gpus", gpus)
    _positive_int("global_batch", global_batch)
    if not (isinstance(mfu, (int, float)) and math.isfinite(mfu) and 0 < mfu <= 1):
        raise ValueError(f"mfu={mfu!r} is invalid: a fraction of the peak FLOPs in (0, 1]")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise ValueError(f"gpus={gpus} is invalid: beyond one node, whole nodes of {cluster.gpus_per_node} GPUs")


def assumptions(model: TransformerSpec, cluster: Cluster, gpus: int, global_batch: int, mfu: float = MFU) -> list[str]:
    """What every number of the plan rests on, one sentence each."""
    nodes = max(1, gpus // cluster.gpus_per_node)
    return [
        "PROJECTION: arithmetic on published figures, not a measurement; nothing here ran on this cluster.",
        *model.assumptions(),
        f"cluster: {nodes} node(s) x {min(gpus, cluster.gpus_per_node)} GPU(s). {cluster.describe()}",
        f"cluster figures: {cluster.source}",
        f"global batch {global_batch} sequences of {model.seq} tokens; Adam; layouts dp x tp x pp = {gpus}, "
        "tp inside a node (Megatron rank order: tp, then dp, then pp)",
        f"compute: training FLOPs / (peak x MFU), MFU = {mfu:.2f} for every layout (Llama 3 reports 38-43% BF16 "
        "MFU, arXiv 2407.21783 Table 4); fp32 runs on the fp32 peak (no TF32); full recomputation adds a forward, "
        "selective the attention core's; the optimizer step and data loading are not counted",
        "pipeline: 1F1B; bubble (pp - 1) x one micro-batch's compute (Narayanan et al. 2021); each micro-batch's "
        "activation and its gradient cross a stage boundary on the critical path, not overlapped",
        "tensor parallel: 2 all-reduces of b x s x h activations forward, 2 backward per layer (Megatron-LM), 2 more "
        "when the forward is recomputed, on NVLink, none overlapped; sequence parallelism whenever tp > 1 (the "
        "same ring volume)",
        *ep_assumptions(model),
        "data parallel: ring collectives on NVLink when the group fits in a node, else on the NICs of the group's "
        "GPUs on each node; ZeRO 0-1 all-reduce the gradients, ZeRO 2 reduce-scatters them and all-gathers the "
        "parameters, both overlapping the last micro-batch's backward; ZeRO 3 (FSDP) gathers every micro-batch's "
        "parameters twice and reduce-scatters its gradients, overlapping that micro-batch's compute",
        "memory: ZeRO's 2 + 2 + 12 bytes per parameter in bf16 mixed precision (4 + 4 + 8 in fp32), sharded by "
        "stage; activations after Korthikanti et al. 2022 on the stage that holds the most; nothing counted for the "
        "CUDA context, the allocator's fragmentation or library workspaces: leave headroom under the line",
    ]
