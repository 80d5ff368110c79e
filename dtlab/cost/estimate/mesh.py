"""Memory rule of the ``nd`` tier (pipeline x FSDP2 x tensor parallel on a pp x dp x tp mesh).

Same signature as ``memory.RULES``' rules. Each rank (stage p, row d, column t) is rebuilt from the pieces
the other rules already use: the model localized as tensor-parallel rank t of tp (``tensor_parallel.localize``:
its local widths, collectives as hooks), cut into pp stages as the tier cuts it (``pipeline.split_model``),
stage p's parameters split again by FSDP2's rows over dp, and stage p's forward run on the micro-batches a
schedule keeps in flight on it (``memory.pipelined``'s rule), each of the row's share of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.core.config import RunConfig
from dtlab.cost.estimate import activations as acts
from dtlab.cost.estimate.rank import ADAM_STEP_BYTES, RankMemory, nbytes
from dtlab.cost.estimate.sharded import local_rows, shard_rows
from dtlab.cost.estimate.tensor_parallel import _split, localize
from dtlab.tiers import nd as nd_tier
from dtlab.tiers import pipeline

__all__ = ["RULES", "nd", "stage_activations"]


def in_flight(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: GPipe all, 1F1B at most stages - stage."""
    return microbatches if schedule == "gpipe" else min(microbatches, stages - stage)


def stage_activations(cfg: RunConfig, s: acts.Shapes, column: int) -> list[tuple[list[torch.Tensor], int]]:
    """Per stage, tensor-parallel rank ``column``'s local parameters and what it saves for backward."""
    o = cfg.tier_options
    mode = FakeTensorMode()
    local = localize(acts.fake_model(cfg, s, mode), nd_tier.tp_options(o), o.tp, column, mode)
    stages = pipeline.split_model(local, o.pp, cfg.model_depth)
    if o.sequence_parallel:  # the first stage splits the sequence where its blocks start (nd.stage_plan)
        stages[0].blocks.register_forward_pre_hook(lambda _, a: (_split(a[0], 1, o.tp, column), *a[1:]))
    x, y = acts.batch(s, cfg.global_batch_size // o.dp, mode)  # a row's share, cut into micro-batches
    with mode:
        xs, ys = list(x.chunk(o.microbatches)), list(y.chunk(o.microbatches))
    out = []
    for p, stage in enumerate(stages):
        flight = in_flight(o.schedule, o.microbatches, o.pp, p)
        if p:  # a later stage's input arrives in a fresh buffer per micro-batch, as a leaf
            with mode:
                xs = [t.detach().clone().requires_grad_() for t in xs]
        last = p == o.pp - 1
        saved, xs = acts.forward_saved(cfg, mode, stage, xs[:flight], ys[:flight] if last else None)
        out.append((list(stage.parameters()), saved))
    return out


def _gathered(stage_params: list[torch.Tensor]) -> int:
    # With M > 1 the pipeline keeps each unit gathered from its first backward to its last (FSDP2's
    # reshard_after_backward is off until the last micro-batch): at the peak the whole stage is whole.
    return sum(nbytes(p) for p in stage_params)


def nd(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """nd: rank (p, d, t) holds FSDP2's rows over dp of tensor-parallel rank t's slices of stage p."""
    o = cfg.tier_options
    notes = [f"a {o.pp} x {o.dp} x {o.tp} mesh (pp x dp x tp): the model localized for each tp rank, cut into "
             f"{o.pp} stages, each local parameter split by FSDP2 into ceil(rows / dp) padded rows (parameters, "
             "gradients); the optimizer's moments take the unpadded rows",
             f"activations: {o.schedule}'s micro-batches in flight on each stage, each of "
             f"{cfg.global_batch_size // o.dp // o.microbatches} samples (a row's share cut in {o.microbatches})",
             "comm_buffers: not measured by the tier; predicted as the stage's local parameters all whole"]
    columns = [stage_activations(cfg, s, t) for t in range(o.tp)]
    out = []
    for rank in range(cfg.world_size):
        p, d, t = nd_tier.coordinates(rank, o)
        params, saved = columns[t][p]
        shard = sum(shard_rows(q, o.dp) for q in params)
        state = 0 if cfg.optimizer != "adam" else sum(
            2 * local_rows(q, o.dp, d) + ADAM_STEP_BYTES for q in params)
        memory = {"parameters": shard, "gradients": shard, "optimizer_state": state, "activations": saved,
                  "comm_buffers": _gathered(params)}
        out.append(RankMemory(rank, memory, notes))
    return out


RULES: dict[str, Callable[..., list[RankMemory]]] = {"nd": nd}
