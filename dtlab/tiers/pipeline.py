"""Tier: model parallelism -- the model cut into stages over the ranks, micro-batches pipelined.

Every rank builds the whole seeded model and trains its stages: contiguous slices of it.
Not data parallel: each step the whole global batch flows through the pipeline; the first
stage reads the inputs, the last the targets and the loss. "Layers" are the ``model_depth``
repeated units (the mlp's hidden Linear+ReLU, the charformer's blocks): each of the
world_size x ``stages_per_rank`` stages gets an equal share, the first also the input end
(Flatten, embeddings), the last the output end (classifier, head).

Schedules from ``torch.distributed.pipelining``, over ``microbatches`` (M) equal parts:
``naive`` sends one micro-batch at a time through the whole pipeline (a one-micro-batch
GPipe per micro-batch), so one stage works while the others idle; ``gpipe`` runs all
forwards, then all backwards; ``1f1b`` alternates them after warm-up. With several stages
per rank (``pipeline_stages.placement``): ``interleaved-1f1b`` (looped, Megatron's
interleaving), ``zero-bubble`` (looped, the backward split into input and weight parts,
the weight parts moved into the bubble), ``zbv`` and ``dualpipev`` (V-shaped, two stages per
rank). Each micro-batch's loss is its mean and gradients are divided by M: the single
device's gradient of the global-batch mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from dtlab.core import models
from dtlab.core.compat import wrap_pipeline_stage_init
from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.memory import LiveActivations
from dtlab.core.registry import TierSpec
from dtlab.instrument.recorder import tagged
from dtlab.tiers.parts import base
from dtlab.tiers.parts.pipeline_stages import LOOPED, MULTI_STAGE, V_SHAPED, TimedStage, placement, split_model

__all__ = ["GATHER_TAG", "Options", "SCHEDULES", "SETUP_TAG", "SPEC", "Strategy", "common_dtype", "split_model",
           "stages_per_rank", "tagging", "validate"]

SCHEDULES = ("naive", "gpipe", "1f1b", *LOOPED, *V_SHAPED)
MODELS = ("mlp", "charformer")  # built-ins whose layer structure the split knows


@dataclass(frozen=True)
class Options:
    schedule: str = "gpipe"  # one of SCHEDULES
    microbatches: int = 4  # M: the global batch is cut into M equal micro-batches
    # v: 0 takes the schedule's own (1; 2 for the interleaved and V-shaped schedules); interleaving takes 2 or more
    stages_per_rank: int = 0


def stages_per_rank(o: Any) -> int:
    """v, the stages each rank holds: ``o.stages_per_rank``, or the schedule's own where it is 0 (or absent)."""
    given = getattr(o, "stages_per_rank", 0)
    return given or (2 if o.schedule in MULTI_STAGE else 1)


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if o.schedule not in SCHEDULES:
        raise ValueError(f"{name}.schedule={o.schedule!r} is invalid: choose one of {', '.join(SCHEDULES)}")
    for field, least in (("microbatches", 1), ("stages_per_rank", 0)):
        value = getattr(o, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}.{field}={value!r} is invalid: must be an integer >= {least}")
    _validate_stages(cfg, name)
    _validate_microbatches(cfg, name)
    if cfg.model not in MODELS:
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for tier 'pipeline': it splits the built-in "
                         f"{' or '.join(MODELS)} (their model_depth layers)")
    stages = cfg.world_size * stages_per_rank(o)
    if cfg.model_depth % stages:
        raise ValueError(f"RunConfig.model_depth={cfg.model_depth} is invalid for tier 'pipeline': its "
                         f"{cfg.model_depth} layers cannot be split into {stages} equal stages (world_size="
                         f"{cfg.world_size} x stages_per_rank={stages_per_rank(o)}); use a model_depth divisible "
                         f"by {stages}")


def _validate_stages(cfg: RunConfig, name: str) -> None:
    o, v = cfg.tier_options, stages_per_rank(cfg.tier_options)
    if o.schedule in V_SHAPED and v != 2:
        raise ValueError(f"{name}.stages_per_rank={v} is invalid: schedule {o.schedule!r} is V-shaped, exactly 2 "
                         "stages per rank (r and 2·world−1−r); use 2 or 0")
    if o.schedule in LOOPED and v < 2:
        raise ValueError(f"{name}.stages_per_rank={v} is invalid: schedule {o.schedule!r} interleaves 2 or more "
                         "stages per rank; use 2 or more, or 0 (2)")
    if o.schedule not in MULTI_STAGE and v != 1:
        raise ValueError(f"{name}.stages_per_rank={v} is invalid: schedule {o.schedule!r} runs one stage per rank; "
                         f"for several use one of {', '.join(MULTI_STAGE)}")


def _validate_microbatches(cfg: RunConfig, name: str) -> None:
    o, m, world = cfg.tier_options, cfg.tier_options.microbatches, cfg.world_size
    if cfg.global_batch_size % m:
        raise ValueError(f"{name}.microbatches={m} is invalid: it must divide "
                         f"global_batch_size={cfg.global_batch_size} into equal micro-batches")
    if o.schedule == "1f1b" and m < world:
        raise ValueError(f"{name}.microbatches={m} is invalid: schedule '1f1b' needs at least one "
                         f"micro-batch per stage (world_size={world})")
    rounds = max(1, m // world)  # torch's interleaved schedules run M in rounds of equal size
    if o.schedule in LOOPED and m % rounds:
        raise ValueError(f"{name}.microbatches={m} is invalid: schedule {o.schedule!r} runs rounds of equal size, "
                         f"so M must be a multiple of max(1, M // world_size) = {rounds}; e.g. a multiple of {world}")
    if o.schedule == "dualpipev" and m < 2 * world:
        raise ValueError(f"{name}.microbatches={m} is invalid: schedule 'dualpipev' needs at least as many "
                         f"micro-batches as stages ({2 * world} = 2 x world_size)")


def tagging(tag: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the wrapped call's collectives are recorded under ``tag`` (the schedule's shape exchange)."""
    def wrap(init: Callable[..., Any]) -> Callable[..., Any]:
        def tagged_init(*args: Any, **kwargs: Any) -> Any:
            with tagged(tag):
                return init(*args, **kwargs)
        return tagged_init
    return wrap


# -- the strategy -----------------------------------------------------------------------
SETUP_TAG, GATHER_TAG = "pipeline_setup", "pipeline_gather"  # traffic outside the schedule's transfers


class Strategy(base.Strategy):
    custom_step = True

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.options: Options = cfg.tier_options
        self.data_rank, self.data_world = 0, 1  # every stage reads the whole global batch
        per_rank = stages_per_rank(self.options)
        self.num_stages = info.world_size * per_rank
        self.local = placement(self.options.schedule, info.world_size, per_rank)[info.rank]
        self.stage_index = self.local[0]
        self.first, self.last = 0 in self.local, self.num_stages - 1 in self.local
        self.stages: list[nn.Module] = []  # this rank's stages, in self.local's order
        self.pp_stages: list[TimedStage] = []
        self.full: nn.Module | None = None  # rank 0 keeps the whole model, to gather into and evaluate
        self.layout: list[list[tuple[str, torch.Size, torch.dtype]]] = []  # per stage: its state's entries
        self.count_activations = False  # during the first step: the peak of the activations held
        self.activations_peak = 0

    # A tier with one stage per rank (nd) sets these two; the methods below read the lists.
    @property
    def stage(self) -> nn.Module:
        return self.stages[0]

    @stage.setter
    def stage(self, module: nn.Module) -> None:
        self.stages = [module]

    @property
    def pp_stage(self) -> TimedStage:
        return self.pp_stages[0]

    @pp_stage.setter
    def pp_stage(self, stage: TimedStage) -> None:
        self.pp_stages = [stage]

    def wrap(self, model: nn.Module) -> nn.Module:
        stages = split_model(model, self.num_stages, self.cfg.model_depth)
        self.layout = [[(k, v.shape, v.dtype) for k, v in s.state_dict().items()] for s in stages]
        self.full = model if self.info.is_main else None
        self.stages = [stages[i] for i in self.local]
        self.pp_stages = [TimedStage(stages[i], i, self.num_stages, self.info.device) for i in self.local]
        o = self.options
        # Each micro-batch's loss is a mean, so scale_grads divides the summed gradients by M.
        if o.schedule in MULTI_STAGE:  # torch's runtime places the stages: looped, or V-shaped for zbv, dualpipev
            self.schedule = MULTI_STAGE[o.schedule](self.pp_stages, n_microbatches=o.microbatches,
                                                    loss_fn=models.loss, scale_grads=True)
        else:
            schedule_cls = Schedule1F1B if o.schedule == "1f1b" else ScheduleGPipe
            self.schedule = schedule_cls(self.pp_stage, n_microbatches=1 if o.schedule == "naive" else o.microbatches,
                                         loss_fn=models.loss, scale_grads=True)
        # The first step's shape exchange, tagged apart from the transfers (where torch lets us).
        wrap_pipeline_stage_init(self.schedule, tagging(SETUP_TAG))
        return self.stage if len(self.stages) == 1 else nn.ModuleList(self.stages)

    def _schedule_step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        return losses

    def on_step_start(self, step: int) -> None:
        self.count_activations = step == self.start_step  # every step holds the same

    def run_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.count_activations:
            return self._run_step(x, y)
        live = LiveActivations(exclude=[p for s in self.stages for p in s.parameters()])
        for stage in self.pp_stages:  # one count over the rank's stages: they share its memory
            stage.live = live
        try:
            with live:
                return self._run_step(x, y)
        finally:
            self.activations_peak = live.peak
            for stage in self.pp_stages:
                stage.live = None

    def memory(self) -> dict[str, int]:
        """``activations``: the most bytes saved for backward held at once on this rank, over the
        micro-batches in flight on its stages (GPipe: all M after the forwards; 1F1B: at most S - stage)."""
        return {"activations": self.activations_peak}

    def _run_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for stage in self.pp_stages:
            stage.compute_s = {"forward": 0.0, "backward": 0.0}
        m = self.options.microbatches
        if self.options.schedule == "naive":
            # One one-micro-batch schedule per micro-batch: the next starts only when the last is back.
            losses = []
            for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
                self.pp_stage.offset = i
                losses += self._schedule_step(xm, ym)
            self.pp_stage.scale_grads(m)  # each one-micro-batch schedule divided by 1
        else:
            losses = self._schedule_step(x, y)
        if not self.last:
            return torch.tensor(float("nan"))
        return torch.stack([loss.detach() for loss in losses]).mean()  # mean of equal-sized means

    def split_step(self, seconds: float) -> dict[str, float]:
        """This rank's forward and backward compute over all micro-batches and its stages; the rest of the
        step it waited: for transfers and in the bubble (counted as communication)."""
        parts = {k: sum(s.compute_s[k] for s in self.pp_stages) for k in ("forward", "backward")}
        parts["comm"] = max(0.0, seconds - parts["forward"] - parts["backward"])
        return parts

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        state = self._gather_state()
        return state, models.evaluate(self.full, data, self.info.device) if self.info.is_main else {}

    def _gather_state(self) -> dict[str, torch.Tensor]:
        """Rank 0 receives every other rank's stages' state, flattened into one message per rank."""
        world = self.info.world_size
        held = placement(self.options.schedule, world, self.num_stages // world)
        with tagged(GATHER_TAG), torch.no_grad():
            if not self.info.is_main:
                mine = {k: v for s in self.stages for k, v in s.state_dict().items()}
                dtype = common_dtype([e for i in self.local for e in self.layout[i]])
                dist.send(torch.cat([t.reshape(-1).to(dtype) for t in mine.values()]), dst=0)
                return mine
            full = self.full.state_dict(keep_vars=True)
            for rank in range(1, world):
                entries = [e for i in held[rank] for e in self.layout[i]]
                sizes = [shape.numel() for _, shape, _ in entries]
                flat = torch.empty(sum(sizes), dtype=common_dtype(entries), device=self.info.device)
                dist.recv(flat, src=rank)
                for (key, shape, _), part in zip(entries, flat.split(sizes)):
                    full[key].copy_(part.view(shape))
        return self.full.state_dict()

    def describe(self) -> dict[str, Any]:
        o = self.options
        indices = [s.stage_index for s in self.pp_stages]
        return {"schedule": o.schedule, "microbatches": o.microbatches, "stages": self.num_stages,
                "stage": self.stage_index, "rank_stages": indices,
                "stage_state": [k for i in indices for k, _, _ in self.layout[i]],
                "stage_parameters": sum(p.numel() for s in self.stages for p in s.parameters())}


def common_dtype(entries: list[tuple[str, torch.Size, torch.dtype]]) -> torch.dtype:
    """The dtype every entry casts to without loss (float64 stays float64), for one flat message."""
    return functools.reduce(torch.promote_types, [d for _, _, d in entries])


SPEC = TierSpec(name="pipeline", summary="the model split into stages; naive, GPipe, 1F1B, interleaved and "
                "zero-bubble micro-batch schedules",
                options=Options, validate=validate, strategy=Strategy, choices={"schedule": SCHEDULES},
                autocast=False, activation_checkpointing=False)
