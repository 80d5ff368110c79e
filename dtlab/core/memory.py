"""Memory accounting counted from the tensors themselves.

Counting bytes of the actual parameter, gradient, optimizer-state and saved
activation tensors gives exact figures that are the same on CPU and GPU;
peak RSS (CPU) or ``max_memory_allocated`` (CUDA) is reported beside them.

The kinds of ``RankResult.memory`` (bytes, per rank; distinct storages, so a view counts once):

``parameters``
    This rank's parameters after the tier wrapped the model: a sharded tier's
    shard (fsdp: the local slices), a pipeline stage's layers.
``gradients``
    ``.grad`` of those parameters after the first step's backward and
    gradient sync. With DDP's ``gradient_as_bucket_view=True`` the gradients
    are views into DDP's buckets, so this counts the buckets.
``optimizer_state``
    The optimizer's state tensors after the first step (a ZeRO rank: its shard).
``activations``
    What autograd saves for backward (saved_tensors_hooks), parameters left
    out. The loop counts the first step's first micro-batch forward (with
    gradient accumulation: one micro-batch). The pipeline tier reports its
    own figure: the peak, over the first step, of the bytes held by the
    micro-batches whose forward ran and whose backward has not (see
    ``LiveActivations``); a batch tensor shared by micro-batches counts once.
    Left out: the autograd graph's own nodes, temporaries freed within an op,
    a pipeline stage's received/sent buffers that autograd does not save.
``comm_buffers``
    Memory a tier keeps for its communication, at its peak, beyond the kinds
    above. DDP tiers (ddp, zero, multinode, elastic): the reducer's gradient
    buckets (one flat tensor per bucket, a copy of the gradients), 0 where
    ``gradient_as_bucket_view`` makes the gradients those buckets (counted once,
    as ``gradients``), plus PowerSGD's error-feedback and P/Q matrices under that
    comm hook. fsdp: the most bytes of unsharded (all-gathered) parameters held
    at once, prefetched units included (FSDP2's flat all-gather output, briefly
    alive beside its copy-out, left out). Kinds a tier does not report are absent.
``peak_rss`` (and ``cuda_*`` on CUDA)
    The process's peak resident memory, for comparison with the sums above.

A Strategy reports the kinds it measures itself through ``Strategy.memory()``;
the loop merges them over its own figures at the end of the run.
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

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What was saved, in order (the estimator counts fake tensors' storages itself)."""
        return list(self._tensors)

    def bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Saved bytes, leaving out tensors that are counted elsewhere (parameters)."""
        skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
        return tensor_bytes(t for t in self._tensors if _local(t).untyped_storage().data_ptr() not in skip)


class LiveActivations:
    """The bytes autograd saves for backward, held per micro-batch from its forward to its backward.

    Inside ``with live:`` every saved tensor counts for the micro-batch last
    ``begin``-ed (its forward and its loss); ``release(key)`` drops that
    micro-batch's tensors once its backward ran. ``peak`` is the most bytes held
    at once. A storage saved by several micro-batches (the batch their inputs are
    views of) counts once, while any of them holds it. ``module``: its parameters as they
    are at each save are left out too (FSDP swaps its all-gathered ones in and out).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), module: nn.Module | None = None) -> None:
        self._skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
        self._module = module
        self._owners: dict[int, tuple[int, set[Any]]] = {}  # storage -> (bytes, micro-batches holding it)
        self._held: dict[Any, set[int]] = {}  # micro-batch -> its storages
        self._current: Any = None
        self._ctx: Any = None
        self.now = 0
        self.peak = 0

    def begin(self, key: Any) -> None:
        """What autograd saves from now on belongs to micro-batch ``key``."""
        self._current = key
        self._held.setdefault(key, set())

    def release(self, key: Any) -> None:
        """Micro-batch ``key``'s backward ran: autograd freed what it saved."""
        for ptr in self._held.pop(key, set()):
            nbytes, owners = self._owners[ptr]
            owners.discard(key)
            if not owners:
                del self._owners[ptr]
                self.now -= nbytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage() if t.device.type != "meta" else None
        ptr = storage.data_ptr() if storage is not None else 0
        if self._module is not None and ptr:  # only as they are now: a freed parameter's address is reused
            skip = self._skip | {_local(p).untyped_storage().data_ptr() for p in self._module.parameters()}
        else:
            skip = self._skip
        if ptr and ptr not in skip and self._current is not None:
            if ptr not in self._owners:
                self._owners[ptr] = (storage.nbytes(), set())
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self._owners[ptr][1].add(self._current)
            self._held[self._current].add(ptr)
        return t

    def __enter__(self) -> LiveActivations:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


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
