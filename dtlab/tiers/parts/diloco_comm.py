"""DiLoCo's pseudo-gradients sent as quantised bytes (``dtlab.core.quantise``): the diloco tier's
``outer_comm_dtype``.

torchft's DiLoCo averages each fragment's pseudo-gradient with ``Manager.allreduce`` on one flat buffer.
gloo cannot add int8 or fp8 codes (and two codes with their own scales do not add), so a quantised average is
an ``allgather`` of every group's encoded buffer, then a local sum of the decoded values in float32, in group
order: every group computes the same average from the same bytes, its own included (as
``dtlab.tiers.parts.quantised_comms`` does for DDP). ``QuantisedManager`` stands in for the Manager inside DiLoCo and
changes only ``allreduce``; everything else (quorum, commit, healing) is the Manager's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions  # what torchft's process groups take

from dtlab.core.quantise import decode, encode
from dtlab.instrument.recorder import tagged

__all__ = ["BLOCK", "QuantisedManager", "quantised_average"]

BLOCK = 128  # elements per scale: one float32 scale per 128 consecutive values of the flat pseudo-gradient


def quantised_average(pg: Any, tensor: torch.Tensor, dtype: str, participants: int) -> None:
    """``tensor`` (in place) = the mean over the group ``pg`` of every member's ``tensor``, each sent once as
    ``dtype`` codes (payload and scales, ``encoded_bytes`` of them) and decoded here."""
    sent = encode(tensor, dtype, BLOCK)
    received = [torch.empty_like(sent) for _ in range(pg.size())]
    with tagged("ft_cross_replica"):
        pg.allgather([received], [sent], AllgatherOptions()).wait()
    total = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
    for piece in received:  # in group order: every member adds the same values in the same order
        total += decode(piece, tensor.numel(), dtype, BLOCK)
    tensor.copy_((total / participants).view_as(tensor))


class QuantisedManager:
    """A torchft Manager whose ``allreduce`` (an average) sends ``dtype`` codes; the rest is the Manager's."""

    def __init__(self, manager: Any, dtype: str) -> None:
        self._manager, self._dtype = manager, dtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> Any:
        from torchft.work import _DummyWork  # lazy: torchft is an optional extra (dtlab.tiers.parts.ft)

        manager = self._manager
        if manager.errored():
            return _DummyWork(tensor)
        manager.wait_quorum()
        if not manager.is_participating():
            tensor.zero_()  # as the Manager does: a group that is not participating adds nothing
        try:
            quantised_average(manager._pg, tensor, self._dtype, manager.num_participants())
        except Exception as exc:  # as the Manager does: a failed average is reported, not raised
            manager.report_error(exc)
        return _DummyWork(tensor)
