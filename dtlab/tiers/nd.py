"""Tier: pipeline x FSDP2 x tensor parallel on one 3-D DeviceMesh (``pp`` x ``dp`` x ``tp``).

The ranks form ``pp`` stages, each a grid of ``dp`` rows by ``tp`` columns
(rank = (stage * dp + row) * tp + column, as ``init_device_mesh`` numbers them).
The charformer is applied to in torchtitan's order: cut into ``pp`` pipeline
stages first (the ``pipeline`` tier's split), then each stage split over its
row by tensor parallelism (the ``tp`` tier's plan), then fully sharded down its
column (the ``fsdp`` tier's units) -- ``fsdp-tp`` once per stage. A stage's
``PipelineStage`` talks over the ``pp`` group (the ranks with the same row and
column in every stage), so activations pass between ranks holding matching
tensor-parallel slices. Each row trains on its share of the global batch, cut
into micro-batches that the schedule pipelines.

Three kinds of group, three kinds of traffic: tensor parallelism's all-reduces
within a row, FSDP's all-gathers and reduce-scatters down a column, and the
pipeline's sends between stages. Eight ranks on two cores are oversubscribed:
this tier shows correctness and communication, not speed.
"""

from __future__ import annotations

import math
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
from dtlab.core.data import SEQ_LEN, Dataset
from dtlab.core.memory import LiveActivations
from dtlab.core.mesh import Layout
from dtlab.core.registry import TierSpec
from dtlab.instrument.channels import modules_untracked
from dtlab.instrument.recorder import tagged
from dtlab.tiers import fsdp, pipeline, tp
from dtlab.tiers.parts.pipeline_stages import TimedStage
from dtlab.tiers.parts.sharded import meta_copy, plain_copy

__all__ = ["MESH_DIMS", "Options", "SCHEDULES", "SPEC", "Strategy", "coordinates", "layout", "stage_plan", "validate"]

MESH_DIMS = ("pp", "dp", "tp")
SCHEDULES = ("gpipe", "1f1b")  # one stage per rank (the pipeline tier's looped schedules need several)


@dataclass(frozen=True)
class Options:
    pp: int = 2  # pipeline stages
    dp: int = 1  # FSDP2 ranks per stage and tensor-parallel column: each row trains on 1/dp of the batch
    tp: int = 1  # tensor-parallel ranks per row
    schedule: str = "gpipe"  # as in the pipeline tier
    microbatches: int = 4  # each row's share of the batch cut into this many micro-batches
    sequence_parallel: bool = False  # as in the tp tier: stages pass each rank's chunk of the sequence


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if not isinstance(o.microbatches, int) or isinstance(o.microbatches, bool) or o.microbatches < 1:
        raise ValueError(f"{name}.microbatches={o.microbatches!r} is invalid: must be an integer >= 1")
    layout(o).check(cfg.world_size, name)
    if o.schedule not in SCHEDULES:
        raise ValueError(f"{name}.schedule={o.schedule!r} is invalid: choose one of {', '.join(SCHEDULES)}")
    if cfg.global_batch_size % (o.dp * o.microbatches):
        raise ValueError(f"{name}.microbatches={o.microbatches} is invalid: global_batch_size="
                         f"{cfg.global_batch_size} must divide into dp={o.dp} rows of {o.microbatches} equal "
                         "micro-batches")
    if o.schedule == "1f1b" and o.microbatches < o.pp:
        raise ValueError(f"{name}.microbatches={o.microbatches} is invalid: schedule '1f1b' needs at least one "
                         f"micro-batch per stage (pp={o.pp})")
    if cfg.model != "charformer":
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for the {cfg.tier} tier: it splits the "
                         "charformer (its blocks into stages, its matrices over tp); use model='charformer'")
    if cfg.model_depth % o.pp:
        raise ValueError(f"RunConfig.model_depth={cfg.model_depth} is invalid for the {cfg.tier} tier: its blocks "
                         f"cannot be split into pp={o.pp} equal stages")
    if not isinstance(o.sequence_parallel, bool):
        raise ValueError(f"{name}.sequence_parallel={o.sequence_parallel!r} is invalid: must be True or False")
    for what, size in (("width (model_size)", cfg.model_size), (f"{cfg.model_heads} attention heads", cfg.model_heads),
                       (f"sequence ({SEQ_LEN})", SEQ_LEN if o.sequence_parallel else o.tp)):
        if size % o.tp:
            raise ValueError(f"{name}.tp={o.tp} is invalid: the charformer's {what} does not divide over {o.tp} "
                             "tensor-parallel ranks")


def tp_options(o: Options) -> tp.Options:
    """The tp tier's knobs for each stage (the logits stay whole: the schedule computes the loss)."""
    return tp.Options(sequence_parallel=o.sequence_parallel)


def layout(o: Options) -> Layout:
    """The pp x dp x tp mesh, stages outermost."""
    return Layout.of(pp=o.pp, dp=o.dp, tp=o.tp)


def coordinates(rank: int, o: Options) -> tuple[int, int, int]:
    """(stage, row, column) of ``rank`` on the pp x dp x tp mesh, read off its grid."""
    place = layout(o).coordinates(rank)
    return place["pp"], place["dp"], place["tp"]


def stage_plan(styles: dict[str, Any], stage: nn.Module) -> dict[str, Any]:
    """The whole model's tensor-parallel plan, cut to what ``stage`` holds (its blocks keep their names).

    With sequence parallelism only the first stage splits the sequence where the blocks start; a later
    stage receives its rank's chunk already split (the previous stage's last block left it so)."""
    names = {n for n, _ in stage.named_modules() if n}
    out = {k: v for k, v in styles.items() if k in names}
    if not hasattr(stage, "tok"):
        out.pop("blocks", None)
    return out


def _first_step_setup(init: Callable[..., Any]) -> Callable[..., Any]:
    """The schedule's shape exchange, tagged as the pipeline tier tags it, with the recorder's module tracker
    paused: its grad hooks break the ``autograd.grad`` that infers a stage's gradient shapes."""
    tagged_init = pipeline.tagging(pipeline.SETUP_TAG)(init)

    def setup(*args: Any, **kwargs: Any) -> Any:
        with modules_untracked():
            return tagged_init(*args, **kwargs)
    return setup


class Strategy(pipeline.Strategy):
    # DTensor's calls tagged by layer (it communicates within each row), FSDP2's by unit and pass
    comm_channels = ("modules", "fsdp_units")

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        o = self.options = cfg.tier_options
        self.coords = coordinates(info.rank, o)
        self.stage_index, self.num_stages, self.local = self.coords[0], o.pp, [self.coords[0]]
        self.first, self.last = self.stage_index == 0, self.stage_index == o.pp - 1
        self.data_rank, self.data_world = self.coords[1], o.dp  # a row's share, through every stage
        self.units: list[str] = []  # FSDP2's units of this rank's stage
        self._template: nn.Module | None = None
        self.shards: dict[str, dict[str, Any]] = {}

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        o = self.options
        self._template = meta_copy(model)
        mesh = layout(o).build(self.info.device.type)
        styles = tp.plan(model, tp_options(o))  # named on the whole model, before the split
        stages = pipeline.split_model(model, o.pp, self.cfg.model_depth)
        self.layout = [[(k, v.shape, v.dtype) for k, v in s.state_dict().items()] for s in stages]
        self.stage = stages[self.stage_index]
        for block in self.stage.blocks:
            block.attn.heads //= o.tp  # whole heads per rank, as tp.parallelize
        parallelize_module(self.stage, mesh["tp"], stage_plan(styles, self.stage))
        self.units = list(fsdp.apply_fsdp(self.stage, mesh["dp"], fsdp.Options(), self.info.device.type).values())
        self.shards = tp.shard_table(self.stage)
        self.pp_stage = TimedStage(self.stage, self.stage_index, o.pp, self.info.device,
                                    group=mesh["pp"].get_group())
        schedule_cls = Schedule1F1B if o.schedule == "1f1b" else ScheduleGPipe
        self.schedule = schedule_cls(self.pp_stage, n_microbatches=o.microbatches, loss_fn=models.loss,
                                     scale_grads=True)  # and FSDP divides by dp: the global batch's mean
        wrap_pipeline_stage_init(self.schedule, _first_step_setup)
        return self.stage

    def run_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The pipeline tier's step; its first step's activations leave out FSDP's all-gathered parameters
        (held only around each micro-batch's forward and backward: not what autograd keeps)."""
        if not self.count_activations:
            return self._run_step(x, y)
        self.pp_stage.live = LiveActivations(module=self.stage)
        try:
            with self.pp_stage.live:
                return self._run_step(x, y)
        finally:
            self.activations_peak = self.pp_stage.live.peak
            self.pp_stage.live = None

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Each stage gathers its full state over its dp x tp ranks (a collective), its first rank sends it
        to rank 0, which evaluates a plain copy of the whole model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.stage, options=StateDictOptions(full_state_dict=True))
        state = self._gather_stages(state)
        if not self.info.is_main:
            return state, {}
        assert self._template is not None, "wrap() first"
        plain = plain_copy(self._template, state, self.stage, self.info.device, self.cfg.tier)
        return state, models.evaluate(plain, data, self.info.device)

    def _gather_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0 receives every later stage's full state from that stage's rank (stage, 0, 0), flattened."""
        o = self.options
        with tagged(pipeline.GATHER_TAG), torch.no_grad():
            if not self.info.is_main:
                if self.coords[0] > 0 and self.coords[1:] == (0, 0):
                    entries = self.layout[self.coords[0]]  # in the state's own dtype: float64 stays float64
                    dtype = pipeline.common_dtype(entries)
                    dist.send(torch.cat([state[k].reshape(-1).to(dtype) for k, _, _ in entries]), dst=0)
                return state
            out = dict(state)
            for s in range(1, o.pp):
                entries = self.layout[s]
                flat = torch.empty(sum(math.prod(shape) for _, shape, _ in entries),
                                   dtype=pipeline.common_dtype(entries), device=self.info.device)
                dist.recv(flat, src=s * o.dp * o.tp)
                parts = flat.split([math.prod(shape) for _, shape, _ in entries])
                out.update({k: part.view(shape).to(dtype) for (k, shape, dtype), part in zip(entries, parts)})
        return out

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {**super().describe(), "mesh": {"pp": o.pp, "dp": o.dp, "tp": o.tp},
                "coordinates": dict(zip(MESH_DIMS, self.coords)), "fsdp_units": self.units,
                "sequence_parallel": o.sequence_parallel, "shards": self.shards}


SPEC = TierSpec(name="nd", summary="a 3-D mesh pp x dp x tp: pipeline stages, each FSDP2 x tensor parallel",
                options=Options, validate=validate, strategy=Strategy, choices={"schedule": SCHEDULES},
                autocast=False, activation_checkpointing=False, models=("charformer",))
