"""Memory per GPU of a layout, by the kinds ``dtlab.estimate`` uses, on the stage that needs the most.

* parameters, gradients, optimizer_state: Rajbhandari et al. 2020, "ZeRO" (sec. 3, 5): mixed precision
  keeps 2 + 2 bytes per parameter (bf16 weights and gradients) and K = 12 for Adam (fp32 master
  weights, momentum, variance); fp32 training 4 + 4 and K = 8. Stage 1 shards the optimizer state over
  the dp data-parallel ranks (not over the context-parallel ones, which Megatron-LM also shards over:
  a bound from above), stage 2 the gradients too, stage 3 the parameters too.
* activations: ``TransformerSpec.activation_bytes`` (Korthikanti et al. 2022) per layer, divided by cp
  (each rank holds its share of the sequence), times the stage's layers, times the micro-batches in
  flight: 1F1B and zero bubble keep pp on the first stage (Narayanan et al. 2021), the interleaved
  schedule ``pp (1 + (pp - 1) / (pp v))`` (Korthikanti et al. 2022, sec. 4.2.3), GPipe all of them.
* comm_buffers: stages 0-2: two gradient buckets (one reducing, one filling); stage 3: two layers'
  gathered parameters (one computing, one prefetched) and one layer's gathered gradients; a pipeline's
  send and receive buffers; expert parallelism's all-to-all send and receive buffers.
"""

from __future__ import annotations

from dtlab.cost.planner.experts import all_to_all_bytes, per_gpu
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.transformer import TransformerSpec

__all__ = ["ACTIVATION_BYTES", "BUCKET_BYTES", "STATE_BYTES", "memory", "stage_parameters"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
# bytes per parameter: weights, gradients, optimizer state (ZeRO's K), per precision
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}


def stage_parameters(model: TransformerSpec, layout: Layout) -> tuple[int, int]:
    """Parameters per GPU on the first and on the last pipeline stage (the same stage when pp = 1)."""
    layers = layout.stage_layers(model.layers) * model.layer_parameters(layout.tp, layout.ep)
    first = layers + model.embedding_parameters(layout.tp)
    last = layers + model.head_parameters(layout.tp)
    if layout.pp == 1:
        return first + model.head_parameters(layout.tp), first + model.head_parameters(layout.tp)
    return first, last


def _in_flight(layout: Layout, micro_batches: int, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak (stage 0: the first, 1: the last)."""
    pp = layout.pp
    if pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return micro_batches
    held = min(micro_batches, pp - stage * (pp - 1))
    if layout.schedule == "interleaved" and stage == 0:
        return held * (1 + (pp - 1) / (pp * layout.interleave))
    return held


def memory(model: TransformerSpec, layout: Layout, global_batch: int) -> dict[str, float]:
    """Bytes per GPU by kind, on the stage whose total is largest."""
    p_bytes, g_bytes, o_bytes = STATE_BYTES[layout.precision]
    act_bytes = ACTIVATION_BYTES[layout.precision]
    dp, tp, pp, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m = layout.micro_batches(global_batch)
    sp = tp > 1  # sequence parallelism whenever tensor parallelism: Megatron's recommended setting
    per_layer = model.activation_bytes(b, tp, sp, layout.checkpointing, act_bytes) / layout.cp
    stage_layers = layout.stage_layers(model.layers)
    layer_params = model.layer_parameters(tp, layout.ep)
    expert = stage_layers * model.expert_parameters(tp, layout.ep)  # data-parallel over dp / ep ranks only
    stages = []
    for index, psi in enumerate(stage_parameters(model, layout)):
        acts = _in_flight(layout, m, index) * stage_layers * per_layer
        if index == 1 or pp == 1:
            acts += model.output_activation_bytes(b, tp, act_bytes) / layout.cp
        shares = (psi - expert, expert, layout)  # ZeRO shards the experts over dp / ep ranks
        kinds = {"parameters": per_gpu(*shares, p_bytes, 3), "gradients": per_gpu(*shares, g_bytes, 2),
                 "optimizer_state": per_gpu(*shares, o_bytes, 1), "activations": acts, "comm_buffers": 0.0}
        if dp > 1 and layout.zero >= 3:
            kinds["comm_buffers"] = layer_params * (2 * p_bytes + g_bytes)
        elif dp > 1:
            kinds["comm_buffers"] = 2 * min(BUCKET_BYTES, psi * g_bytes)
        if pp > 1:
            kinds["comm_buffers"] += 2 * model.seq * b * model.hidden * act_bytes / (tp if sp else 1) / layout.cp
        if layout.ep > 1:
            kinds["comm_buffers"] += 2 * all_to_all_bytes(model, layout)
        stages.append(kinds)
    return max(stages, key=lambda k: sum(k.values()))
