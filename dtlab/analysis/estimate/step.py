"""A step's time, predicted: one rank's compute (timed here) plus each tier's communication on a link.

The link is an alpha-beta ``LinkModel`` (``dtlab.analysis.costmodel``): calibrated
on a collectives sweep, or built from a bandwidth and latency for a what-if. Per tier:

* ``single``: data + forward + backward + optimizer.
* ``ddp``, ``multinode``, ``elastic``: DDP's buckets (torch's own assignment by size)
  all-reduced one after another as backward produces them (``predict_ddp_step``);
  what runs past backward is exposed. DDP's own work: copying each gradient into its
  bucket and back, and the division by n, three passes over the gradient bytes at this
  machine's copy speed (one with ``gradient_as_bucket_view``).
* ``zero``: DDP, plus one broadcast per parameter from the rank that updated it; the
  optimizer steps only the largest rank's share of the parameters.
* ``fsdp``: each unit's all-gather before its forward and again before its backward
  (``reshard_after_forward``), and its reduce-scatter after; on CPU FSDP2 runs its
  collectives in the training thread, so all of it is exposed.
* ``pipeline``: per stage and micro-batch, forward + backward + its transfers; GPipe
  and 1F1B take (M - 1) x the slowest stage + the sum of the stages (the bubble is the
  same for both), ``naive`` takes M x the sum.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dtlab.analysis.costmodel.links import LinkModel
from dtlab.analysis.costmodel.step import predict_ddp_step
from dtlab.analysis.estimate import compute
from dtlab.analysis.estimate.memory import fsdp_units, nbytes, shard_rows, zero_partition
from dtlab.core.config import RunConfig

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket is capped at 1 MiB (torch.distributed's default)
STEP_TIERS = ("single", "ddp", "multinode", "elastic", "zero", "fsdp", "pipeline")


def ddp_buckets(model: nn.Module, cap_mb: float) -> list[int]:
    """Bucket sizes in gradient-ready order, from torch's own assignment over the parameters in reverse."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    groups, _ = dist._compute_bucket_assignment_by_size(
        params, [FIRST_BUCKET_BYTES, int(cap_mb * 2**20)], [False] * len(params), list(range(len(params))))
    return [sum(nbytes(params[i]) for i in g) for g in groups]


def predict(cfg: RunConfig, model: nn.Module, link: LinkModel) -> tuple[float, list[str]]:
    """Seconds per step and the assumptions behind them; ValueError naming a tier without a rule."""
    if cfg.tier not in STEP_TIERS:
        raise ValueError(f"estimate: no step-time rule for tier {cfg.tier!r} yet (rules: {', '.join(STEP_TIERS)})")
    n = cfg.world_size
    notes = [f"compute timed in this process with {cfg.resolved_threads} thread(s), as one rank of the job gets; "
             f"link: {link.label}"]
    if cfg.tier == "pipeline":
        return pipelined(cfg, link, notes)
    acc = int(getattr(cfg.tier_options, "accumulation_steps", 1) or 1)
    ph = compute.phases(cfg, cfg.per_rank_batch // acc)
    ph = {k: v * acc if k in ("forward", "backward") else v for k, v in ph.items()}
    if cfg.tier == "single" or n == 1 and cfg.tier == "fsdp":
        return sum(ph.values()), notes
    grad_bytes = sum(nbytes(p) for p in model.parameters())
    if cfg.tier == "fsdp":
        return sharded(cfg, model, link, ph, notes)
    passes = 1 if getattr(cfg.tier_options, "gradient_as_bucket_view", False) else 3
    overhead = passes * grad_bytes * compute.copy_seconds_per_byte()
    buckets = ddp_buckets(model, cfg.tier_options.bucket_cap_mb)
    notes.append(f"{len(buckets)} DDP bucket(s); DDP's own copies: {passes} pass(es) over the gradients")
    step = predict_ddp_step(ph, buckets, link, n, overhead_s=overhead).step_s
    if cfg.tier == "zero":
        params = list(model.parameters())
        share = max(sum(p.numel() for p in part) for part in zero_partition(params, n)) / sum(p.numel() for p in params)
        step -= ph["optimizer"] * (1 - share)
        step += sum(link.predict("broadcast", nbytes(p), n) for p in params)
        notes.append(f"ZeRO: the optimizer steps {share:.0%} of the parameters; one broadcast per parameter")
    return step, notes


def sharded(cfg: RunConfig, model: nn.Module, link: LinkModel, ph: dict[str, float],
            notes: list[str]) -> tuple[float, list[str]]:
    """FSDP2 on CPU: compute, the optimizer on a 1/n shard, and every all-gather and reduce-scatter exposed."""
    n = cfg.world_size
    again = getattr(cfg.tier_options, "reshard_after_forward", True)
    comm = 0.0
    units = fsdp_units(model)
    for i, unit in enumerate(units):
        full = sum(shard_rows(p, n) for p in unit) * n  # the padded unsharded unit, as the all-gather moves it
        gathers = 2 if again and i < len(units) - 1 else 1  # the root stays gathered for backward
        comm += gathers * link.predict("all_gather", full, n) + link.predict("reduce_scatter", full, n)
    notes.append("FSDP2: all-gather per unit before forward and again before backward (not the root), "
                 "reduce-scatter per unit; all exposed on CPU")
    return ph["data"] + ph["forward"] + ph["backward"] + ph["optimizer"] / n + comm, notes


def pipelined(cfg: RunConfig, link: LinkModel, notes: list[str]) -> tuple[float, list[str]]:
    m = cfg.tier_options.microbatches
    stages = compute.stage_phases(cfg)
    costs = []
    for s, st in enumerate(stages):
        sends = st["out_bytes"]  # forward: the activation out; backward: its gradient back in
        received = stages[s - 1]["out_bytes"] if s else 0.0
        p2p = sum(2 * link.predict("send_recv", b, 2) for b in (sends, received) if b)
        costs.append(st["forward"] + st["backward"] + p2p)
    if cfg.tier_options.schedule == "naive":
        body = m * sum(costs)
    else:
        body = (m - 1) * max(costs) + sum(costs)
    notes.append(f"pipeline: {len(stages)} stages, {m} micro-batches, {cfg.tier_options.schedule}")
    return body + max(st["optimizer"] for st in stages), notes

