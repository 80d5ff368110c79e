"""FSDP2's collectives tagged ``fsdp:<pass>:<unit>`` on the recorder (the fsdp tier's labels), and quantised.

The recorder sees FSDP2's all-gathers and reduce-scatters at the dispatcher whatever FSDP2 calls
(``dist.all_gather_single`` and ``dist.reduce_scatter_single`` in torch 2.13); custom comms that run
FSDP2's own defaults inside a tag say which unit and pass each one serves. HSDP's all-reduce across the
replicate groups has no custom-comm slot: its hook tags the event just recorded.

The same custom comms send quantised codes where the fsdp tier asks (``gather_comm_dtype`` for the
parameters' all-gather, ``reduce_comm_dtype`` for the gradients' reduce-scatter; ``dtlab.tiers.parts.quantised_comms``):
"fp32" keeps FSDP2's own collective, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core.compat import fsdp_default_comms
from dtlab.core.quantise import check_options
from dtlab.instrument.recorder import active, tagged
from dtlab.tiers.parts.quantised_comms import quantised_all_gather, quantised_reduce_scatter

__all__ = ["check_comm_options", "record_comms"]


def check_comm_options(o: Any, name: str) -> None:
    """The quantised-communication knobs: a known code each, a block of whole 4-byte words."""
    check_options(o, name, ("gather_comm_dtype", "reduce_comm_dtype"))
    quantised = (o.gather_comm_dtype, o.reduce_comm_dtype) != ("fp32", "fp32")
    if quantised and fsdp_default_comms() is None:
        raise ValueError(f"{name}.gather_comm_dtype/reduce_comm_dtype need FSDP2's custom comms, which torch "
                         f"{torch.__version__} lacks: use 'fp32'")


def record_comms(units: dict[nn.Module, str], pass_of: dict[str, str], gathering: Callable[[str], None],
                 hsdp: bool = False, gather_dtype: str = "fp32", reduce_dtype: str = "fp32", block: int = 128) -> None:
    """Tag each unit's all-gather and reduce-scatter ``fsdp:<pass>:<unit>``; send them as ``gather_dtype`` and
    ``reduce_dtype`` codes (per-block scales of ``block`` elements) where those are not "fp32".

    ``gathering(unit)`` is called just before each all-gather (for the memory count). With ``hsdp``
    each unit's all-reduce across the replicate groups is tagged too (``_tag_all_reduce``).
    """
    defaults = fsdp_default_comms()
    if defaults is None:  # an FSDP2 without custom comms: the calls are recorded, untagged
        if (gather_dtype, reduce_dtype) != ("fp32", "fp32"):
            raise RuntimeError("quantised fsdp collectives need FSDP2's custom comms (set_custom_all_gather), "
                               "which this torch lacks")
        return
    DefaultAllGather, DefaultReduceScatter = defaults  # noqa: N806 - classes

    class TaggedAllGather(DefaultAllGather):
        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            gathering(self.unit)
            with tagged(f"fsdp:{pass_of['now']}:{self.unit}"):
                if gather_dtype == "fp32":
                    return super().__call__(*args, **kwargs)
                return _gather(gather_dtype, block, *args, **kwargs)

    class TaggedReduceScatter(DefaultReduceScatter):
        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with tagged(f"fsdp:backward:{self.unit}"):
                if reduce_dtype == "fp32":
                    return super().__call__(*args, **kwargs)
                return _reduce_scatter(reduce_dtype, block, *args, **kwargs)

    for module, unit in units.items():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(TaggedAllGather(unit))
            module.set_custom_reduce_scatter(TaggedReduceScatter(unit))
            if hsdp:
                module.set_all_reduce_hook(_tag_all_reduce(f"fsdp:backward:{unit}"))


def _gather(dtype: str, block: int, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
            async_op: bool = False) -> None:
    """FSDP2's all-gather call, done synchronously in codes: no work to wait for (FSDP2 accepts None)."""
    quantised_all_gather(output_tensor, input_tensor, group, dtype, block)


def _reduce_scatter(dtype: str, block: int, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                    op: Any, async_op: bool = False) -> None:
    """FSDP2's reduce-scatter call in codes. FSDP2 asks for AVG (or SUM with its own division) in float32."""
    if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        raise RuntimeError(f"quantised reduce-scatter supports AVG and SUM, not {op}")
    quantised_reduce_scatter(output_tensor, input_tensor, group, dtype, block, average=op == dist.ReduceOp.AVG)


def _tag_all_reduce(tag: str) -> Callable[[torch.Tensor], None]:
    """FSDP2 calls ``dist.all_reduce`` itself (the recorder sees it) and then this hook, synchronously on
    CPU, so the event just recorded is that all-reduce: tag it."""
    def hook(_: torch.Tensor) -> None:
        rec = active()
        if rec is not None and rec.events and rec.events[-1].op == "all_reduce":
            rec.events[-1].tag = tag
    return hook
