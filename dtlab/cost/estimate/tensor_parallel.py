"""Memory rules for the tiers that split tensors rather than the batch: ``tp``, ``fsdp-tp`` and ``cp``.

Same signature as ``memory.RULES``' rules: ``(cfg, model, s) -> list[RankMemory]``, ``model`` the job's
fake model (read for its parameters' shapes only). Nothing is launched and no process group exists, so
DTensor cannot run; instead each rank's computation is rebuilt on fake tensors:

* parameters, gradients and optimizer state come from ``tp.plan``'s placements, with DTensor's uneven
  rule (torch.chunk's split: ceil(size / n), the last ranks may hold less);
* activations come from a fake forward of a *local* model: every Linear the plan splits has its local
  width, attention keeps ``heads / n`` heads, and hooks stand in for the collectives where the layout
  changes (an all-gather makes a fresh full tensor, a reduce-scatter or a sequence split a fresh chunk),
  so autograd saves exactly the tensors one rank's DTensor forward saves;
* cp runs the tier's own ``chunk_forward`` and attention on fake tensors, with the tier's solo stand-ins
  for the ring and the all-to-all (``SoloRing``, ``SoloSwap``: fresh tensors of the same shapes, no peers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN
from dtlab.cost.estimate import activations as acts
from dtlab.cost.estimate.rank import ADAM_STEP_BYTES, RankMemory, nbytes, optimizer_bytes
from dtlab.cost.estimate.sharded import gathered_peak, local_rows, shard_rows
from dtlab.tiers import cp as cp_tier
from dtlab.tiers import tp as tp_tier
from dtlab.tiers.parts import cp_layout, cp_ring, cp_ulysses

__all__ = ["RULES", "context_parallel", "fsdp_tensor_parallel", "localize", "shard_dims", "tensor_parallel"]

def share(size: int, n: int, i: int) -> int:
    """Rank ``i``'s part of ``size`` split ``n`` ways as DTensor splits it (torch.chunk: the last may hold less)."""
    c = math.ceil(size / n)
    return max(0, min(c, size - i * c))


def shard_dims(model: nn.Module, options: tp_tier.Options) -> tuple[dict[str, int], set[str]]:
    """Parameter name -> the dim the tp plan shards it on (absent: replicated); and the Rowwise embeddings'
    weights, whose gradient comes back whole (DTensor's embedding backward yields a Replicate gradient)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[str, int] = {}
    whole_grad: set[str] = set()
    for name, style in tp_tier.plan(model, options).items():
        m = model.get_submodule(name)
        linear = isinstance(m, nn.Linear)
        if isinstance(style, ColwiseParallel):  # output features: Linear rows and bias; Embedding columns
            dims[f"{name}.weight"] = 0 if linear else 1
            if linear and m.bias is not None:
                dims[f"{name}.bias"] = 0
        elif isinstance(style, RowwiseParallel):  # input features: Linear columns (bias whole); Embedding rows
            dims[f"{name}.weight"] = 1 if linear else 0
            if not linear:
                whole_grad.add(f"{name}.weight")
    return dims, whole_grad


def local_shape(shape: torch.Size, dim: int | None, n: int, i: int) -> tuple[int, ...]:
    """``shape`` with rank ``i``'s share of ``dim`` (None: whole)."""
    out = list(shape)
    if dim is not None:
        out[dim] = share(shape[dim], n, i)
    return tuple(out)


def meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")  # sizes only, for memory.py's byte helpers


def tp_locals(model: nn.Module, options: tp_tier.Options, n: int, i: int) -> dict[str, torch.Tensor]:
    """Each parameter's exact local shard on tensor-parallel rank ``i`` of ``n``, as a meta tensor."""
    dims, _ = shard_dims(model, options)
    return {name: meta(local_shape(p.shape, dims.get(name), n, i), p.dtype) for name, p in model.named_parameters()}


# -- the local model: one rank's widths, collectives as hooks ------------------------------
def _gather(x: torch.Tensor, dim: int, full: int) -> torch.Tensor:
    """An all-gather's output: a fresh tensor ``full`` long on ``dim`` (the peers' parts have this one's shape)."""
    out = torch.cat([x] * math.ceil(full / max(1, x.shape[dim])), dim)
    return out if out.shape[dim] == full else out.narrow(dim, 0, full).clone(memory_format=torch.contiguous_format)


def _split(x: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    """A reduce-scatter's (or a local split's) output: rank ``i``'s chunk of ``dim``, in a fresh tensor."""
    size = x.shape[dim]
    start = min(i * math.ceil(size / n), size)
    return x.narrow(dim, start, share(size, n, i)).clone(memory_format=torch.contiguous_format)


def _shrunk(m: nn.Module, style: Any, n: int, i: int) -> nn.Module:
    """``m`` with its local width under a Colwise/Rowwise style (built under the caller's fake mode)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    col = isinstance(style, ColwiseParallel)
    if isinstance(m, nn.Linear):
        fan_in = m.in_features if col else share(m.in_features, n, i)
        fan_out = share(m.out_features, n, i) if col else m.out_features
        return nn.Linear(fan_in, fan_out, bias=m.bias is not None, dtype=m.weight.dtype)
    assert isinstance(m, nn.Embedding), f"no tensor-parallel rule for {type(m).__name__}"
    rows = m.num_embeddings if col else share(m.num_embeddings, n, i)
    return nn.Embedding(rows, share(m.embedding_dim, n, i) if col else m.embedding_dim, dtype=m.weight.dtype)


def _lay_out(m: nn.Module, style: Any, n: int, i: int, full_out: int) -> None:
    """Hooks on ``m`` for the layouts its style changes: Shard -> Replicate is an all-gather (a fresh full
    tensor), Replicate -> Shard(1) a split, a Rowwise output onto Shard(1) a reduce-scatter (fresh chunks).
    ``full_out``: the unsplit output width, for a Colwise output gathered back whole (the vocabulary head)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    have = getattr(style, "input_layouts", (None,))[0]
    want = getattr(style, "desired_input_layouts", (have,))[0]  # Rowwise reads its Shard(-1) input as it comes
    if isinstance(have, Shard) and isinstance(want, Replicate):  # the sequence splits evenly (tp.validate_model)
        m.register_forward_pre_hook(lambda _, a: (_gather(a[0], have.dim, a[0].shape[have.dim] * n), *a[1:]))
    elif isinstance(have, Replicate) and isinstance(want, Shard):
        m.register_forward_pre_hook(lambda _, a: (_split(a[0], want.dim, n, i), *a[1:]))
    out = getattr(style, "output_layouts", (None,))[0]
    if isinstance(style, ColwiseParallel) and isinstance(out, Replicate):
        m.register_forward_hook(lambda _, a, y: _gather(y, -1, full_out))
    elif isinstance(style, RowwiseParallel) and isinstance(out, Shard):
        m.register_forward_hook(lambda _, a, y: _split(y, out.dim, n, i))


def localize(model: nn.Module, options: tp_tier.Options, n: int, i: int, mode: FakeTensorMode) -> nn.Module:
    """``model`` (fake, built under ``mode``) as tensor-parallel rank ``i`` of ``n`` computes it, in place:
    its parameters become exactly rank ``i``'s local shards, its forward saves what that rank's saves."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    for block in getattr(model, "blocks", []):
        block.attn.heads //= n  # as tp.parallelize: whole heads per rank
    with mode:
        for name, style in tp_tier.plan(model, options).items():
            m = model.get_submodule(name)
            full_out = getattr(m, "out_features", 0)
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                parent, _, leaf = name.rpartition(".")
                m = _shrunk(m, style, n, i)
                setattr(model.get_submodule(parent), leaf, m)
            _lay_out(m, style, n, i, full_out)
    return model


def local_activations(cfg: RunConfig, s: acts.Shapes, options: tp_tier.Options, n: int, i: int,
                      samples: int) -> tuple[int, nn.Module]:
    """What tensor-parallel rank ``i`` of ``n`` saves for backward on a batch of ``samples``, and its local
    model (parameters: rank ``i``'s exact shards)."""
    mode = FakeTensorMode()
    model = localize(acts.fake_model(cfg, s, mode), options, n, i, mode)
    x, y = acts.batch(s, samples, mode)
    return acts.forward_saved(cfg, mode, model, [x], [y])[0], model


# -- the rules ---------------------------------------------------------------------------
def tensor_parallel(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """tp: every rank holds its slice of each split parameter and the whole of the rest; every rank runs
    the whole batch through its slices."""
    n, options = cfg.world_size, cfg.tier_options
    dims, whole_grad = shard_dims(model, options)
    notes = ["parameters split as tp.plan says (Colwise: Linear rows and bias; Rowwise: Linear columns, "
             "Embedding rows), by torch.chunk's rule; a dim-0 shard keeps DTensor's padded buffer "
             "(ceil(rows / n) rows on every rank), gradients and optimizer state the exact rows",
             "the token embedding's gradient is whole on every rank (DTensor's embedding backward is Replicate)",
             f"activations: the whole batch of {cfg.global_batch_size} through each rank's local widths; "
             "all-gathered tensors whole, sequence-parallel ones 1/n"]
    out = []
    for i in range(n):
        locals_ = tp_locals(model, options, n, i)
        params = [shard_rows(p, n) if dims.get(k) == 0 else nbytes(t)
                  for (k, p), t in zip(model.named_parameters(), locals_.values())]
        grads = [nbytes(p if k in whole_grad else locals_[k]) for k, p in model.named_parameters()]
        saved, _ = local_activations(cfg, s, options, n, i, cfg.global_batch_size)
        memory = {"parameters": sum(params), "gradients": sum(grads),
                  "optimizer_state": optimizer_bytes(cfg, locals_.values()), "activations": saved,
                  "comm_buffers": 0}
        out.append(RankMemory(i, memory, notes))
    return out


def fsdp_tensor_parallel(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """fsdp-tp: rank r = row * tp_size + column; tp within a row as the tp rule, then FSDP2 splits each
    local shard by rows down the column, as the fsdp rule (padded parameters and gradients, exact state)."""
    o = cfg.tier_options
    tp, dp = o.tp_size, cfg.world_size // o.tp_size
    notes = [f"a {dp} x {tp} mesh: each tensor-parallel shard (torch.chunk's split) split again by FSDP2 "
             "into ceil(rows / dp) padded rows (parameters, gradients); the optimizer's moments take the "
             "unpadded rows",
             f"activations: each row's {cfg.global_batch_size // dp} samples through the local widths",
             "comm_buffers: not measured by the tier; predicted as the fsdp rule's gathered peak of the "
             "tensor-parallel shards"]
    columns = []
    for t in range(tp):
        saved, local = local_activations(cfg, s, o, tp, t, cfg.global_batch_size // dp)
        columns.append((list(tp_locals(model, o, tp, t).values()), saved, gathered_peak(cfg, local)))
    out = []
    for r in range(cfg.world_size):
        row, (locals_, saved, gathered) = r // tp, columns[r % tp]
        shard = sum(shard_rows(p, dp) for p in locals_)
        state = 0 if cfg.optimizer != "adam" else sum(
            2 * local_rows(p, dp, row) + ADAM_STEP_BYTES for p in locals_)
        memory = {"parameters": shard, "gradients": shard, "optimizer_state": state, "activations": saved,
                  "comm_buffers": gathered}
        out.append(RankMemory(r, memory, notes))
    return out


class _Chunk(nn.Module):
    """``cp.chunk_forward`` of one rank's positions as a module (what forward_saved runs)."""

    def __init__(self, model: models.CharFormer, positions: list[int], attend: cp_tier.Attention) -> None:
        super().__init__()
        self.model, self.positions, self.attend = model, positions, attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.tensor(self.positions, device=x.device)  # as cp.Strategy.run_step makes them
        return cp_tier.chunk_forward(self.model, x, positions, self.attend)


def context_parallel(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """cp: every rank holds the whole model, its gradients and its state, and runs its positions of the
    sequence of the whole batch: ring attention (its queries against every earlier chunk's keys, passed
    round the ring) or Ulysses (its heads over the whole sequence, exchanged by all-to-alls)."""
    n, o = cfg.world_size, cfg.tier_options
    params = list(model.parameters())
    p = sum(nbytes(t) for t in params)
    chunk = SEQ_LEN // n
    how = ("ring attention saving q, k, v, its output and log-sum-exp" if o.method == "ring" else
           f"Ulysses: SDPA on {cfg.model_heads // n} head(s) of the whole sequence, after an all-to-all")
    cut = "a view of it: the embedding keeps the batch's storage" if o.balance == "contiguous" else "a copy"
    notes = [f"activations: the {o.balance} positions ({chunk} of {SEQ_LEN}) of the whole batch of "
             f"{cfg.global_batch_size} ({cut}), {how}", "comm_buffers: none kept (the gradients' flat all-reduce "
             "is freed)"]
    out = []
    for i in range(n):
        mode = FakeTensorMode()
        fake = acts.fake_model(cfg, s, mode)
        assert isinstance(fake, models.CharFormer), "cp runs the charformer only (cp.validate)"
        x, y = acts.batch(s, cfg.global_batch_size, mode)
        with mode:  # as cp.Strategy.run_step cuts them
            x, y = cp_layout.local_batch(x, i, n, o.balance), cp_layout.local_batch(y, i, n, o.balance)
        comm = cp_ring.SoloRing(i, n) if o.method == "ring" else cp_ulysses.SoloSwap(i, n)
        attend = cp_tier.attention(o, n, comm)
        positions = cp_layout.positions(i, n, o.balance, SEQ_LEN)
        saved, _ = acts.forward_saved(cfg, mode, _Chunk(fake, positions, attend), [x], [y])
        memory = {"parameters": p, "gradients": p, "optimizer_state": optimizer_bytes(cfg, params),
                  "activations": saved, "comm_buffers": 0}
        out.append(RankMemory(i, memory, notes))
    return out


RULES: dict[str, Callable[..., list[RankMemory]]] = {
    "tp": tensor_parallel, "fsdp-tp": fsdp_tensor_parallel, "cp": context_parallel}
