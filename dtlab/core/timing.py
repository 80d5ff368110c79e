"""Timestamps that are right on the device the step runs on.

On the CPU a mark is ``time.perf_counter()``. On CUDA, work is queued: the CPU
reaches a point in the code long before the GPU has finished what came before
it, so CPU timestamps would measure kernel launches. There a mark also records a
CUDA event on the current stream, and ``resolve()`` -- called once, after the
step -- waits for the last event and maps every mark to when the GPU reached
it: the step's first mark (taken with the GPU idle, right after the previous
step's resolve) plus the events' elapsed times. Nothing inside the step waits
for the GPU, so what is measured is not changed by measuring it.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[float, Any]] = []

    def mark(self) -> float:
        """Now, on the CPU's clock; on CUDA also where the GPU's stream is (resolved later)."""
        t = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((t, event))
        return t

    def resolve(self) -> dict[float, float]:
        """CPU mark -> when the GPU reached it (empty on the CPU, where marks are already right)."""
        if not self._marks:
            return {}
        marks, self._marks = self._marks, []
        marks[-1][1].synchronize()
        t0, first = marks[0]
        return {t: t0 + first.elapsed_time(event) / 1e3 for t, event in marks}
