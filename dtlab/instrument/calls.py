"""What a c10d call carries, read from its arguments: payload bytes, dtype, peer, group and async flag.

One table per wrapped ``torch.distributed`` function, so the recorder's wrappers
stay one generic function. The launcher reads ``OP_NAMES`` to say which op a
hung rank waits in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def tensor_nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(o) for o in obj)
    return 0


def dtype_name(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype).removeprefix("torch.")
    if isinstance(obj, (list, tuple)) and obj:
        return dtype_name(obj[0])
    return ""


def arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def group_peer(kwargs: dict[str, Any], key: str) -> Any:
    """A peer given by its rank within ``group`` (``group_dst``/``group_src``) as its global rank, so that
    events on a sub-group (a pipeline's ``pp`` dimension of a mesh) name the rank they reach."""
    peer, group = kwargs.get(key), kwargs.get("group")
    return dist.get_global_rank(group, peer) if peer is not None and group is not None else peer


# How to read (bytes, peer) from each wrapped function's arguments. The size
# convention is nccl-tests': all_gather counts the gathered output,
# reduce_scatter the full input.
SIZE_RULES: dict[str, Callable[[tuple, dict], tuple[Any, Any]]] = {
    "all_reduce": lambda a, k: (arg(a, k, 0, "tensor"), None),
    "broadcast": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 1, "src")),
    "reduce": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 1, "dst")),
    "all_gather": lambda a, k: (arg(a, k, 0, "tensor_list"), None),
    "all_gather_into_tensor": lambda a, k: (arg(a, k, 0, "output_tensor"), None),
    "reduce_scatter": lambda a, k: (arg(a, k, 1, "input_list"), None),
    "reduce_scatter_tensor": lambda a, k: (arg(a, k, 1, "input"), None),
    "all_to_all": lambda a, k: (arg(a, k, 1, "input_tensor_list"), None),
    "all_to_all_single": lambda a, k: (arg(a, k, 1, "input"), None),
    "gather": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 2, "dst")),
    "scatter": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 2, "src")),
    "barrier": lambda a, k: (None, None),
    # pipelining passes group_dst/group_src (ranks within the group): recorded as global ranks
    "send": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 1, "dst", group_peer(k, "group_dst"))),
    "recv": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 1, "src", group_peer(k, "group_src"))),
    "isend": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 1, "dst", group_peer(k, "group_dst"))),
    "irecv": lambda a, k: (arg(a, k, 0, "tensor"), arg(a, k, 1, "src", group_peer(k, "group_src"))),
}


def _even(tensor: Any, parts: int) -> list[int]:
    rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
    return [rows // parts] * parts


def all_to_all_splits(a: tuple, k: dict, parts: int) -> dict[str, list[int]]:
    """``all_to_all_single``'s rows sent to and received from each rank (given, or the even split)."""
    sent, got = arg(a, k, 3, "input_split_sizes"), arg(a, k, 2, "output_split_sizes")
    return {"input_splits": list(sent) if sent else _even(arg(a, k, 1, "input"), parts),
            "output_splits": list(got) if got else _even(arg(a, k, 0, "output"), parts)}


# Extra event fields read from a call's arguments and the group's size: how an all-to-all splits its rows.
EXTRA_RULES: dict[str, Callable[[tuple, dict, int], dict[str, Any]]] = {"all_to_all_single": all_to_all_splits}


# Positions of the ``group`` and ``async_op`` arguments (None: not taken).
GROUP_ASYNC_POS: dict[str, tuple[int, int | None]] = {
    "all_reduce": (2, 3), "broadcast": (2, 3), "reduce": (3, 4), "all_gather": (2, 3),
    "all_gather_into_tensor": (2, 3), "reduce_scatter": (3, 4), "reduce_scatter_tensor": (3, 4),
    "all_to_all": (2, 3), "all_to_all_single": (4, 5), "gather": (3, 4), "scatter": (3, 4),
    "barrier": (0, 1), "send": (2, None), "recv": (2, None), "isend": (2, None), "irecv": (2, None),
}


ALWAYS_ASYNC = {"isend", "irecv"}


OP_CODES = {name: i + 1 for i, name in enumerate([*SIZE_RULES, "broadcast_coalesced", "batch_isend_irecv", "wait"])}


OP_NAMES = {code: name for name, code in OP_CODES.items()}
