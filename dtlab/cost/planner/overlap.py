"""What each strategy's communication costs a step once the compute it can hide behind is taken off.

Per micro-batch on one stage (``Phases``: the roofline's seconds for its forward, input-gradient
backward, weight-gradient backward and recomputation, and the attention kernels inside them):

* **tensor parallel** (``tp_exposed``): with sequence parallelism a block's forward runs an
  all-gather before and a reduce-scatter after each of attention and the MLP (Korthikanti et al.
  2022), on the micro-batch's ``T x h`` activations inside the node; the forward ones sit on the
  critical path, the backward ones overlap the weight-gradient GEMMs (Megatron-LM runs them
  asynchronously), a replayed forward adds its own.
* **context parallel** (``cp_exposed``): a ring passes each rank's K and V chunk ``cp - 1`` times
  while the attention works on the chunk it holds (Liu et al. 2023, ring attention); backward passes
  K, V and their gradients. Only what the attention kernels cannot cover is exposed.
* **data parallel** (``dp_exposed``): ZeRO 0 all-reduces the gradients, ZeRO 1-2 reduce-scatter them
  and all-gather the updated parameters; the reduction runs bucket by bucket under the last
  micro-batch's backward, so only the last bucket and what the backward cannot cover are exposed; the
  gather is prefetched under the next forward the same way. ZeRO 3 (FSDP) gathers each layer's
  parameters for forward and again for backward and reduce-scatters its gradients, every micro-batch,
  the next layer's prefetched while this one computes: exposed is the first gather and, layer by
  layer, what the collective takes beyond the layer's compute. Gradients are reduced in fp32
  (Megatron-LM's default for bf16 training; Llama 3, sec. 3.3.2, does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.cost.planner.clusters import Cluster
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.memory import BUCKET_BYTES, STATE_BYTES, stage_parameters
from dtlab.cost.planner.network import Group, group, seconds
from dtlab.cost.planner.ops import value_bytes
from dtlab.cost.planner.transformer import TransformerSpec

__all__ = ["GRAD_REDUCE_BYTES", "Phases", "cp_exposed", "dp_exposed", "tp_exposed"]

GRAD_REDUCE_BYTES = 4


@dataclass(frozen=True)
class Phases:
    """Seconds of one micro-batch on one stage, by phase."""

    forward: float
    backward: float
    weight: float
    recompute: float
    attention_forward: float
    attention_backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.weight + self.recompute


def tp_exposed(model: TransformerSpec, cluster: Cluster, layout: Layout, phases: Phases) -> tuple[float, float]:
    """(forward, backward) seconds of tensor-parallel collectives one micro-batch leaves exposed on a stage."""
    if layout.tp == 1:
        return 0.0, 0.0
    size = layout.micro_batch * model.seq // layout.cp * model.hidden * value_bytes(layout.precision)
    tp = group(cluster, layout.tp)
    per_layer = 2 * (seconds(cluster, "all_gather", size, tp) +
                     seconds(cluster, "reduce_scatter", size, tp))
    layers = layout.stage_layers(model.layers)
    forward = layers * per_layer * (2 if layout.checkpointing == "full" else 1)
    backward = max(0.0, layers * per_layer - phases.weight)
    return forward, backward


def cp_exposed(model: TransformerSpec, cluster: Cluster, layout: Layout, phases: Phases) -> tuple[float, float]:
    """(forward, backward) seconds of the context-parallel ring one micro-batch leaves exposed on a stage."""
    if layout.cp == 1:
        return 0.0, 0.0
    chunk = (layout.micro_batch * model.seq // layout.cp * 2 * model.kv_dim // layout.tp
             * value_bytes(layout.precision))
    ring = group(cluster, layout.cp, layout.tp)
    per_layer = (layout.cp - 1) * seconds(cluster, "send_recv", chunk, ring)
    layers = layout.stage_layers(model.layers)
    forward = max(0.0, layers * per_layer - phases.attention_forward)
    if layout.checkpointing != "none":  # the replayed attention passes the chunks again
        forward *= 2
    backward = max(0.0, 2 * layers * per_layer - phases.attention_backward)
    return forward, backward


def _groups(model: TransformerSpec, layout: Layout) -> list[tuple[float, int]]:
    """(parameters, ranks) a stage's gradients are reduced over: dense weights over dp x cp, experts over the
    dp / ep ranks holding the same ones."""
    expert = layout.stage_layers(model.layers) * model.expert_parameters(layout.tp, layout.ep)
    dense = max(stage_parameters(model, layout)) - expert
    found = [(float(dense), layout.dp * layout.cp), (float(expert), layout.dp // layout.ep * layout.cp)]
    return [(psi, n) for psi, n in found if psi and n > 1]


def _hidden(total: float, covered: float, nbytes: float) -> float:
    """A bucketed collective of ``total`` seconds under ``covered`` seconds of compute: its last bucket and
    whatever the compute cannot cover stay exposed."""
    last = total * min(1.0, BUCKET_BYTES / nbytes) if nbytes else 0.0
    return max(last, total - covered)


def dp_exposed(model: TransformerSpec, cluster: Cluster, layout: Layout, phases: Phases,
               micro_batches: int) -> tuple[float, float]:
    """(total, exposed) seconds of the data-parallel collectives of one step."""
    p_bytes = STATE_BYTES[layout.precision][0]
    g_bytes = GRAD_REDUCE_BYTES if layout.precision == "bf16" else STATE_BYTES["fp32"][1]
    total = exposed = 0.0
    for psi, n in _groups(model, layout):
        g = group(cluster, n, layout.tp)
        if layout.zero == 3:
            total_mb, exposed_mb = _fsdp(model, cluster, layout, phases, psi, g)
            total += micro_batches * total_mb
            exposed += micro_batches * exposed_mb
            continue
        backward = phases.backward + phases.weight + phases.recompute
        if layout.zero == 0:
            reduce = seconds(cluster, "all_reduce", psi * g_bytes, g)
            total += reduce
            exposed += _hidden(reduce, backward, psi * g_bytes)
        else:
            reduce = seconds(cluster, "reduce_scatter", psi * g_bytes, g)
            gather = seconds(cluster, "all_gather", psi * p_bytes, g)
            total += reduce + gather
            exposed += _hidden(reduce, backward, psi * g_bytes) + _hidden(gather, phases.forward, psi * p_bytes)
    return total, exposed


def _fsdp(model: TransformerSpec, cluster: Cluster, layout: Layout, phases: Phases, psi: float,
          g: Group) -> tuple[float, float]:
    """(total, exposed) seconds of one micro-batch's gathers and reduce-scatters, layer by layer."""
    p_bytes = STATE_BYTES[layout.precision][0]
    g_bytes = GRAD_REDUCE_BYTES if layout.precision == "bf16" else STATE_BYTES["fp32"][1]
    layers = layout.stage_layers(model.layers)
    layer = psi / layers
    gather = seconds(cluster, "all_gather", layer * p_bytes, g)
    scatter = seconds(cluster, "reduce_scatter", layer * g_bytes, g)
    forward = phases.forward / layers
    backward = (phases.backward + phases.weight + phases.recompute) / layers
    total = layers * (2 * gather + scatter)
    exposed = gather + layers * (max(0.0, gather - forward) + max(0.0, gather + scatter - backward))
    return total, exposed
