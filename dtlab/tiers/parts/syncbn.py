"""Synchronised batch norm that runs on CPU (gloo), for the SyncBatchNorm lesson.

Why this exists: with DDP every rank normalises with the statistics of its own
slice of the batch, so a model with BatchNorm trained on W ranks is not the
model trained on one device with the W-times larger batch. ``nn.SyncBatchNorm``
fixes that, but only on GPUs: DDP refuses it in a CPU module ("SyncBatchNorm
layers only work with GPU modules") and its forward rejects CPU input. dtlab
teaches on CPU, so ``CPUSyncBatchNorm`` does the same job with plain
``torch.distributed.all_reduce`` calls, which gloo runs and dtlab's
``CommRecorder`` sees:

* forward: one all_reduce of a packed ``[sum(x), sum(x*x), count]`` per
  channel gives the global mean and biased variance to normalise with; the
  running stats get the global unbiased variance, with BatchNorm's momentum.
* backward: one all_reduce of ``[sum(dy), sum(dy*x_hat)]`` per channel makes
  the input gradient that of single-device BatchNorm on the concatenated batch.
  Weight and bias gradients stay local sums; DDP's averaging finishes them.

On CUDA use torch's own: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
(fused kernels, NCCL). This module is a teaching implementation, not a fast one.

Gradient scaling, stated once: let rank r's loss be ``L_r`` and ``S = sum_r L_r``.
The synchronised backward gives each rank ``dS/dx_r`` (its grad_out is
``dL_r/dy_r = dS/dy_r``, and the all-reduced sums mix every rank's). With DDP's
usual loss, a mean over the local batch of n = N/W rows, ``S = W * L`` where
``L`` is the single-device mean over N rows; DDP divides its gradient sums by
W, so every parameter (those before the norm, the norm's weight and bias, and
those after) ends up with exactly ``dL/dtheta``. No extra scaling is needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["CPUSyncBatchNorm", "convert_sync_batchnorm", "sync_batchnorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channel one (dim 1): N for (N, C), N, H, W for (N, C, H, W)..."""
    return [0, *range(2, x.dim())]


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Shape a (C,) tensor to broadcast against an (N, C, ...) one."""
    return t.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm over the global batch; explicit backward with one all_reduce each way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, process_group: Any) -> torch.Tensor:
        dims = _reduce_dims(x)
        channels = x.shape[1]
        # Statistics in float64: sum(x*x)/n - mean^2 loses digits in float32 when |mean| >> std.
        x64 = x.detach().to(torch.float64)
        local_count = torch.full((1,), x.numel() // channels if channels else 0, dtype=torch.float64)
        packed = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), local_count])
        dist.all_reduce(packed, group=process_group)  # one collective, not three
        total_sum, total_sq, count = packed[:channels], packed[channels:2 * channels], packed[-1].item()
        if count <= 1:
            # Same rule as BatchNorm, on the global count (every rank sees it, so every rank raises).
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(count)} in total")
        mean = total_sum / count
        var = (total_sq / count - mean * mean).clamp_min(0.0)  # biased: what BatchNorm normalises with
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None and running_var is not None:
            # BatchNorm's update: the running variance takes the *unbiased* estimate.
            unbiased = var * (count / (count - 1))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        compute = torch.promote_types(x.dtype, torch.float32)  # half inputs normalise in float32
        mean_c = _per_channel(mean.to(compute), x.dim())
        invstd_c = _per_channel(invstd.to(compute), x.dim())
        x_hat = (x.to(compute) - mean_c) * invstd_c
        y = x_hat
        if weight is not None:
            y = y * _per_channel(weight.to(compute), x.dim())
        if bias is not None:
            y = y + _per_channel(bias.to(compute), x.dim())

        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.count = count
        ctx.process_group = process_group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean_c, invstd_c = ctx.saved_tensors
        dims = _reduce_dims(x)
        channels = x.shape[1]
        compute = mean_c.dtype
        g = grad_out.to(compute)
        x_hat = (x.to(compute) - mean_c) * invstd_c  # recomputed rather than saved: one tensor less kept
        sum_dy = g.sum(dims, dtype=torch.float64)
        sum_dy_xhat = (g * x_hat).sum(dims, dtype=torch.float64)

        grad_x = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)  # local sum: DDP averages it over ranks
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)  # local sum too
        if ctx.needs_input_grad[0]:
            # The global means of dy and dy*x_hat are the two terms through which every row's
            # gradient depends on every other row's (via the batch mean and variance).
            packed = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(packed, group=ctx.process_group)
            mean_dy = _per_channel((packed[:channels] / ctx.count).to(compute), x.dim())
            mean_dy_xhat = _per_channel((packed[channels:] / ctx.count).to(compute), x.dim())
            scale = invstd_c if weight is None else invstd_c * _per_channel(weight.to(compute), x.dim())
            grad_x = ((g - mean_dy - x_hat * mean_dy_xhat) * scale).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the global batch of all ranks; works on CPU with gloo.

    Takes (N, C) or (N, C, *) input, like ``nn.SyncBatchNorm``. In training mode
    with a process group of more than one rank it all-reduces per-channel
    statistics (forward) and gradient statistics (backward) over
    ``process_group`` (default: the default group). Without a process group, with
    one rank, or in eval mode it is exactly plain BatchNorm and communicates
    nothing. Every rank of the group must run the layer the same number of
    times, as with any collective. On CUDA, prefer ``torch.nn.SyncBatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # From here to bn_training: _BatchNorm.forward's bookkeeping, unchanged, so the
        # single-rank path matches it bit for bit.
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None

        # Like torch's SyncBatchNorm: no synchronisation in eval mode, even without running stats.
        group = None
        if bn_training and self.training and dist.is_available() and dist.is_initialized():
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            if dist.get_world_size(group) <= 1:
                group = None
        if group is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training,
                                exponential_average_factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            exponential_average_factor, group)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.process_group is None else ", process_group=<given>")


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with synchronised BatchNorm: torch's ``SyncBatchNorm`` on CUDA (it is GPU-only), dtlab's
    ``CPUSyncBatchNorm`` elsewhere (the same all-reduces)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return convert_sync_batchnorm(model)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm*d in ``module`` by ``CPUSyncBatchNorm``; returns the (possibly new) module.

    Like ``nn.SyncBatchNorm.convert_sync_batchnorm``: the new layers share the
    old ones' weight, bias and buffer tensors (so an optimizer built earlier
    still updates them) and keep eps, momentum, affine, track_running_stats and
    training mode. Layers already converted are left as they are, so converting
    twice is the same as once. Convert before wrapping in DDP.
    """
    if isinstance(module, CPUSyncBatchNorm):
        return module
    out = module
    if isinstance(module, _BatchNorm):
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats, process_group)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias  # may be None (BatchNorm(bias=False) in newer torch)
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out
