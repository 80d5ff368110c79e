"""What a forward keeps for backward, counted from the model itself on fake tensors.

The model is built and run under ``FakeTensorMode``: shapes, dtypes and autograd's
saved tensors are real, storage is not, so a 7B model costs nothing. The counting
is the measured side's (``dtlab.core.memory.SavedActivations``): every tensor
autograd saves (and, under activation checkpointing, each block's input), distinct
storages once, parameters left out. Autocast is CPU's (fake tensors pretend to be
CPU tensors), so bf16 copies of matmul inputs are counted at their size. A user's
own ``--model pkg.mod:factory`` is counted the same way as the built-ins.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.job import load_data, routing, torch_dtype
from dtlab.core.memory import SavedActivations
from dtlab.core.moe import even_assign, routing_of


@dataclass(frozen=True)
class Shapes:
    """One sample's input and target: shape and dtype, read from the dataset."""

    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    target_shape: tuple[int, ...]
    num_classes: int


def shapes(cfg: RunConfig) -> Shapes:
    data = load_data(cfg)  # floating-point inputs in the job's dtype
    x, y = data.train_x[0], data.train_y[0]
    return Shapes(tuple(data.input_shape), x.dtype, tuple(y.shape), data.num_classes)


def fake_model(cfg: RunConfig, s: Shapes, mode: FakeTensorMode) -> nn.Module:
    """The job's model, on fake tensors (with its blocks checkpointed if the job asks for it).

    A MoE layer's routing depends on values fake tensors lack: it assigns the tokens evenly
    (``even_assign``), which leaves a dropless layer's saved bytes as they are: the experts'
    rows add up to tokens x k however they are shared."""
    with mode, default_dtype(torch_dtype(cfg)):  # made in the job's dtype: converting fake parameters fails
        model = models.build(cfg.model, s.input_shape, s.num_classes, cfg.model_size, cfg.model_depth, routing(cfg),
                             heads=cfg.model_heads)
        if cfg.activation_checkpointing:
            models.checkpoint_blocks(model)
    for layer in routing_of(model):
        layer.assign = functools.partial(even_assign, layer.routing)
    return model


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # fake storages have no address: the StorageImpl identifies them


def saved_bytes(saved: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor]) -> int:
    """Distinct storages' bytes, leaving out ``exclude``'s (parameters are counted as parameters)."""
    skip = {storage_key(t) for t in exclude}
    seen: dict[int, int] = {}
    for t in saved:
        key = storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def autocast(cfg: RunConfig) -> contextlib.AbstractContextManager[object]:
    if cfg.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_saved(cfg: RunConfig, mode: FakeTensorMode, module: nn.Module, xs: Sequence[torch.Tensor],
                  ys: Sequence[torch.Tensor] | None = None) -> tuple[int, list[torch.Tensor]]:
    """Bytes saved for backward by ``module``'s forwards of the micro-batches ``xs`` held at once (with the
    loss when targets ``ys`` are given): a storage several of them save (the batch they slice) counts once."""
    outs = []
    with mode, SavedActivations() as acts, autocast(cfg):
        for i, x in enumerate(xs):
            out = module(x)
            outs.append(models.loss(out, ys[i]) if ys is not None else out)
    return saved_bytes(acts.tensors, module.parameters()), outs


def batch(s: Shapes, n: int, mode: FakeTensorMode) -> tuple[torch.Tensor, torch.Tensor]:
    """A fake micro-batch of ``n`` samples."""
    with mode:
        if s.input_dtype.is_floating_point:
            x = torch.empty((n, *s.input_shape), dtype=s.input_dtype)
        else:
            x = torch.zeros((n, *s.input_shape), dtype=s.input_dtype)
        y = torch.zeros((n, *s.target_shape), dtype=torch.long)
    return x, y


def activation_bytes(cfg: RunConfig, s: Shapes, samples: int) -> int:
    """What one forward (and the loss) of ``samples`` samples saves for backward."""
    mode = FakeTensorMode()
    model = fake_model(cfg, s, mode)
    x, y = batch(s, samples, mode)
    return forward_saved(cfg, mode, model, [x], [y])[0]
