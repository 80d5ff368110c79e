"""What DDP's reducer holds and how it cut the gradients: its buckets' sizes and the bytes they take.

``bucket_layout`` reads the reducer's current buckets (sizes in bytes, in gradient-ready order: a list of ints
from here on, in RankResult.strategy, result.json and the cost model's run numbers); ``comm_buffer_bytes`` is
what the ddp tier reports as ``comm_buffers`` memory, which ``dtlab estimate`` predicts exactly.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dtlab.core.compat import ddp_bucket_sizes
from dtlab.core.memory import tensor_bytes

__all__ = ["bucket_layout", "comm_buffer_bytes", "hook_state_bytes"]


def bucket_layout(model: DistributedDataParallel) -> dict[str, Any]:
    """DDP's current buckets: ``num_buckets`` and ``bucket_sizes_bytes``, a list of ints in gradient-ready order."""
    sizes = ddp_bucket_sizes(model)  # the reducer's current layout (see dtlab.core.compat)
    return {"num_buckets": len(sizes), "bucket_sizes_bytes": sizes}


def hook_state_bytes(state: Any) -> int:
    """Tensors a comm hook keeps between steps: PowerSGD's error feedback and its P and Q matrices."""
    if not isinstance(state, powerSGD_hook.PowerSGDState):
        return 0
    kept = [*state.error_dict.values(), *state.p_memory_dict.values(), *state.q_memory_dict.values()]
    return tensor_bytes(kept)


def comm_buffer_bytes(model: DistributedDataParallel, hook_state: Any) -> int:
    """The reducer's buckets (one flat tensor each), unless the gradients are views into them
    (``gradient_as_bucket_view``: counted once, as gradients), plus a comm hook's state."""
    buckets = 0 if model.gradient_as_bucket_view else sum(ddp_bucket_sizes(model))
    return buckets + hook_state_bytes(hook_state)
