"""Memory accounting counted from the tensors themselves.

Counting bytes of the actual parameter, gradient, optimizer-state and saved
activation tensors gives exact figures that are the same on CPU and GPU;
peak RSS (CPU) or ``max_memory_allocated`` (CUDA) is reported beside them.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = _local(t).untyped_storage()  # DTensor shards count their local part
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def parameter_bytes(module: nn.Module) -> int:
    return tensor_bytes(module.parameters())


def gradient_bytes(module: nn.Module) -> int:
    return tensor_bytes(p.grad for p in module.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """State held by this process's optimizer (a ZeRO shard holds only its part)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps a local optimizer
    return tensor_bytes(v for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor))


_counting: list[SavedActivations] = []  # the open counters (innermost last)


def note_saved(t: torch.Tensor) -> None:
    """Count ``t`` as kept for backward by code autograd's hooks do not see (a checkpointed block's input)."""
    if _counting:
        _counting[-1]._tensors.append(t)


class SavedActivations:
    """Counts the bytes autograd saves for backward during the forward pass.

    Inside an activation-checkpointed block autograd saves nothing (the block runs
    again in backward); what the block keeps, its input, is counted through ``note_saved``.
    """

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._tensors.append(t)
        return t

    def __enter__(self) -> SavedActivations:
        self._tensors.clear()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        _counting.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _counting.remove(self)
        self._ctx.__exit__(*exc)

    def bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Saved bytes, leaving out tensors that are counted elsewhere (parameters)."""
        skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
        return tensor_bytes(t for t in self._tensors if _local(t).untyped_storage().data_ptr() not in skip)


def peak_process_bytes(device: torch.device) -> dict[str, int]:
    """The process's peak resident memory; on CUDA also the caching allocator's own figures: bytes in
    tensors now and at the peak, and bytes it holds from the device (reserved) now and at the peak."""
    out = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux reports KiB
    if device.type == "cuda":
        out.update(cuda_allocated=torch.cuda.memory_allocated(device),
                   cuda_max_allocated=torch.cuda.max_memory_allocated(device),
                   cuda_reserved=torch.cuda.memory_reserved(device),
                   cuda_max_reserved=torch.cuda.max_memory_reserved(device))
    return out
