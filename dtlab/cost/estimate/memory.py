"""Bytes per rank by kind, predicted for a job without starting it.

Kinds are the measured side's (``RankResult.memory``): ``parameters``,
``gradients``, ``optimizer_state``, ``activations`` (what the forward saves for
backward, at its peak: under a pipeline schedule, every micro-batch in flight on
a stage) and ``comm_buffers`` (DDP's bucket buffers; FSDP's all-gathered units
at their peak). Each tier's rule is a few lines, stated in its ``assumptions``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.core.config import RunConfig
from dtlab.core.muon import assign_owners, hidden_matrices
from dtlab.cost.estimate import activations as acts
from dtlab.cost.estimate import pipeline_walk
from dtlab.cost.estimate.experts import RULES as EXPERT_RULES
from dtlab.cost.estimate.mesh import RULES as MESH_RULES
from dtlab.cost.estimate.rank import ADAM_STEP_BYTES, RankMemory, nbytes, optimizer_bytes
from dtlab.cost.estimate.sharded import gathered_peak, local_rows, shard_rows
from dtlab.cost.estimate.tensor_parallel import RULES as TENSOR_PARALLEL_RULES
from dtlab.tiers import pipeline
from dtlab.tiers.parts.pipeline_stages import MULTI_STAGE

DDP_FAMILY = ("ddp", "multinode", "elastic")


def hidden_ids(cfg: RunConfig, model: nn.Module) -> set[int]:
    """The ids of the parameters Muon steps (``muon.hidden_matrices``); none under another optimizer."""
    return {id(p) for p in hidden_matrices(model)} if cfg.optimizer == "muon" else set()


def fsdp_optimizer_bytes(cfg: RunConfig, params: list[torch.Tensor], n: int, rank: int,
                         hidden: Container[int] = frozenset()) -> int:
    """A rank's optimizer state under fsdp: Adam's moments of its rows; Muon's momentum of the whole hidden
    matrices (``hidden``: their ids) it owns (``assign_owners``, as ``dtlab.tiers.parts.fsdp_muon`` deals them) and
    AdamW's of its rows of the rest."""
    if cfg.optimizer == "adam":
        return sum(2 * local_rows(t, n, rank) + ADAM_STEP_BYTES for t in params)
    if cfg.optimizer != "muon":
        return 0
    matrices = [t for t in params if id(t) in hidden]
    owners = assign_owners([t.numel() for t in matrices], n)
    owned = sum(nbytes(t) for t, o in zip(matrices, owners) if o == rank)
    return owned + sum(2 * local_rows(t, n, rank) + ADAM_STEP_BYTES for t in params if id(t) not in hidden)


def zero_partition(params: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """ZeroRedundancyOptimizer's partition: largest first, each to the rank holding the fewest elements."""
    return zero_partition_groups([params], world)


def zero_partition_groups(groups: Sequence[Sequence[torch.Tensor]], world: int) -> list[list[torch.Tensor]]:
    """The partition of several parameter groups: ZeroRedundancyOptimizer deals out one group after the other,
    largest first within each, every parameter to the rank holding the fewest elements so far (of any group)."""
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    sizes = [0] * world
    for group in groups:
        for p in sorted(group, key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            out[rank].append(p)
            sizes[rank] += p.numel()
    return out


def accumulation(cfg: RunConfig) -> int:
    return int(getattr(cfg.tier_options, "accumulation_steps", 1) or 1)


def replicated(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """single, ddp-naive and the DDP family: every rank holds the whole model, its gradients and its state."""
    params = list(model.parameters())
    p = sum(nbytes(t) for t in params)
    micro = cfg.per_rank_batch // accumulation(cfg)
    memory = {"parameters": p, "gradients": p, "optimizer_state": optimizer_bytes(cfg, params, hidden_ids(cfg, model)),
              "activations": acts.activation_bytes(cfg, s, micro), "comm_buffers": 0}
    notes = [f"activations of one micro-batch of {micro} samples (the first step's first, as measured)"]
    opts = cfg.tier_options
    if cfg.tier in (*DDP_FAMILY, "zero") and not getattr(opts, "gradient_as_bucket_view", False):
        memory["comm_buffers"] = p
        notes.append("DDP's reducer keeps flat bucket buffers as large as the gradients "
                     "(gradient_as_bucket_view=True makes the gradients views of them: counted once)")
    return [RankMemory(r, dict(memory), notes) for r in range(cfg.world_size)]


def zero(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """DDP, with Adam's state split by ZeroRedundancyOptimizer's greedy partition of whole parameters."""
    ranks = replicated(cfg, model, s)
    hidden = hidden_ids(cfg, model)
    params = list(model.parameters())
    # as dtlab.tiers.zero builds it: under Muon the hidden matrices' group is dealt out first (muon.param_groups)
    groups = [g for g in ([p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]) if g]
    for r, mine in zip(ranks, zero_partition_groups(groups, cfg.world_size)):
        r.memory["optimizer_state"] = optimizer_bytes(cfg, mine, hidden)
        r.assumptions.append("optimizer state: whole parameters dealt out largest first to the emptiest rank")
    return ranks


def fsdp(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """FSDP2: parameters, gradients and state sharded by rows; one unit per block plus the root. HSDP
    (``replicate`` > 1): sharded over the n = world / replicate ranks of a group, rank r holding shard r % n."""
    n = cfg.world_size // getattr(cfg.tier_options, "replicate", 1)
    params = list(model.parameters())
    shard = sum(shard_rows(t, n) for t in params)
    memory = {"parameters": shard, "gradients": shard, "optimizer_state": 0,
              "activations": acts.activation_bytes(cfg, s, cfg.per_rank_batch),
              "comm_buffers": gathered_peak(cfg, model)}
    notes = [f"parameters and gradients split by rows, padded to ceil(rows / {n}) on every rank; the "
             "optimizer's moments take the unpadded rows (the last ranks may hold fewer)",
             "comm_buffers: the unsharded parameters held at once while the forward runs"]
    if cfg.optimizer == "muon":
        notes.append("Muon: each hidden matrix's momentum whole on the rank that owns it (largest first, to the "
                     "least loaded rank); AdamW's moments of the rows of the rest")
    hidden = hidden_ids(cfg, model)
    return [RankMemory(r, memory | {"optimizer_state": fsdp_optimizer_bytes(cfg, params, n, r % n, hidden)}, notes)
            for r in range(cfg.world_size)]


def pipelined(cfg: RunConfig, model: nn.Module, s: acts.Shapes, mode: FakeTensorMode) -> list[RankMemory]:
    """One stage per rank: its slice of the model, and the activations of every micro-batch the schedule
    keeps in flight on it (their forwards run together, so the batch they all slice counts once)."""
    opts = cfg.tier_options
    if opts.schedule in MULTI_STAGE:  # several stages per rank: its actions walked one by one
        ranks = []
        for rank, params, saved, note in pipeline_walk.per_rank(cfg, model, s, mode):
            p = sum(nbytes(t) for t in params)
            ranks.append(RankMemory(rank, {"parameters": p, "gradients": p, "optimizer_state": optimizer_bytes(
                cfg, params), "activations": saved, "comm_buffers": 0}, [note]))
        return ranks
    m, stages = opts.microbatches, cfg.world_size
    x, y = acts.batch(s, cfg.global_batch_size, mode)
    with mode:
        xs, ys = list(x.chunk(m)), list(y.chunk(m))
    out: list[RankMemory] = []
    for rank, stage in enumerate(pipeline.split_model(model, stages, cfg.model_depth)):
        flight = {"gpipe": m, "1f1b": min(m, stages - rank), "naive": 1}[opts.schedule]
        if rank:  # a later stage's input arrives in a fresh buffer per micro-batch, as a leaf
            with mode:
                xs = [t.detach().clone().requires_grad_() for t in xs]
        last = rank == stages - 1
        saved, xs = acts.forward_saved(cfg, mode, stage, xs[:flight], ys[:flight] if last else None)
        params = list(stage.parameters())
        p = sum(nbytes(t) for t in params)
        memory = {"parameters": p, "gradients": p, "optimizer_state": optimizer_bytes(cfg, params),
                  "activations": saved, "comm_buffers": 0}
        note = f"stage {rank}: {flight} of {m} micro-batches in flight ({opts.schedule})"
        out.append(RankMemory(rank, memory, [note]))
    return out


RULES: dict[str, Callable[..., list[RankMemory]]] = {
    "single": replicated, "ddp-naive": replicated, "ddp": replicated, "multinode": replicated,
    "elastic": replicated, "zero": zero, "fsdp": fsdp, **TENSOR_PARALLEL_RULES, **EXPERT_RULES, **MESH_RULES}


def per_rank(cfg: RunConfig) -> list[RankMemory]:
    """Every rank's predicted memory; raises ValueError naming the tier when it has no rule yet."""
    s = acts.shapes(cfg)
    mode = FakeTensorMode()
    model = acts.fake_model(cfg, s, mode)
    if cfg.tier == "pipeline":
        return pipelined(cfg, model, s, mode)
    if cfg.tier not in RULES:
        known = ", ".join([*RULES, "pipeline"])
        raise ValueError(f"estimate: tier {cfg.tier!r} has no memory rule yet; estimated tiers: {known}")
    return RULES[cfg.tier](cfg, model, s)
