"""Comparing a learner's numbers with the checker's: differences, factors, flat parameters and a reference run."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, flattened into one tensor (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every p.grad, flattened into one tensor (a copy; zeros for a parameter without one)."""
    return torch.cat([p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters()]).clone()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference (infinite when the shapes differ)."""
    if a.shape != b.shape:
        return math.inf
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def sgd_reference(model: nn.Module, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], steps: int,
                  lr: float) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """One process on the whole batch with SGD: (the gradient at each step, the parameters after each step)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, params = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append(flat_grads(model))
        opt.step()
        params.append(flat_params(model))
    return tuple(grads), tuple(params)


def scale_factor(got: torch.Tensor, ref: torch.Tensor, tol: float) -> float | None:
    """c when ``got`` is c × ``ref`` (to within ``tol`` × max(1, |c|)), else None: the signature of a result off
    by a factor, such as a sum where a mean belongs (n) or a division too many (1/n)."""
    if got.shape != ref.shape or not ref.numel():
        return None
    g, r = got.double().reshape(-1), ref.double().reshape(-1)
    norm = float(r @ r)
    if norm == 0:
        return None
    c = float(g @ r) / norm
    return c if max_abs(g, c * r) <= tol * max(1.0, abs(c)) else None


def world_factor(c: float | None, n: int) -> str | None:
    """"2×" when ``c`` is the world size ``n``, "1/2 of" when it is 1/n; else None."""
    if c is not None and abs(c - n) <= 1e-3 * n:
        return f"{n}×"
    if c is not None and abs(c * n - 1) <= 1e-3:
        return f"1/{n} of"
    return None
