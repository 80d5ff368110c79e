"""Activations of the multi-stage pipeline schedules: each rank's actions walked in order on fake tensors.

With several stages per rank (``interleaved-1f1b``, ``zero-bubble``, ``zbv``, ``dualpipev``)
which micro-batches are in flight on which stage changes action by action, so the rank's own
action list (``pipeline_stages.rank_actions``, torch's) is replayed: a forward (F) saves
what autograd saves for that (stage, micro-batch), its loss too on the last stage; a full
backward (B), or the weight part (W) of a split one, frees it; the input part (I) frees
nothing (W still needs the forward's inputs). The peak over the walk is the prediction,
counted as the run counts it (``core.memory.LiveActivations``): distinct storages, a storage
held by several (the batch the first stage's micro-batches slice; a V-shaped rank's hand-off
from one of its stages to the next, passed detached, not copied) once while any holds it,
the rank's parameters left out. An input from another rank arrives in a fresh buffer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.cost.estimate import activations as acts
from dtlab.tiers.parts.pipeline_stages import placement, rank_actions, split_model
from dtlab.tiers.pipeline import stages_per_rank


class _Held:
    """Saved storages per owner (stage, micro-batch), on fake tensors: ``LiveActivations``'s count."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.skip = {acts.storage_key(t) for t in exclude}
        self.owners: dict[int, tuple[int, set[Any]]] = {}
        self.now = self.peak = 0
        self.current: Any = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = acts.storage_key(t)
        if key not in self.skip:
            if key not in self.owners:
                self.owners[key] = (t.untyped_storage().nbytes(), set())
                self.now += self.owners[key][0]
                self.peak = max(self.peak, self.now)
            self.owners[key][1].add(self.current)
        return t

    def release(self, owner: Any) -> None:
        for key, (nbytes, owners) in list(self.owners.items()):
            owners.discard(owner)
            if not owners:
                del self.owners[key]
                self.now -= nbytes


def _inputs(cfg: RunConfig, stages: list[nn.Module], xs: list[torch.Tensor], mode: FakeTensorMode) -> list[Any]:
    """Each stage's input of micro-batch 0 as a shape template (every micro-batch has the same)."""
    out, x = [], xs[0]
    with mode, torch.no_grad(), acts.autocast(cfg):
        for stage in stages:
            out.append(x)
            x = stage(x)
    return out


def walk_rank(cfg: RunConfig, stages: list[nn.Module], rank: int, mode: FakeTensorMode,
              data: tuple[list[torch.Tensor], list[torch.Tensor]]) -> tuple[int, int]:
    """The peak of saved bytes on ``rank`` over its actions, and how many (stage, micro-batch) it held then."""
    o, world = cfg.tier_options, cfg.world_size
    per = stages_per_rank(o)
    held = placement(o.schedule, world, per)[rank]
    xs, ys = data
    templates = _inputs(cfg, stages, xs, mode)
    counter = _Held([p for s in held for p in stages[s].parameters()])
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    most = flight = 0
    with mode, torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        for stage, kind, mb in rank_actions(o.schedule, world, o.microbatches, per)[rank]:
            if kind in ("B", "W"):
                counter.release((stage, mb))
                flight -= 1
                continue
            if kind != "F":
                continue
            if stage == 0:
                x = xs[mb]
            elif stage - 1 in held:  # the rank's own previous stage hands its output over, detached
                x = outputs.pop((stage - 1, mb)).detach().requires_grad_()
            else:
                x = torch.empty_like(templates[stage]).requires_grad_()
            counter.current, flight = (stage, mb), flight + 1
            with acts.autocast(cfg):
                out = stages[stage](x)
                if stage == len(stages) - 1:
                    out = models.loss(out, ys[mb])
            outputs[(stage, mb)] = out
            if counter.now == counter.peak:
                most = max(most, flight)
    return counter.peak, most


def per_rank(cfg: RunConfig, model: nn.Module, s: acts.Shapes,
             mode: FakeTensorMode) -> list[tuple[int, list[torch.Tensor], int, str]]:
    """Per rank: its parameters (its stages'), its predicted activation peak, and a note saying how it was got."""
    o, world = cfg.tier_options, cfg.world_size
    per = stages_per_rank(o)
    stages = split_model(model, world * per, cfg.model_depth)
    x, y = acts.batch(s, cfg.global_batch_size, mode)
    with mode:
        data = (list(x.chunk(o.microbatches)), list(y.chunk(o.microbatches)))
    out = []
    for rank, held in enumerate(placement(o.schedule, world, per)):
        peak, flight = walk_rank(cfg, stages, rank, mode, data)
        params = [p for i in held for p in stages[i].parameters()]
        out.append((rank, params, peak, f"rank {rank}: stages {held}, up to {flight} (stage, micro-batch) forwards "
                                         f"held at the peak, walking {o.schedule}'s actions ({o.microbatches} "
                                         "micro-batches)"))
    return out
