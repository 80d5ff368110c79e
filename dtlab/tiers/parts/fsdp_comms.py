"""FSDP2's collectives as custom comms: quantised where the fsdp tier asks, and shown to the instrument layer.

They send quantised codes where the fsdp tier asks (``gather_comm_dtype`` for the
parameters' all-gather, ``reduce_comm_dtype`` for the gradients' reduce-scatter; ``dtlab.tiers.parts.quantised_comms``):
"fp32" keeps FSDP2's own collective, unchanged. Each runs inside ``fsdp_collective`` so that the FSDP channels a
tier declares (``dtlab.instrument.channels``: ``fsdp_units`` tags it, ``fsdp_gathered`` counts the bytes held)
know which unit it serves; the recorder sees the calls at the dispatcher whatever FSDP2 calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core.compat import fsdp_default_comms
from dtlab.core.quantise import check_options
from dtlab.instrument.channels import fsdp_collective
from dtlab.tiers.parts.quantised_comms import quantised_all_gather, quantised_reduce_scatter

__all__ = ["check_comm_options", "install_comms"]


def check_comm_options(o: Any, name: str) -> None:
    """The quantised-communication knobs: a known code each, a block of whole 4-byte words."""
    check_options(o, name, ("gather_comm_dtype", "reduce_comm_dtype"))
    quantised = (o.gather_comm_dtype, o.reduce_comm_dtype) != ("fp32", "fp32")
    if quantised and fsdp_default_comms() is None:
        raise ValueError(f"{name}.gather_comm_dtype/reduce_comm_dtype need FSDP2's custom comms, which torch "
                         f"{torch.__version__} lacks: use 'fp32'")


def install_comms(units: dict[nn.Module, str], gather_dtype: str = "fp32", reduce_dtype: str = "fp32",
                  block: int = 128) -> None:
    """Each unit's all-gather and reduce-scatter as custom comms: sent as ``gather_dtype`` and ``reduce_dtype``
    codes (per-block scales of ``block`` elements) where those are not "fp32", each inside ``fsdp_collective``."""
    defaults = fsdp_default_comms()
    if defaults is None:  # an FSDP2 without custom comms: the calls are recorded, unnamed
        if (gather_dtype, reduce_dtype) != ("fp32", "fp32"):
            raise RuntimeError("quantised fsdp collectives need FSDP2's custom comms (set_custom_all_gather), "
                               "which this torch lacks")
        return
    DefaultAllGather, DefaultReduceScatter = defaults  # noqa: N806 - classes

    class UnitAllGather(DefaultAllGather):
        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with fsdp_collective("all_gather", self.unit):
                if gather_dtype == "fp32":
                    return super().__call__(*args, **kwargs)
                return _gather(gather_dtype, block, *args, **kwargs)

    class UnitReduceScatter(DefaultReduceScatter):
        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with fsdp_collective("reduce_scatter", self.unit):
                if reduce_dtype == "fp32":
                    return super().__call__(*args, **kwargs)
                return _reduce_scatter(reduce_dtype, block, *args, **kwargs)

    for module, unit in units.items():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(UnitAllGather(unit))
            module.set_custom_reduce_scatter(UnitReduceScatter(unit))


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

