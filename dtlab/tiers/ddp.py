"""Tier: DistributedDataParallel -- ddp_naive's all-reduces, bucketed and overlapped.

DDP registers autograd hooks that put gradients into buckets of
``bucket_cap_mb`` and all-reduce each bucket as soon as it is full, while
backward is still computing the rest. A comm hook decides how a bucket is
reduced (plain all-reduce, fp16/bf16 compression, PowerSGD). A run that
records registers a hook that also records each bucket; one that does not
keeps DDP's built-in C++ all-reduce, so its step times are DDP's own.

``comm_dtype`` (bf16, int8, fp8) sends each bucket as codes instead
(``dtlab.tiers.parts.quantised_comms``): a hook gathers every rank's codes and each
rank sums their decoded values in float32, since gloo adds no such dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtlab.core.config import RunConfig
from dtlab.core.job import OptimizerFactory
from dtlab.core.quantise import COMM_DTYPES
from dtlab.core.registry import TierSpec
from dtlab.instrument.buckets import bucket_layout, comm_buffer_bytes
from dtlab.instrument.recorder import tag_ddp_hook
from dtlab.tiers.parts import base, checkpoint, ddp_knobs
from dtlab.tiers.parts.ddp_knobs import COMM_HOOKS, BucketOptions
from dtlab.tiers.parts.syncbn import sync_batchnorm

__all__ = ["BucketOptions", "COMM_HOOKS", "Options", "SPEC", "Strategy", "validate"]


@dataclass(frozen=True)
class Options(checkpoint.Knobs, BucketOptions):  # DDP's knobs (parts.ddp_knobs), then the checkpoint's
    # Quantised gradients (dtlab.core.quantise): fp32 is DDP's own all-reduce; bf16, int8 and fp8 are gathered as
    # codes with a float32 scale per comm_block elements and summed in float32 on every rank
    comm_dtype: str = "fp32"
    comm_block: int = 128


def validate(cfg: RunConfig) -> None:
    """DDP's knobs (every DDP-based tier calls this), and the checkpoint options where the tier has them."""
    ddp_knobs.check(cfg, cfg.tier_options, f"{cfg.tier} tier_options")
    if isinstance(cfg.tier_options, checkpoint.Knobs):
        checkpoint.validate_knobs(cfg, saves_muon=False)


class Strategy(base.Strategy):
    comm_channels = ("ddp_buckets",)  # the reducer's all-reduces come from C++: name them by bucket

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.options: Options = cfg.tier_options
        self.accumulation_steps = self.options.accumulation_steps
        self.ddp: DistributedDataParallel | None = None
        self.hook_state: Any = None  # the comm hook's state (PowerSGD's matrices), if it has one
        # Tiers built on ddp whose options have no checkpoint knobs (zero, elastic) save nothing here.
        self.checkpoints = checkpoint.Periodic.of(self.options, cfg.steps)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.options.sync_batchnorm:
            model = sync_batchnorm(model, self.info.device)
        device_ids = [self.info.device] if self.info.device.type == "cuda" else None
        # Pass broadcast_buffers only to switch it off: newer torch deprecates the name.
        extra = {} if self.options.broadcast_buffers else {"broadcast_buffers": False}
        self.ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=self.options.bucket_cap_mb,
            gradient_as_bucket_view=self.options.gradient_as_bucket_view, **extra,
        )
        state, hook = ddp_knobs.comm_hook(self.options)
        self.hook_state = state
        if hook is not None:  # its calls are tagged with their bucket (a recorder sees them as any other)
            self.ddp.register_comm_hook(state, tag_ddp_hook(hook))
        # Otherwise DDP's own C++ all-reduce: a Python hook would take the GIL in the reducer's thread per bucket.
        return self.ddp

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = super().make_optimizer(model, build)
        self.start_step = self.checkpoints.setup(model, optimizer, build.keywords)  # 0 unless resuming
        return optimizer

    def on_step_end(self, step: int) -> None:
        self.checkpoints.after_step(step)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def memory(self) -> dict[str, int]:
        """``comm_buffers``: the reducer's buckets and a comm hook's state (``instrument.buckets``)."""
        return {"comm_buffers": comm_buffer_bytes(self.ddp, self.hook_state)} if self.ddp is not None else {}

    def describe(self) -> dict[str, Any]:
        """The knobs and the bucket layout (``bucket_layout``: sizes as a list of ints) for RankResult.strategy."""
        if self.ddp is None:
            return {}
        return {"bucket_cap_mb": self.options.bucket_cap_mb, "comm_hook": self.options.comm_hook,
                "comm_dtype": getattr(self.options, "comm_dtype", "fp32"),
                **bucket_layout(self.ddp), **self.checkpoints.describe()}


SPEC = TierSpec(name="ddp", summary="DistributedDataParallel: bucketed all-reduces overlapped with backward",
                options=Options, validate=validate, strategy=Strategy, preflight=checkpoint.preflight,
                optimizers=("sgd", "adam", "muon"), choices={"comm_hook": COMM_HOOKS, "comm_dtype": COMM_DTYPES})
