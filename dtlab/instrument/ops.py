"""What each of the dispatcher's ``c10d`` ops carries: its name in events, its payload, its peer, its async flag.

Every ``ProcessGroup`` method -- whoever calls it: ``torch.distributed``'s
functions under any name, ``P2POp``, functional collectives and DTensor, DDP's
reducer, FSDP2, torchft -- calls one of these ops through the dispatcher, so
one table per op describes them all. A call's arguments are bound to the op's
schema by name (``bind``); ``check_schemas`` runs when the recorder starts
and fails loudly, naming the op and the argument, if a torch release renamed
one, rather than recording wrong bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def tensor_nbytes(obj: Any) -> int:
    """Bytes of a tensor, or of every tensor in (nested) lists of them."""
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


def _even(tensor: Any, parts: int) -> list[int]:
    rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
    return [rows // max(parts, 1)] * parts


def all_to_all_splits(bound: dict[str, Any], parts: int) -> dict[str, list[int]]:
    """``all_to_all_single``'s rows sent to and received from each rank (given, or the even split)."""
    sent, got = bound["input_split_sizes"], bound["output_split_sizes"]
    return {"input_splits": list(sent) if sent else _even(bound["input"], parts),
            "output_splits": list(got) if got else _even(bound["output"], parts)}


@dataclass(frozen=True)
class OpRule:
    """How to read one c10d op's call.

    ``payload`` names the argument whose bytes count (nccl-tests' convention: all_gather counts the
    gathered output, reduce_scatter the full input); ``peer`` the argument holding a rank within the
    group (a p2p call's other side, a rooted collective's root); ``async_arg`` the op's async flag (None:
    the Python caller decides, as for send and isend, which are the same op); ``output`` the tensors the
    call writes, which a functional collective's ``wait_tensor`` later waits on.
    """

    op: str
    payload: str
    peer: str | None = None
    async_arg: str | None = "async_op"
    extra: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    group: str = "process_group"
    output: str | None = None


C10D_OPS: dict[str, OpRule] = {
    "allreduce_": OpRule("all_reduce", "tensors", output="tensors"),
    "allreduce_coalesced_": OpRule("all_reduce", "tensors", output="tensors"),
    "broadcast_": OpRule("broadcast", "tensors", peer="root_rank", output="tensors"),
    "reduce_": OpRule("reduce", "tensors", peer="root_rank"),
    "allgather_": OpRule("all_gather", "output_tensors"),
    "allgather_coalesced_": OpRule("all_gather", "output_lists"),
    "_allgather_base_": OpRule("all_gather_into_tensor", "output_tensor", output="output_tensor"),
    "allgather_into_tensor_coalesced_": OpRule("all_gather_into_tensor", "outputs", output="outputs"),
    "reduce_scatter_": OpRule("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": OpRule("reduce_scatter_tensor", "input_tensor", output="output_tensor"),
    "reduce_scatter_tensor_coalesced_": OpRule("reduce_scatter_tensor", "inputs", output="outputs"),
    "alltoall_base_": OpRule("all_to_all_single", "input", extra=all_to_all_splits, output="output"),
    "alltoall_": OpRule("all_to_all", "input_tensors"),
    "gather_": OpRule("gather", "input_tensors", peer="root_rank"),
    "scatter_": OpRule("scatter", "output_tensors", peer="root_rank"),
    "barrier": OpRule("barrier", ""),
    "monitored_barrier_": OpRule("barrier", "", async_arg=None),
    "send": OpRule("send", "tensors", peer="dst", async_arg=None),
    "recv_": OpRule("recv", "tensors", peer="src", async_arg=None),
    "recv_any_source_": OpRule("recv", "tensors", async_arg=None),
}

# The async flavour of the p2p ops: ``isend``/``irecv`` and ``send``/``recv`` are one op each at the dispatcher.
ASYNC_NAMES = {"send": "isend", "recv": "irecv"}

# The launcher reads a rank's op code (a float in shared memory) to say which call a hung rank waits in.
OP_CODES = {name: i + 1 for i, name in enumerate(
    dict.fromkeys([*(rule.op for rule in C10D_OPS.values()), *ASYNC_NAMES.values()]))}
OP_NAMES = {code: name for name, code in OP_CODES.items()}


def overload(name: str) -> Any:
    """The op's default overload (``torch.ops.c10d.allreduce_.default``)."""
    return getattr(torch.ops.c10d, name).default


def argument_names(name: str) -> tuple[str, ...]:
    return tuple(a.name for a in overload(name)._schema.arguments)


def check_schemas(names: tuple[str, ...] | None = None) -> list[str]:
    """The ops this torch has (of ``names``, default every op of the table), after checking the arguments
    each rule reads; raises, naming the op and the argument, where a release renamed one."""
    present = []
    for name in names or tuple(C10D_OPS):
        try:
            arguments = argument_names(name)
        except (AttributeError, RuntimeError):
            continue  # an op this torch does not have: nothing can call it
        rule = C10D_OPS[name]
        wanted = [a for a in (rule.payload, rule.peer, rule.async_arg, rule.group, rule.output) if a]
        if rule.extra is not None:
            wanted += ["input", "output", "input_split_sizes", "output_split_sizes"]
        missing = [a for a in wanted if a not in arguments]
        if missing:
            raise RuntimeError(
                f"dtlab's recorder reads c10d::{name}'s argument(s) {', '.join(missing)}, which torch "
                f"{torch.__version__} does not have (its schema: {overload(name)._schema}); "
                "dtlab.instrument.ops needs updating for this release")
        present.append(name)
    return present


def bind(arguments: tuple[str, ...], defaults: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name, the schema's defaults filling what the caller left out."""
    bound = dict(defaults)
    bound.update(zip(arguments, args))
    bound.update(kwargs)
    return bound


def schema_defaults(name: str) -> dict[str, Any]:
    return {a.name: a.default_value for a in overload(name)._schema.arguments if a.has_default_value()}
