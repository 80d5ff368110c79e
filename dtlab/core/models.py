"""Built-in models, sized by one knob (``width``), and user factories.

Models are built after ``torch.manual_seed(seed)`` on every rank, so every
rank starts from the same parameters without a broadcast (DDP broadcasts
anyway; the naive tier does it by hand to show why).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.core import moe
from dtlab.core.charformer import CharFormer
from dtlab.core.compat import in_backward
from dtlab.core.config import resolve_import_path
from dtlab.core.data import Dataset
from dtlab.core.memory import note_saved


def mlp(input_shape: tuple[int, ...], num_classes: int, width: int = 64, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    n_in = math.prod(input_shape)
    for _ in range(depth):
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    layers.append(nn.Linear(n_in, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 64, batchnorm: bool = False) -> nn.Module:
    """A small CNN for 8x8 images. With ``batchnorm`` it teaches why BN breaks parity."""
    c = max(4, width // 4)
    norm = (lambda n: nn.BatchNorm2d(n)) if batchnorm else (lambda n: nn.Identity())
    return nn.Sequential(
        nn.Conv2d(input_shape[0], c, 3, padding=1), norm(c), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1), norm(2 * c), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(8 * c, num_classes),
    )


def build(spec: str | Callable[..., Any], input_shape: tuple[int, ...], num_classes: int, width: int,
          depth: int = 2, routing: Any = None, dtype: torch.dtype = torch.float32, heads: int = 2) -> nn.Module:
    """Make the model named by ``spec`` (built-in name, import path or callable); ``routing``: the ``moe``
    model's ``dtlab.core.moe.Routing`` (its defaults when None); ``heads``: the charformer's and the moe
    model's attention heads. Other than float32, ``dtype`` converts the floating-point parameters and buffers
    after the (float32) initialisation: the same starting values."""
    model = _build(spec, input_shape, num_classes, width, depth, routing, heads)
    return model if dtype == torch.float32 else model.to(dtype)


def _build(spec: str | Callable[..., Any], input_shape: tuple[int, ...], num_classes: int, width: int,
           depth: int, routing: Any, heads: int) -> nn.Module:
    if spec == "mlp":
        return mlp(input_shape, num_classes, width, depth)
    if spec == "cnn":
        return cnn(input_shape, num_classes, width)
    if spec == "cnn-bn":
        return cnn(input_shape, num_classes, width, batchnorm=True)
    if spec == "charformer":
        return CharFormer(num_classes, input_shape[0], width, layers=depth, heads=heads)
    if spec == "moe":
        return moe.MoEFormer(num_classes, input_shape[0], width, depth, routing or moe.Routing(), heads)
    if isinstance(spec, str):
        spec = resolve_import_path(spec)
    params = inspect.signature(spec).parameters
    model = spec(input_shape, num_classes) if len(params) >= 2 else spec()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


class Recompute:
    """A block's ``forward`` that keeps only its input and runs again in backward (activation checkpointing).

    Stored as the block's instance attribute ``forward``, so parameter names, hooks
    (FSDP, tensor parallelism) and the state dict stay the block's own.
    ``seconds`` adds up the time spent recomputing, in backward.
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.seconds = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        note_saved(x)
        return checkpoint(self._run, x, use_reentrant=False)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if not in_backward():  # the first forward: not a recomputation
            return type(self.block).forward(self.block, x)
        t0 = time.perf_counter()
        try:
            return type(self.block).forward(self.block, x)
        finally:  # checkpoint stops a recomputation early (an exception) once it has what backward needs
            self.seconds += time.perf_counter() - t0


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute each of ``model.blocks`` in backward; returns how many (ValueError if the model has none)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or not len(blocks):
        raise ValueError(f"RunConfig.activation_checkpointing=True needs a model with a .blocks list; "
                         f"{type(model).__name__} has none")
    for block in blocks:
        block.forward = Recompute(block)
    return len(blocks)


def recompute_seconds(model: nn.Module) -> float:
    """Seconds spent so far recomputing checkpointed blocks."""
    return sum(m.forward.seconds for m in model.modules() if isinstance(m.__dict__.get("forward"), Recompute))


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every prediction (any output rank): the training loss."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# The auxiliary-loss protocol: a module whose forward computes a loss of its own (the moe model's
# load-balancing loss) stores it, already scaled, as ``aux_loss`` (a 0-d tensor); training_loss adds
# every module's to the task loss. The step-statistics protocol: a module with ``pop_step_stats()``
# returns numbers gathered since the last call; the loop adds them to the step's row. The training
# loop knows these two, not the modules behind them.
def training_loss(model: nn.Module, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``loss(logits, target)`` plus the auxiliary losses the model's modules left from this forward."""
    total = loss(logits, target)
    for m in model.modules():
        extra = getattr(m, "aux_loss", None)
        if isinstance(extra, torch.Tensor):
            total = total + extra
            m.aux_loss = None  # read once: a later forward sets it again
    return total


def step_stats(model: nn.Module) -> dict[str, float]:
    """The modules' ``pop_step_stats()``, summed by key (e.g. tokens per expert over all MoE layers)."""
    out: dict[str, float] = {}
    for m in model.modules():
        pop = getattr(m, "pop_step_stats", None)
        if callable(pop):
            for key, value in pop().items():
                out[key] = out.get(key, 0.0) + value
    return out


def loss_and_correct(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the number of correct predictions (any output rank)."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_target)
    correct = (flat_logits.argmax(-1) == flat_target).sum()
    return loss, correct


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, device: torch.device,
             batch: int = 512) -> dict[str, float]:
    """Held-out mean loss and accuracy on the test split, in eval mode."""
    was_training = model.training
    model.eval()
    total_loss, correct, targets = 0.0, 0, 0
    for i in range(0, len(data.test_x), batch):
        x, y = data.test_x[i:i + batch].to(device), data.test_y[i:i + batch].to(device)
        loss, right = loss_and_correct(model(x), y)
        total_loss += loss.item() * y.numel()
        correct += int(right)
        targets += y.numel()
    model.train(was_training)
    return {"loss": total_loss / targets, "accuracy": correct / targets}
