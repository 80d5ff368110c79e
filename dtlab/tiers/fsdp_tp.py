"""Tier: FSDP2 x tensor parallel on a 2-D DeviceMesh (``dp`` x ``tp``) -- fsdp and tp composed.

The ranks form a grid of ``world_size / tp_size`` rows by ``tp_size`` columns.
Within a row (the ``tp`` dimension) the ranks split every large matrix as the
``tp`` tier does and see the same batch; down a column (the ``dp`` dimension)
``fully_shard`` shards each rank's slices further, as the ``fsdp`` tier does,
and each row trains on its own share of the global batch. Tensor parallelism's
per-layer collectives stay inside a row (fast links within a node), FSDP's
per-unit all-gathers and reduce-scatters go across rows -- the layout
torchtitan uses. Four ranks on two cores are oversubscribed: this tier shows
correctness and communication, not speed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from dtlab.core.config import RunConfig
from dtlab.core.mesh import Layout
from dtlab.core.registry import TierSpec
from dtlab.tiers import fsdp, tp
from dtlab.tiers.parts.sharded import meta_copy

__all__ = ["Options", "SPEC", "Strategy", "validate"]


@dataclass(frozen=True)
class Options(tp.Options):
    tp_size: int = 2  # ranks per tensor-parallel group (a row of the mesh); world_size / tp_size rows
    reshard_after_forward: bool = True  # as in the fsdp tier
    mixed_precision: str = "none"  # as in the fsdp tier
    cpu_offload: bool = False  # the fsdp tier's knob; not offered here (no CPU offload of TP shards)


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if not isinstance(o.tp_size, int) or isinstance(o.tp_size, bool) or o.tp_size < 1:
        raise ValueError(f"{name}.tp_size={o.tp_size!r} is invalid: must be an integer >= 1")
    if cfg.world_size % o.tp_size:
        raise ValueError(f"{name}.tp_size={o.tp_size} is invalid: it must divide world_size={cfg.world_size} "
                         f"(a {cfg.world_size // max(1, o.tp_size)} x {o.tp_size} mesh)")
    dp = cfg.world_size // o.tp_size
    if cfg.global_batch_size % dp:
        raise ValueError(f"RunConfig.global_batch_size={cfg.global_batch_size} is invalid: it must divide over the "
                         f"{dp} data-parallel rows")
    if o.cpu_offload:
        raise ValueError(f"{name}.cpu_offload=True is invalid: the {cfg.tier} tier keeps its shards on the device")
    if o.mixed_precision not in fsdp.MIXED_PRECISION:
        raise ValueError(f"{name}.mixed_precision={o.mixed_precision!r} is invalid: choose one of "
                         f"{', '.join(fsdp.MIXED_PRECISION)}")
    fsdp.check_dtype(cfg, name)
    tp.validate_model(cfg, o.tp_size, name)


class Strategy(fsdp.Strategy):
    # DTensor's calls named by layer, FSDP2's by unit and pass; no gathered bytes counted: every parameter is a
    # DTensor here, gathered or not, so their types cannot tell which units are gathered
    comm_channels = ("modules", "fsdp_units")

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        o = cfg.tier_options
        # fsdp.Strategy reads the checkpoint knobs; this tier has none
        super().__init__(cfg.replace(tier="fsdp", tier_options=fsdp.Options(
            reshard_after_forward=o.reshard_after_forward, mixed_precision=o.mixed_precision)), info)
        self.cfg, self.tp_options = cfg, o
        self.tp_size = o.tp_size
        self.shards: dict[str, dict[str, Any]] = {}
        self.dp_size = info.world_size // o.tp_size
        self.layout = Layout.of(dp=self.dp_size, tp=o.tp_size)  # rows of tp ranks: rank = row * tp_size + column
        self.data_rank, self.data_world = self.layout.coordinates(info.rank)["dp"], self.dp_size

    def wrap(self, model: nn.Module) -> nn.Module:
        self._template = meta_copy(model)
        mesh = self.layout.build(self.info.device.type)
        tp.parallelize(model, mesh["tp"], self.tp_options)
        model = self.shard(model, mesh["dp"])
        self.shards = tp.shard_table(model)  # placements on both mesh dimensions: (dp, tp)
        return model

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        return tp.loss_context(self.tp_options)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": {"dp": self.dp_size, "tp": self.tp_size}, "shards": self.shards,
                "sequence_parallel": self.tp_options.sequence_parallel,
                "loss_parallel": self.tp_options.loss_parallel}


SPEC = TierSpec(name="fsdp-tp", summary="FSDP2 over the dp rows of a 2-D mesh, tensor parallel within each row",
                options=Options, validate=validate, strategy=Strategy,
                choices={"mixed_precision": tuple(fsdp.MIXED_PRECISION)}, models=tp.MODELS)
