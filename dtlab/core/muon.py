"""Muon: each hidden 2-D weight's update orthogonalised by a Newton–Schulz iteration, AdamW for every other parameter.

Muon (Jordan et al. 2024) keeps SGD's Nesterov momentum per matrix and replaces the momentum ``G`` by the
nearest semi-orthogonal matrix ``U Vᵀ`` (``G = U S Vᵀ``): every direction of the update gets the same size,
whatever the gradient's spectrum. ``newton_schulz`` approximates ``U Vᵀ`` without an SVD by five steps of
the quintic ``X ← aX + b(XXᵀ)X + c(XXᵀ)²X`` (Jordan's coefficients), which push every singular value of
``G / ‖G‖_F`` towards 1 (into about [0.7, 1.2]). The update is scaled by ``0.2 · √max(rows, cols)``
(Liu et al. 2025, "Muon is scalable"), which gives it AdamW's typical size, so one learning rate serves
both halves. Weight decay is decoupled, 0 by default as dtlab's other optimizers have none.

Which parameters take Muon follows its references (Jordan's Muon, Moonlight): only the hidden matrices. The
embeddings, the input layer (which plays the embedding's part in a model without one), the output head and
every 1-D parameter (biases, norms) take AdamW. ``param_groups(model)`` makes the two groups, each saying
``use_muon``, as Jordan's ``MuonWithAuxAdam`` takes them; ``Muon`` refuses a group that does not say, since
a flat list of parameters cannot tell a hidden matrix from the head.

Muon needs each matrix whole: a tier that shards parameters must bring a matrix's gradient together
before orthogonalising it (``assign_owners`` says which rank does, whole parameters dealt out).
The arithmetic works on plain tensors (``local`` takes a DTensor's shard), so a sharded tier reuses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["NS_COEFFICIENTS", "Muon", "adamw_update_", "apply_matrix_update_", "assign_owners", "hidden_matrices",
           "local", "momentum_direction", "newton_schulz", "param_groups", "update_scale"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """About ``U Vᵀ`` of ``g = U S Vᵀ`` (every singular value pushed towards 1), in ``g``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g / (g.norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: XXᵀ is the smaller square
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def update_scale(shape: Sequence[int]) -> float:
    """The factor that gives an orthogonalised update of a ``rows x cols`` matrix AdamW's typical size."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon steps, in ``model.parameters()`` order: the 2-D weights other than the embeddings',
    the input layer's and the output head's.

    The input layer is the first parameter of two or more dimensions, the head the last one, in the order
    the model registers them (its layers' order in dtlab's models: the mlp's first and last Linear, the
    charformer's token embedding and ``head``). Convolution filters (4-D) stay on AdamW as before.
    """
    params = list(model.parameters())
    weights = [p for p in params if p.ndim >= 2]
    outer = {id(weights[0]), id(weights[-1])} if weights else set()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [p for p in params if p.ndim == 2 and id(p) not in outer | embeddings]


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """``model``'s parameters as ``Muon`` takes them: the hidden matrices with ``use_muon=True``, the rest with
    ``use_muon=False`` (an empty group left out)."""
    hidden = hidden_matrices(model)
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [g for g in ({"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}) if g["params"]]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor itself."""
    return getattr(t, "_local_tensor", t)


def momentum_direction(grad: torch.Tensor, state: dict[str, Any], momentum: float, nesterov: bool) -> torch.Tensor:
    """Add ``grad`` into the momentum buffer in ``state``; the direction to orthogonalise (Nesterov's look-ahead)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    buf = state["momentum_buffer"]
    buf.mul_(momentum).add_(grad)
    return grad.add(buf, alpha=momentum) if nesterov else buf.clone()


def apply_matrix_update_(param: torch.Tensor, orthogonal: torch.Tensor, shape: Sequence[int], lr: float,
                         weight_decay: float) -> None:
    """``param -= lr · scale · orthogonal`` (after decoupled decay); ``param`` may be rows of a ``shape`` matrix."""
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(orthogonal, alpha=-lr * update_scale(shape))


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], lr: float,
                  betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step of ``param`` in place (torch's single-tensor AdamW, in the same order of operations)."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


def assign_owners(sizes: Sequence[int], world: int) -> list[int]:
    """Each parameter's owning rank: largest first, to the rank holding the fewest elements so far (the lowest
    rank on a tie), as ZeroRedundancyOptimizer deals out whole parameters."""
    owners = [0] * len(sizes)
    held = [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = held.index(min(held))
        owners[i] = rank
        held[rank] += sizes[i]
    return owners


class Muon(torch.optim.Optimizer):
    """Muon for the groups with ``use_muon=True`` (2-D only), AdamW for the rest, one learning rate.

    Build it over ``param_groups(model)`` (see the module's docstring).
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"Muon: lr={lr!r} must be > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=betas,
                                      eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            if "use_muon" not in group:
                raise ValueError("Muon: each parameter group must say use_muon=True or False (muon.param_groups("
                                 "model) makes them): a list of parameters cannot tell a hidden matrix from an "
                                 "embedding or the output head")
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon: a group with use_muon=True holds a parameter that is not 2-D")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self.step_matrices(params, group)
                continue
            for p in params:
                adamw_update_(local(p), local(p.grad), self.state[p], group["lr"], group["betas"], group["eps"],
                              group["weight_decay"])
        return loss

    def step_matrices(self, matrices: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Muon's step of whole matrices held by this process (a sharded tier overrides this)."""
        for p in matrices:
            direction = momentum_direction(p.grad, self.state[p], group["momentum"], group["nesterov"])
            apply_matrix_update_(p, newton_schulz(direction, group["ns_steps"]), p.shape, group["lr"],
                                 group["weight_decay"])
