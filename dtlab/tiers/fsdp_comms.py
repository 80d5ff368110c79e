"""FSDP2's collectives as CommRecorder events, tagged ``fsdp:<pass>:<unit>`` (the fsdp tier's recording).

FSDP2 in torch 2.13 calls ``dist.all_gather_single`` and ``dist.reduce_scatter_single``, which the
recorder does not wrap: custom comms call the equivalent wrapped functions instead. HSDP's all-reduce
across the replicate groups goes through ``dist.all_reduce``, which the recorder sees as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core.comm import OP, TAG
from dtlab.core.compat import fsdp_default_comms
from dtlab.instrument.recorder import active

__all__ = ["record_comms"]


def record_comms(units: dict[nn.Module, str], pass_of: dict[str, str], gathering: Callable[[str], None],
                 hsdp: bool = False) -> None:
    """Route each unit's all-gather and reduce-scatter through the CommRecorder's wrapped functions.

    ``gathering(unit)`` is called just before each all-gather (for the memory count). With ``hsdp``
    each unit's all-reduce across the replicate groups is tagged too (``_tag_all_reduce``).

    The custom comms call ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` and tag each event
    ``fsdp:<pass>:<unit>`` (as ddp's comm hook tags its buckets).
    """
    defaults = fsdp_default_comms()
    if defaults is None:  # older FSDP2 calls all_gather_into_tensor itself: the recorder sees it as is
        return
    DefaultAllGather, DefaultReduceScatter = defaults  # noqa: N806 - classes

    class RecordedAllGather(DefaultAllGather):
        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            gathering(self.unit)
            rec = active()
            if rec is None:
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            with rec.tagged(f"fsdp:{pass_of['now']}:{self.unit}"):
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class RecordedReduceScatter(DefaultReduceScatter):
        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            rec = active()
            if rec is None:
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            with rec.tagged(f"fsdp:backward:{self.unit}"):
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    for module, unit in units.items():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(RecordedAllGather(unit))
            module.set_custom_reduce_scatter(RecordedReduceScatter(unit))
            if hsdp:
                module.set_all_reduce_hook(_tag_all_reduce(f"fsdp:backward:{unit}"))


def _tag_all_reduce(tag: str) -> Callable[[torch.Tensor], None]:
    """HSDP's all-reduce has no custom-comm slot: FSDP2 calls ``dist.all_reduce`` itself (the recorder sees
    it) and then this hook, synchronously on CPU, so the event just recorded is that all-reduce: tag it."""
    def hook(_: torch.Tensor) -> None:
        rec = active()
        if rec is not None and rec.events and rec.events[-1][OP] == "all_reduce":
            rec.events[-1][TAG] = tag
    return hook
