"""Tier: tensor parallelism (Megatron-style) on a 1-D DeviceMesh, optionally with sequence parallelism.

Where ddp splits the *batch* and keeps whole weights, tp splits the *weights*:
each rank holds a slice of every large matrix and all ranks see the same
batch. ``parallelize_module`` turns the slices into DTensors:

* ``ColwiseParallel`` splits a Linear's output features (attention: whole heads
  per rank); ``RowwiseParallel`` splits the next Linear's input features, so
  the pair needs no communication in between. Each pair costs one all-reduce
  of its output in forward and one of its input's gradient in backward (f and g
  in the Megatron-LM paper, Shoeybi et al. 2019, fig. 3).
* ``sequence_parallel=True`` (Korthikanti et al. 2022) also splits the sequence
  for the parts between pairs (the norms and residuals): each all-reduce
  becomes a reduce-scatter, and each pair starts with an all-gather -- the same
  bytes, but activations between pairs are 1/n per rank.
* ``loss_parallel=True`` keeps the vocabulary head's logits sharded and
  computes the cross-entropy on the shards (no all-gather of the logits).

Token embedding and vocabulary head are split too (rows, columns); positions
and norms are replicated. No gradient all-reduce after backward: each rank
owns its slices, and replicated parameters get the same gradient everywhere.

``decomposed_mlp=True`` splits each MLP pair's GEMM into row chunks and passes
their partial sums round the ring with ``batch_isend_irecv`` while the next
chunk computes (async tensor parallelism's idea, ``dtlab.tiers.parts.tp_ring``): the
same arithmetic and bytes, its communication under compute.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN, Dataset
from dtlab.core.mesh import Layout
from dtlab.core.models import evaluate
from dtlab.core.registry import TierSpec
from dtlab.tiers.parts import base
from dtlab.tiers.parts.sharded import meta_copy, plain_copy
from dtlab.tiers.parts.tp_ring import Ring, decompose, gather_slices

__all__ = ["MODELS", "Options", "SPEC", "Strategy", "loss_context", "mlp_pairs", "parallelize", "plan", "shard_table",
           "validate"]

MODELS = ("mlp", "charformer")


@dataclass(frozen=True)
class Options:
    sequence_parallel: bool = False  # norms and residuals split along the sequence: all-gather/reduce-scatter
    loss_parallel: bool = False  # cross-entropy on vocabulary-sharded logits (charformer)
    decomposed_mlp: bool = False  # MLP pairs as ring-decomposed GEMMs (tp tier only; dtlab.tiers.parts.tp_ring)
    # False: the decomposed ring waits for each transfer before the next chunk computes. The same bytes and
    # arithmetic with nothing under the transfers: the control that shows what the overlap is, and that its
    # measurement (dtlab.read.overlap) reads about 0 where nothing can overlap
    ring_overlap: bool = True


def validate_model(cfg: RunConfig, tp: int, name: str) -> None:
    """What cannot be split over ``tp`` ranks, named."""
    o = cfg.tier_options
    for field in ("sequence_parallel", "loss_parallel", "decomposed_mlp", "ring_overlap"):
        if not isinstance(getattr(o, field), bool):
            raise ValueError(f"{name}.{field}={getattr(o, field)!r} is invalid: must be True or False")
    if o.decomposed_mlp and cfg.tier != "tp":
        raise ValueError(f"{name}.decomposed_mlp=True is invalid: the {cfg.tier} tier shards the MLP with "
                         "DTensor; the decomposed MLP runs on the tp tier")
    if not o.ring_overlap and not o.decomposed_mlp:
        raise ValueError(f"{name}.ring_overlap=False is invalid without decomposed_mlp=True: only the decomposed "
                         "MLP passes partial sums round a ring")
    if o.decomposed_mlp and o.sequence_parallel:
        raise ValueError(f"{name}.decomposed_mlp=True is invalid with sequence_parallel=True: the decomposed pair "
                         "takes whole rows in and gives whole rows out")
    if cfg.model not in MODELS:
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for the {cfg.tier} tier: it has a "
                         f"tensor-parallel plan for {' and '.join(MODELS)} only")
    if cfg.model_size % tp:
        raise ValueError(f"RunConfig.model_size={cfg.model_size} is invalid for the {cfg.tier} tier: the width "
                         f"must be divisible by the {tp} tensor-parallel ranks")
    if cfg.model == "charformer" and cfg.model_heads % tp:
        raise ValueError(f"RunConfig.model_heads={cfg.model_heads} is invalid for the {cfg.tier} tier: it splits "
                         f"whole attention heads, and the charformer's {cfg.model_heads} heads do not divide over "
                         f"{tp} tensor-parallel ranks (world_size / tp_size)")
    if cfg.model == "mlp" and (o.sequence_parallel or o.loss_parallel):
        field = "sequence_parallel" if o.sequence_parallel else "loss_parallel"
        raise ValueError(f"{name}.{field}=True is invalid with model='mlp': it needs a sequence and a vocabulary "
                         f"head (model='charformer')")
    if o.sequence_parallel and SEQ_LEN % tp:
        raise ValueError(f"{name}.sequence_parallel=True is invalid: the sequence ({SEQ_LEN}) does not divide "
                         f"over {tp} ranks")


def validate(cfg: RunConfig) -> None:
    validate_model(cfg, cfg.world_size, f"{cfg.tier} tier_options")


def mlp_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """The mlp's Linear layers as (colwise, rowwise) pairs, first to last; an odd last Linear stays whole."""
    linears = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    return [(linears[i], linears[i + 1]) for i in range(0, len(linears) - 1, 2)]


def plan(model: nn.Module, options: Options) -> dict[str, Any]:
    """The ``parallelize_module`` plan: module name -> ParallelStyle."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not hasattr(model, "blocks"):  # the mlp (decomposed: no DTensor at all)
        if options.decomposed_mlp:
            return {}
        return {name: style for col, row in mlp_pairs(model)
                for name, style in ((col, ColwiseParallel()), (row, RowwiseParallel()))}
    sp = options.sequence_parallel
    between = Shard(1) if sp else Replicate()  # the layout of activations between pairs
    logits = Shard(-1) if options.loss_parallel else Replicate()
    styles: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(input_layouts=between, output_layouts=logits,
                                use_local_output=not options.loss_parallel),
    }
    if sp:  # positions are added to full rows: the sequence splits where the blocks start (no communication)
        styles["blocks"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
        styles["ln"] = SequenceParallel()
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        # q, k and v read one input: as a DTensor their gradients add up before one reduction (f in Megatron)
        for sub in ("attn",) if options.decomposed_mlp else ("attn", "mlp"):
            styles[f"{b}.{sub}"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                                      use_local_output=False)
        for proj in ("q", "k", "v"):
            styles[f"{b}.attn.{proj}"] = ColwiseParallel()
        styles[f"{b}.attn.out"] = RowwiseParallel(output_layouts=between)
        if not options.decomposed_mlp:  # otherwise the pair is tp_ring's, on plain slices
            styles[f"{b}.mlp.0"] = ColwiseParallel()
            styles[f"{b}.mlp.2"] = RowwiseParallel(output_layouts=between)
        if sp:
            styles[f"{b}.ln1"] = SequenceParallel()
            styles[f"{b}.ln2"] = SequenceParallel()
    return styles


def parallelize(model: nn.Module, mesh: Any, options: Options) -> nn.Module:
    """Split ``model`` over the 1-D ``mesh`` in place (attention keeps ``heads / n`` heads per rank)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in getattr(model, "blocks", []):
        block.attn.heads //= mesh.size()
    return parallelize_module(model, mesh, plan(model, options))


def decompose_mlps(model: nn.Module, ring: Ring) -> dict[str, int]:
    """The mlp's pairs, or each charformer block's MLP, decomposed round ``ring`` (``tp_ring.decompose``)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return decompose(model, mlp_pairs(model), ring)
    sliced: dict[str, int] = {}
    for i, block in enumerate(blocks):
        sliced |= decompose(block.mlp, mlp_pairs(block.mlp), ring, prefix=f"blocks.{i}.mlp.")
    return sliced


def shard_table(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each parameter's placement on this rank: ``{"placements": ["Shard(0)"], "global_shape": [...],
    "local_shape": [...]}`` (plain tensors: ``["whole"]``), for drawing who holds what."""
    out = {}
    for name, p in model.named_parameters():
        local = getattr(p, "_local_tensor", p)
        placements = [str(pl) for pl in p.placements] if hasattr(p, "placements") else ["whole"]
        out[name] = {"placements": placements, "global_shape": list(p.shape), "local_shape": list(local.shape)}
    return out


def loss_context(options: Options) -> contextlib.AbstractContextManager[Any]:
    """With ``loss_parallel``: cross-entropy (and its backward) on vocabulary-sharded logits."""
    if not options.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (a collective for sharded ones: call on every rank)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


class Strategy(base.Strategy):
    comm_channels = ("modules",)  # DTensor communicates inside layers: tag each call by its layer

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.options: Options = cfg.tier_options
        self.data_rank, self.data_world = 0, 1  # every rank sees the whole batch
        self._template: nn.Module | None = None
        self.shards: dict[str, dict[str, Any]] = {}
        self.sliced: dict[str, int] = {}  # decomposed_mlp: parameter -> the dimension its slice was cut along
        self._group: Any = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self._template = meta_copy(model)
        mesh = Layout.of(tp=self.info.world_size).build(self.info.device.type)
        model = parallelize(model, mesh, self.options)
        if self.options.decomposed_mlp:
            self._group = mesh.get_group()
            self.sliced = decompose_mlps(model, Ring(self._group, overlap=self.options.ring_overlap))
        self.shards = shard_table(model)
        for name, dim in self.sliced.items():  # plain tensors holding this rank's slice
            self.shards[name]["placements"] = [f"Shard({dim})"]
        return model

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        return loss_context(self.options)

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        state = full_state(model)
        if self.sliced:
            state.update(gather_slices(model, self.sliced, self._group))
        if not self.info.is_main:
            return state, {}
        assert self._template is not None, "wrap() first"
        plain = plain_copy(self._template, state, model, self.info.device, self.cfg.tier)
        return state, evaluate(plain, data, self.info.device)

    def describe(self) -> dict[str, Any]:
        return {"tp_size": self.info.world_size, "sequence_parallel": self.options.sequence_parallel,
                "loss_parallel": self.options.loss_parallel, "decomposed_mlp": self.options.decomposed_mlp,
                "shards": self.shards}


SPEC = TierSpec(name="tp", summary="tensor parallel: Megatron column/row splits on a DeviceMesh",
                options=Options, validate=validate, strategy=Strategy, models=MODELS)
