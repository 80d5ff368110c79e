"""DDP's knobs, which every DDP-based tier has (``BucketOptions``), and how DDP reduces a bucket.

A bucket is reduced by DDP's built-in all-reduce, one of torch's comm hooks, or as quantised codes:
``comm_hook`` (``allreduce``, ``fp16``, ``bf16``, ``powersgd``) picks one of torch's hooks; ``comm_dtype``
(bf16, int8, fp8) sends each bucket as codes instead (``dtlab.tiers.parts.quantised_comms``). ``check`` names a
knob that cannot run before any process starts; ``comm_hook`` returns the (state, hook) pair DDP registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from dtlab.core.config import RunConfig
from dtlab.core.env import resolve_backend
from dtlab.core.quantise import check_options
from dtlab.tiers.parts.quantised_comms import hook_for

__all__ = ["BucketOptions", "COMM_HOOKS", "check", "comm_hook"]

COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class BucketOptions:
    """DDP's own knobs: every DDP-based tier has them."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    accumulation_steps: int = 1  # micro-batches per step; all but the last under no_sync()
    comm_hook: str = "allreduce"
    powersgd_rank: int = 1
    sync_batchnorm: bool = False
    broadcast_buffers: bool = True


def check(cfg: RunConfig, o: Any, name: str) -> None:
    """The ``BucketOptions`` of a DDP-based tier, and ``comm_dtype``/``comm_block`` where the options have them."""
    if not o.bucket_cap_mb > 0:
        raise ValueError(f"{name}.bucket_cap_mb={o.bucket_cap_mb!r} is invalid: must be > 0 MB")
    if not isinstance(o.accumulation_steps, int) or o.accumulation_steps < 1:
        raise ValueError(f"{name}.accumulation_steps={o.accumulation_steps!r} is invalid: must be an integer >= 1")
    if cfg.per_rank_batch % o.accumulation_steps:
        raise ValueError(f"{name}.accumulation_steps={o.accumulation_steps} is invalid: it must divide the "
                         f"per-rank batch ({cfg.global_batch_size} / {cfg.world_size} = {cfg.per_rank_batch})")
    if o.comm_hook not in COMM_HOOKS:
        raise ValueError(f"{name}.comm_hook={o.comm_hook!r} is invalid: choose one of {', '.join(COMM_HOOKS)}")
    backend, _ = resolve_backend(cfg.backend, cfg.device)
    if o.comm_hook == "bf16" and backend != "nccl":
        raise ValueError(f"{name}.comm_hook='bf16' needs the nccl backend: torch refuses bf16 all-reduce on "
                         f"{backend}; use 'fp16' there")
    if o.powersgd_rank < 1:
        raise ValueError(f"{name}.powersgd_rank={o.powersgd_rank!r} is invalid: must be >= 1")
    if not hasattr(o, "comm_dtype"):
        return
    check_options(o, name, ("comm_dtype",))
    if o.comm_dtype != "fp32" and o.comm_hook != "allreduce":
        raise ValueError(f"{name}.comm_dtype={o.comm_dtype!r} is invalid with comm_hook={o.comm_hook!r}: both "
                         "choose how buckets are reduced; use comm_hook='allreduce'")


def comm_hook(options: Any) -> tuple[Any, Any]:
    """The (state, hook) pair DDP registers for ``options.comm_hook`` (or a quantised ``comm_dtype``); (None, None)
    for DDP's built-in all-reduce."""
    if getattr(options, "comm_dtype", "fp32") != "fp32":
        return hook_for(options.comm_dtype, options.comm_block)
    if options.comm_hook == "fp16":
        return None, default_hooks.fp16_compress_hook
    if options.comm_hook == "bf16":
        return None, default_hooks.bf16_compress_hook
    if options.comm_hook == "powersgd":
        # start_powerSGD_iter=2: compress from the second step (DDP rebuilds buckets after the first).
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=options.powersgd_rank,
                                            start_powerSGD_iter=2, random_seed=0)
        return state, powerSGD_hook.powerSGD_hook
    return None, None
