"""What FSDP2 holds gathered: the most bytes of full (unsharded) parameters a rank holds at once, and those kept
from forward to backward.

A unit's parameters are plain tensors while gathered and DTensor shards otherwise, so the count reads the
parameters' types: just before a unit's all-gather (``gathering``, which the ``fsdp_gathered`` channel calls),
the units still unsharded plus this one are what the rank holds once it lands. Counted on the first step only
(``counting``): the peak is the same every step. The channel reports ``peak`` as the fsdp tier's
``comm_buffers`` memory, which ``dtlab estimate`` predicts exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtlab.core.memory import tensor_bytes

__all__ = ["GatheredBytes"]


class GatheredBytes:
    """Counts ``model``'s gathered parameters, unit by unit (``units``: each sharded module's unit name)."""

    def __init__(self, model: nn.Module, units: dict[nn.Module, str], dtype: torch.dtype | None) -> None:
        self.model = model
        self.counting = False
        self.peak = 0  # the most bytes of full parameters held at once
        self.after_forward = 0  # bytes of full parameters kept from forward to backward
        prefix = {unit: "" if unit is model else next(n for n, m in model.named_modules() if m is unit) + "."
                  for unit in units}
        owned = {f"{prefix[u]}{n}" for u in units if u is not model for n, _ in u.named_parameters()}
        self.unit_params = {name: [f"{prefix[unit]}{n}" for n, _ in unit.named_parameters()
                                   if unit is not model or f"{prefix[unit]}{n}" not in owned]
                            for unit, name in units.items()}
        # each unit's full bytes in the dtype it computes with (mixed precision gathers 16-bit copies)
        self.unit_bytes = {name: sum(p.numel() * (dtype or p.dtype).itemsize
                                     for p in map(model.get_parameter, params))
                           for name, params in self.unit_params.items()}
        # after FSDP's own post-forward (registered earlier): what is still unsharded stays until backward
        model.register_forward_hook(self._held_after_forward)

    def gathering(self, unit: str) -> None:
        """Just before ``unit``'s all-gather."""
        if not self.counting:
            return
        get = self.model.get_parameter
        held = sum(size for name, size in self.unit_bytes.items()
                   if name != unit and not isinstance(get(self.unit_params[name][0]), DTensor))
        self.peak = max(self.peak, held + self.unit_bytes.get(unit, 0))

    def _held_after_forward(self, *_: Any) -> None:
        held = tensor_bytes(p for p in self.model.parameters() if not isinstance(p, DTensor))
        self.after_forward = max(self.after_forward, held)
