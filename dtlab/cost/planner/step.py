"""A layout's step time, from first principles: the roofline's compute, each strategy's exposed communication,
the pipeline's bubble, and the optimizer.

1. **compute**: the ops of one micro-batch on each pipeline stage (``planner.ops``) timed on the cluster's
   GPU (``roofline.compute_time``): forward, input-gradient backward, weight-gradient backward and
   recomputation apart (``overlap.Phases``).
2. **per micro-batch**, each stage adds the tensor-parallel and context-parallel communication the compute
   leaves exposed (``planner.overlap``) and expert parallelism's all-to-alls (``planner.experts``).
3. **the pipeline**: ``m`` micro-batches at the slowest stage's pace, plus the schedule's bubble
   (Narayanan et al. 2021; Qi et al. 2023 for zero bubble), where ``t`` is one micro-batch on a stage:

   * GPipe and 1F1B: ``(pp - 1) x t``;
   * interleaved with ``v`` chunks per GPU: ``(pp - 1) / v x t``;
   * zero bubble (ZB-H1): ``(pp - 1) x (t_F + t_B - t_W)``, the weight gradients ``t_W`` filling the rest;

   and each micro-batch's activation and gradient crossing a stage boundary (``2 (m v + pp - 1)``
   sends, on NVLink or a NIC, not overlapped: the schedule waits on them).
4. **data parallel**: the gradient reduction (or ZeRO's collectives) less what the backward hides.
5. **the optimizer**: Adam over the GPU's shard of the parameters, memory-bound.

MFU and HFU come out of the step time: model FLOPs (6N plus attention, PaLM's count) and hardware FLOPs
(recomputation counted, as Megatron-LM counts it) over the step, the GPUs and the dtype's peak. They are
reported apart, never mixed; no utilisation is assumed anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dtlab.cost.planner.clusters import Cluster
from dtlab.cost.planner.experts import ep_time
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.memory import stage_parameters
from dtlab.cost.planner.network import group, seconds
from dtlab.cost.planner.ops import dtype_of, optimizer_ops, stage_ops, value_bytes
from dtlab.cost.planner.overlap import Phases, cp_exposed, dp_exposed, tp_exposed
from dtlab.cost.planner.transformer import TransformerSpec
from dtlab.cost.roofline import devices
from dtlab.cost.roofline.model import Device, compute_time

__all__ = ["bubble", "phases", "step_time"]


_PHASES: dict[tuple[Any, ...], tuple[Device, Phases]] = {}  # a search times each stage once, not per dp and ZeRO


def phases(model: TransformerSpec, layout: Layout, device: Device, *, first: bool, last: bool) -> Phases:
    """The roofline's seconds for one micro-batch on a stage, by phase (the ops do not depend on dp or ZeRO)."""
    # the fitted constants are part of the key: a fit times the same stage at several values
    key = (id(device), tuple(sorted(devices.SUSTAINED.items())), model, dataclasses.replace(layout, dp=1, zero=0),
           first, last)
    if key in _PHASES and _PHASES[key][0] is device:
        return _PHASES[key][1]
    if len(_PHASES) > 4096:
        _PHASES.clear()
    timed = _phases(model, layout, device, first=first, last=last)
    _PHASES[key] = (device, timed)
    return timed


def _phases(model: TransformerSpec, layout: Layout, device: Device, *, first: bool, last: bool) -> Phases:
    stage = stage_ops(model, layout, first=first, last=last)
    timed = {name: compute_time(part, device) for name, part in
             (("forward", stage.forward), ("backward", stage.backward), ("weight", stage.weight),
              ("recompute", stage.recompute))}
    return Phases(timed["forward"].seconds, timed["backward"].seconds, timed["weight"].seconds,
                  timed["recompute"].seconds, timed["forward"].by_op.get("attention", 0.0),
                  timed["backward"].by_op.get("attention.bwd", 0.0))


def bubble(layout: Layout, forward: float, backward: float, weight: float) -> float:
    """Seconds of the pipeline's bubble for one micro-batch's ``forward``, input-gradient ``backward`` (with any
    recomputation) and ``weight``-gradient seconds on a stage."""
    if layout.pp == 1:
        return 0.0
    if layout.schedule == "zero_bubble":
        return (layout.pp - 1) * max(0.0, forward + backward - weight)
    per = forward + backward + weight
    return (layout.pp - 1) * per / (layout.interleave if layout.schedule == "interleaved" else 1)


def _stage(model: TransformerSpec, cluster: Cluster, layout: Layout, micro_batches: int, *, first: bool,
           last: bool) -> dict[str, Any]:
    """One micro-batch on a stage: its phases and the communication it leaves exposed."""
    p = phases(model, layout, cluster.device, first=first, last=last)
    tp_f, tp_b = tp_exposed(model, cluster, layout, p)
    cp_f, cp_b = cp_exposed(model, cluster, layout, p)
    ep = ep_time(model, cluster, layout, micro_batches) / micro_batches
    forward = p.forward + tp_f + cp_f + ep / 2
    backward = p.backward + p.recompute + tp_b + cp_b + ep / 2
    return {"phases": p, "forward": forward, "backward": backward, "weight": p.weight,
            "total": forward + backward + p.weight, "tp": tp_f + tp_b, "cp": cp_f + cp_b, "ep": ep}


def _pipeline_comm(model: TransformerSpec, cluster: Cluster, layout: Layout, micro_batches: int) -> float:
    if layout.pp == 1:
        return 0.0
    size = (layout.micro_batch * model.seq // layout.cp * model.hidden * value_bytes(layout.precision)
            / layout.tp)  # Megatron's scatter/gather: each tp rank sends its share of the activation
    g = group(cluster, layout.pp, layout.tp * layout.cp * layout.dp)
    sends = 2 * (micro_batches * layout.interleave + layout.pp - 1)
    return sends * seconds(cluster, "send_recv", size, g)


def _optimizer_seconds(model: TransformerSpec, layout: Layout, device: Device) -> float:
    local = max(stage_parameters(model, layout)) / (layout.dp if layout.zero >= 1 else 1)
    return compute_time(optimizer_ops(local, layout.precision), device).seconds


def step_time(model: TransformerSpec, cluster: Cluster, layout: Layout, global_batch: int) -> dict[str, Any]:
    """Seconds per step and its parts, tokens per second, MFU and HFU, for a checked layout."""
    m = layout.micro_batches(global_batch)
    stages = [_stage(model, cluster, layout, m, first=True, last=layout.pp == 1)]
    if layout.pp > 1:
        stages.append(_stage(model, cluster, layout, m, first=False, last=True))
    slow = max(stages, key=lambda s: s["total"])
    p: Phases = slow["phases"]
    pipe_bubble = bubble(layout, slow["forward"], slow["backward"], slow["weight"])
    pp_comm = _pipeline_comm(model, cluster, layout, m)
    dp_total, dp_hidden_not = dp_exposed(model, cluster, layout, p, m)
    optimizer = _optimizer_seconds(model, layout, cluster.device)
    step = m * slow["total"] + pipe_bubble + pp_comm + dp_hidden_not + optimizer
    tokens = global_batch * model.seq
    dtype = dtype_of(layout.precision)
    peak = cluster.device.peak(dtype) * layout.gpus
    where = group(cluster, layout.dp * layout.cp, layout.tp).where
    return {"compute_s": m * p.total, "bubble_s": pipe_bubble, "tp_comm_s": m * slow["tp"],
            "cp_comm_s": m * slow["cp"], "pp_comm_s": pp_comm, "ep_comm_s": m * slow["ep"], "dp_comm_s": dp_total,
            "dp_exposed_s": dp_hidden_not, "optimizer_s": optimizer, "step_s": step, "dp_link": where,
            "tokens_per_s": tokens / step, "mfu": model.model_flops_per_token() * tokens / (step * peak),
            "hfu": model.flops_per_token(layout.checkpointing) * tokens / (step * peak)}
