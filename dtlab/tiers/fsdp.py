"""Tier: FSDP2 (``fully_shard``) -- parameters, gradients and optimizer state all sharded.

Where ``zero`` shards only the optimizer state, ``fully_shard`` turns every
parameter into a DTensor of which each rank holds a 1/world_size slice. A
*unit* (a block with its own ``fully_shard`` call) all-gathers its full
parameters just before its forward, frees them after it
(``reshard_after_forward``), all-gathers them again for its backward and
reduce-scatters the gradients, so each rank keeps only its slice of the
gradient too. The optimizer then steps local slices: no broadcast is needed.

Units: for the charformer each ``Block`` of ``model.blocks`` plus the root
(embeddings, final norm and head); for an ``nn.Sequential`` (mlp, cnn) each
child with parameters; any other model is one unit, the root.

On CPU FSDP2 runs its collectives synchronously in the training thread (its
overlap comes from CUDA streams), so every all-gather and reduce-scatter is
exposed; ``comm_exposure`` measures that.

HSDP (``replicate`` > 1): the ranks form a ``replicate`` x ``world_size / replicate``
mesh. Each row (a group) shards the model as above; the rows hold the same shards. A
unit's gradients are reduce-scattered within its row, then all-reduced down its column
(the ranks holding the same shard): all-gathers and reduce-scatters stay in a group as
small as a node, and only each rank's gradient shard crosses between groups.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.core import muon
from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.job import OptimizerFactory
from dtlab.core.mesh import Layout
from dtlab.core.models import evaluate
from dtlab.core.quantise import COMM_DTYPES
from dtlab.core.registry import TierSpec
from dtlab.instrument.channels import declare_fsdp
from dtlab.tiers.parts import base, checkpoint, fsdp_knobs, fsdp_muon
from dtlab.tiers.parts.fsdp_comms import check_comm_options, install_comms
from dtlab.tiers.parts.fsdp_knobs import MIXED_PRECISION, UnitOptions, check_dtype
from dtlab.tiers.parts.sharded import meta_copy, plain_copy

__all__ = ["MIXED_PRECISION", "Options", "SPEC", "Strategy", "UnitOptions", "apply_fsdp", "check_dtype", "shard_units",
           "validate"]


@dataclass(frozen=True)
class Options(checkpoint.Knobs, UnitOptions):  # fully_shard's knobs (parts.fsdp_knobs), then the checkpoint's
    # HSDP: shard within groups of world_size / replicate ranks, replicate across the replicate groups
    replicate: int = 1
    # Quantised communication (dtlab.core.quantise): the parameters' all-gather and the gradients' reduce-scatter
    # as fp32 (FSDP2's own collectives), bf16, int8 or fp8 codes with a float32 scale per comm_block elements
    gather_comm_dtype: str = "fp32"
    reduce_comm_dtype: str = "fp32"
    comm_block: int = 128


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"the {cfg.tier} tier needs torch.distributed.fsdp.fully_shard (torch >= 2.6); "
                         f"this is torch {torch.__version__}") from exc
    fsdp_knobs.check(cfg, name)
    checkpoint.validate_knobs(cfg, saves_muon=True)  # fsdp_muon.check names what muon cannot checkpoint
    if not isinstance(o.replicate, int) or isinstance(o.replicate, bool) or o.replicate < 1:
        raise ValueError(f"{name}.replicate={o.replicate!r} is invalid: must be an integer >= 1")
    if cfg.world_size % o.replicate:
        raise ValueError(f"{name}.replicate={o.replicate} is invalid: it must divide world_size={cfg.world_size} "
                         "(replicate groups of world_size / replicate ranks each)")
    check_comm_options(o, name)
    if cfg.optimizer == "muon":
        fsdp_muon.check(cfg, name)


def shard_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules that get their own ``fully_shard`` (the root gets one too), in forward order."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        # the blocks' own names: a pipeline stage's keep the whole model's numbering
        return [(f"blocks.{name}", block) for name, block in blocks.named_children()]
    if isinstance(model, nn.Sequential):
        return [(name, child) for name, child in model.named_children() if any(True for _ in child.parameters())]
    return []


def apply_fsdp(model: nn.Module, mesh: Any, options: UnitOptions, device_type: str) -> dict[nn.Module, str]:
    """``fully_shard`` each unit and the root over ``mesh`` (1-D: the ranks that share the parameters; 2-D:
    replicate x shard, HSDP), their collectives quantised where ``options`` ask and the units declared to the
    instrument layer's FSDP channels (``declare_fsdp``). Returns each sharded module's unit name."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = MIXED_PRECISION[options.mixed_precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                              output_dtype=torch.float32 if dtype else None)
    # Pinned memory needs CUDA; on CPU the shards are host memory already.
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if options.cpu_offload else OffloadPolicy()
    # The same reshard_after_forward for the root too (FSDP2's default keeps the root
    # gathered), so that every unit gathers exactly twice per step when it is True.
    kwargs = dict(mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=mp,
                  offload_policy=offload)
    # FSDP2 warns when the root returns a view (a Linear head on 3-D input does): an in-place op on
    # it would skip the pre-backward hook. dtlab's loop only computes the loss from it, out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    units = shard_units(model)
    owned = {id(p) for _, unit in units for p in unit.parameters()}
    named = {unit: name for name, unit in units}
    if any(id(p) not in owned for p in model.parameters()):
        named[model] = "root"  # the root's own unit: whatever no block owns
    for _, unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)  # always: the root schedules the others
    install_comms(named, gather_dtype=getattr(options, "gather_comm_dtype", "fp32"),
                  reduce_dtype=getattr(options, "reduce_comm_dtype", "fp32"), block=getattr(options, "comm_block", 128))
    declare_fsdp(model, named, dtype, hsdp=mesh.ndim == 2)
    return named


class Strategy(base.Strategy):
    # FSDP2's collectives named by unit and pass; what each rank holds gathered, counted (comm_buffers)
    comm_channels = ("fsdp_units", "fsdp_gathered")

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.options: Options = cfg.tier_options
        o = self.options
        self.checkpoints = checkpoint.Periodic.of(o, cfg.steps)
        self.start_step = 0  # set by make_optimizer when resuming
        self.units: list[str] = []
        self._template: nn.Module | None = None

    # -- set-up -------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        self._template = meta_copy(model)  # a plain twin that rank 0 evaluates with the full parameters
        r, world = self.options.replicate, self.info.world_size
        # HSDP: over a 2-D mesh fully_shard shards along the second dimension, replicates along the first
        layout = Layout.of(shard=world) if r == 1 else Layout.of(replicate=r, shard=world // r)
        return self.shard(model, layout.build(self.info.device.type))

    def shard(self, model: nn.Module, mesh: Any) -> nn.Module:
        self.units = list(apply_fsdp(model, mesh, self.options, self.info.device.type).values())
        return model

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        if self.cfg.optimizer == "muon":  # whole matrices orthogonalised by their owners (dtlab.tiers.parts.fsdp_muon)
            optimizer: torch.optim.Optimizer = fsdp_muon.LayerwiseMuon(muon.param_groups(model), **build.keywords)
        else:
            optimizer = build(model.parameters())  # over the DTensor shards: each rank steps its slice
        # > 0 after resume_from: the loop starts after the step the checkpoint was saved at
        self.start_step = self.checkpoints.setup(model, optimizer, build.keywords)
        return optimizer

    def on_step_end(self, step: int) -> None:
        self.checkpoints.after_step(step)

    # -- what the loop reads back (on every rank) --------------------------------------
    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The unsharded state on every rank (a collective), so all ranks' checksums agree; rank 0
        evaluates a plain copy holding the gathered parameters: no collective per batch."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if not self.info.is_main:
            return state, {}
        return state, evaluate(self.plain_copy(model, state), data, self.info.device)

    def plain_copy(self, model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
        """An ordinary module (the unwrapped class) with the full parameters in ``state``."""
        assert self._template is not None, "wrap() first"
        return plain_copy(self._template, state, model, self.info.device, self.cfg.tier)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fsdp_units": self.units, "num_units": len(self.units),
                               "reshard_after_forward": self.options.reshard_after_forward,
                               "mixed_precision": self.options.mixed_precision,
                               "gather_comm_dtype": getattr(self.options, "gather_comm_dtype", "fp32"),
                               "reduce_comm_dtype": getattr(self.options, "reduce_comm_dtype", "fp32"),
                               "cpu_offload": self.options.cpu_offload, "replicate": self.options.replicate}
        return {**out, **self.checkpoints.describe()}


SPEC = TierSpec(name="fsdp", summary="FSDP2 (fully_shard): parameters, gradients and optimizer state sharded",
                options=Options, validate=validate, strategy=Strategy, preflight=checkpoint.preflight,
                optimizers=("sgd", "adam", "muon"),
                choices={"mixed_precision": tuple(MIXED_PRECISION), "gather_comm_dtype": COMM_DTYPES,
                         "reduce_comm_dtype": COMM_DTYPES})
