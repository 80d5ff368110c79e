"""Tier: model parallelism -- the model cut into S stages on S ranks, micro-batches pipelined.

Every rank builds the whole seeded model and trains one contiguous slice of it (its
*stage*). Not data parallel: each step the whole global batch flows through the
pipeline; the first stage reads the inputs, the last the targets and the loss.
"Layers" are the ``model_depth`` repeated units (the mlp's hidden Linear+ReLU, the
charformer's blocks): each stage gets ``model_depth / world_size``, the first also
the input end (Flatten, embeddings), the last the output end (classifier, head).

Schedules from ``torch.distributed.pipelining``, over ``microbatches`` (M) equal parts:
``naive`` sends one micro-batch at a time through the whole pipeline (a one-micro-batch
GPipe per micro-batch), so one stage works while the others idle; ``gpipe`` runs all
forwards, then all backwards; ``1f1b`` alternates them after warm-up. Each
micro-batch's loss is its mean and gradients are divided by M: the single device's
gradient of the global-batch mean.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dtlab.core import models
from dtlab.core.compat import wrap_pipeline_stage_init
from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.memory import LiveActivations
from dtlab.core.registry import TierSpec
from dtlab.instrument.recorder import active
from dtlab.tiers import base

__all__ = ["GATHER_TAG", "Options", "SCHEDULES", "SETUP_TAG", "SPEC", "Strategy", "split_model", "validate"]

SCHEDULES = ("naive", "gpipe", "1f1b")
MODELS = ("mlp", "charformer")  # built-ins whose layer structure the split knows


@dataclass(frozen=True)
class Options:
    schedule: str = "gpipe"  # "naive" | "gpipe" | "1f1b"
    microbatches: int = 4  # M: the global batch is cut into M equal micro-batches


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if o.schedule not in SCHEDULES:
        raise ValueError(f"{name}.schedule={o.schedule!r} is invalid: choose one of {', '.join(SCHEDULES)}")
    if not isinstance(o.microbatches, int) or isinstance(o.microbatches, bool) or o.microbatches < 1:
        raise ValueError(f"{name}.microbatches={o.microbatches!r} is invalid: must be an integer >= 1")
    if cfg.global_batch_size % o.microbatches:
        raise ValueError(f"{name}.microbatches={o.microbatches} is invalid: it must divide "
                         f"global_batch_size={cfg.global_batch_size} into equal micro-batches")
    if o.schedule == "1f1b" and o.microbatches < cfg.world_size:
        raise ValueError(f"{name}.microbatches={o.microbatches} is invalid: schedule '1f1b' needs at least one "
                         f"micro-batch per stage (world_size={cfg.world_size})")
    if cfg.model not in MODELS:
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for tier 'pipeline': it splits the built-in "
                         f"{' or '.join(MODELS)} (their model_depth layers)")
    if cfg.model_depth % cfg.world_size:
        raise ValueError(f"RunConfig.model_depth={cfg.model_depth} is invalid for tier 'pipeline': its "
                         f"{cfg.model_depth} layers cannot be split into world_size={cfg.world_size} equal stages "
                         f"(the stage count); use a model_depth divisible by {cfg.world_size}")


# -- splitting -------------------------------------------------------------------------
class _CharFormerStage(nn.Module):
    """A contiguous slice of a CharFormer, with the original attribute names (so state_dict keys match)."""

    def __init__(self, model: models.CharFormer, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        if is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.Sequential(OrderedDict((str(i), model.blocks[i]) for i in range(first, last)))
        if is_last:
            self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "tok"):
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        x = self.blocks(x)
        return self.head(self.ln(x)) if hasattr(self, "head") else x


def _sequential_units(model: nn.Sequential) -> list[list[int]]:
    """Module indices grouped into units, one per module with parameters (a Linear) with the
    parameter-free ones after it (its ReLU); leading ones (the Flatten) join the first unit."""
    weighted = [i for i, m in enumerate(model) if next(m.parameters(), None) is not None]
    starts = [0, *weighted[1:]]
    return [list(range(a, b)) for a, b in zip(starts, [*starts[1:], len(model)])]


def split_model(model: nn.Module, stages: int, depth: int) -> list[nn.Module]:
    """The model cut into ``stages`` contiguous stages of ``depth / stages`` layers each.

    The stages share the model's modules (no copies) and keep its parameter names.
    """
    per = depth // stages
    if isinstance(model, models.CharFormer):
        return [_CharFormerStage(model, s * per, (s + 1) * per, s == 0, s == stages - 1) for s in range(stages)]
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"cannot split a {type(model).__name__}: the pipeline tier splits an nn.Sequential mlp "
                        "or the charformer")
    units = _sequential_units(model)
    if len(units) != depth + 1:  # depth hidden layers and the classifier
        raise ValueError(f"expected {depth + 1} parameterised layers in the mlp, found {len(units)}")
    out = []
    for s in range(stages):
        mine = units[s * per:(s + 1) * per] + (units[depth:] if s == stages - 1 else [])
        out.append(nn.Sequential(OrderedDict((str(i), model[i]) for unit in mine for i in unit)))
    return out


class _TimedStage(PipelineStage):
    """Records each micro-batch's forward and backward as phases, and sums their seconds per step
    (``compute_s``, reset by the strategy); ``offset`` numbers the naive schedule's micro-batches
    (each of its one-micro-batch schedules calls its own 0). While ``live`` is set, what autograd
    saves counts for the micro-batch whose forward ran last, until its backward ran."""

    offset = 0
    live: LiveActivations | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compute_s = {"forward": 0.0, "backward": 0.0}

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            if self.live is not None:
                self.live.begin(fwd_chunk_id + self.offset)  # and its loss, which the schedule computes next
            with _phase(f"pp_forward:{fwd_chunk_id + self.offset}"):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.compute_s["forward"] += time.perf_counter() - start

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            with _phase(f"pp_backward:{bwd_chunk_id + self.offset}"):
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            if self.live is not None:
                self.live.release(bwd_chunk_id + self.offset)  # autograd freed what this micro-batch saved
            self.compute_s["backward"] += time.perf_counter() - start


def _phase(name: str) -> contextlib.AbstractContextManager[Any]:
    rec = active()  # None when the run records nothing: then there is nothing to time either
    return rec.phase(name) if rec is not None else contextlib.nullcontext()


def _tagging(tag: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(init: Callable[..., Any]) -> Callable[..., Any]:
        def tagged_init(*args: Any, **kwargs: Any) -> Any:
            with _tagged(tag):
                return init(*args, **kwargs)
        return tagged_init
    return wrap


def _tagged(tag: str) -> contextlib.AbstractContextManager[Any]:
    rec = active()
    return rec.tagged(tag) if rec is not None else contextlib.nullcontext()


# -- the strategy -----------------------------------------------------------------------
SETUP_TAG, GATHER_TAG = "pipeline_setup", "pipeline_gather"  # traffic outside the schedule's transfers


class Strategy(base.Strategy):
    custom_step = True

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.options: Options = cfg.tier_options
        self.data_rank, self.data_world = 0, 1  # every stage reads the whole global batch
        self.stage_index, self.num_stages = info.rank, info.world_size
        self.first, self.last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        self.full: nn.Module | None = None  # rank 0 keeps the whole model, to gather into and evaluate
        self.layout: list[list[tuple[str, torch.Size, torch.dtype]]] = []  # per stage: its state's entries
        self.count_activations = False  # during the first step: the peak of the activations held
        self.activations_peak = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        stages = split_model(model, self.num_stages, self.cfg.model_depth)
        self.layout = [[(k, v.shape, v.dtype) for k, v in s.state_dict().items()] for s in stages]
        self.full = model if self.info.is_main else None
        self.stage = stages[self.stage_index]
        o = self.options
        self.pp_stage = _TimedStage(self.stage, self.stage_index, self.num_stages, self.info.device)
        schedule_cls = Schedule1F1B if o.schedule == "1f1b" else ScheduleGPipe
        # Each micro-batch's loss is a mean, so scale_grads divides the summed gradients by M.
        self.schedule = schedule_cls(self.pp_stage, n_microbatches=1 if o.schedule == "naive" else o.microbatches,
                                     loss_fn=models.loss, scale_grads=True)
        # The first step's shape exchange, tagged apart from the transfers (where torch lets us).
        wrap_pipeline_stage_init(self.schedule, _tagging(SETUP_TAG))
        return self.stage

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
        self.pp_stage.live = LiveActivations(exclude=self.stage.parameters())
        try:
            with self.pp_stage.live:
                return self._run_step(x, y)
        finally:
            self.activations_peak = self.pp_stage.live.peak
            self.pp_stage.live = None

    def memory(self) -> dict[str, int]:
        """``activations``: the most bytes saved for backward held at once on this stage, over the
        micro-batches in flight (GPipe: all M after the forwards; 1F1B: at most S - stage)."""
        return {"activations": self.activations_peak}

    def _run_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.pp_stage.compute_s = {"forward": 0.0, "backward": 0.0}
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
        """This stage's forward and backward compute over all micro-batches; the rest of the step it
        waited: for transfers and in the bubble (counted as communication)."""
        parts = dict(self.pp_stage.compute_s)
        parts["comm"] = max(0.0, seconds - parts["forward"] - parts["backward"])
        return parts

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        state = self._gather_state()
        return state, models.evaluate(self.full, data, self.info.device) if self.info.is_main else {}

    def _gather_state(self) -> dict[str, torch.Tensor]:
        """Rank 0 receives every other stage's state, flattened into one message per stage."""
        with _tagged(GATHER_TAG), torch.no_grad():
            if not self.info.is_main:
                mine = self.stage.state_dict()
                dtype = _common_dtype(self.layout[self.stage_index])
                dist.send(torch.cat([t.reshape(-1).to(dtype) for t in mine.values()]), dst=0)
                return mine
            full = self.full.state_dict(keep_vars=True)
            for s in range(1, self.num_stages):
                sizes = [shape.numel() for _, shape, _ in self.layout[s]]
                flat = torch.empty(sum(sizes), dtype=_common_dtype(self.layout[s]), device=self.info.device)
                dist.recv(flat, src=s)
                for (key, shape, _), part in zip(self.layout[s], flat.split(sizes)):
                    full[key].copy_(part.view(shape))
        return self.full.state_dict()

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {"schedule": o.schedule, "microbatches": o.microbatches, "stages": self.num_stages,
                "stage": self.stage_index, "stage_state": [k for k, _, _ in self.layout[self.stage_index]],
                "stage_parameters": sum(p.numel() for p in self.stage.parameters())}


def _common_dtype(entries: list[tuple[str, torch.Size, torch.dtype]]) -> torch.dtype:
    return functools.reduce(torch.promote_types, [d for _, _, d in entries])


SPEC = TierSpec(name="pipeline", summary="the model split into stages; naive, GPipe or 1F1B micro-batch schedules",
                options=Options, validate=validate, strategy=Strategy, choices={"schedule": SCHEDULES},
                autocast=False, activation_checkpointing=False)
