"""The pipeline tier's parts: the model cut into stages, where each stage runs, and the timed ``PipelineStage``.

A schedule puts ``stages_per_rank`` (v) stages on each of the ``world`` ranks. One stage
per rank (naive, GPipe, 1F1B): stage r on rank r. Interleaved (``interleaved-1f1b``,
``zero-bubble``): *looped*, stage r + k·world on rank r, so a micro-batch loops through
the ranks v times. V-shaped (``zbv``, ``dualpipev``, v = 2): stages r and 2·world − 1 − r
on rank r, so the pipeline goes down the ranks and back up, and rank 0 holds the first
stage and the last (its inputs, and its targets and loss).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from dtlab.core import models
from dtlab.core.compat import pipeline_actions
from dtlab.core.memory import LiveActivations
from dtlab.instrument.recorder import timed_phase

__all__ = ["LOOPED", "MULTI_STAGE", "V_SHAPED", "TimedStage", "placement", "rank_actions", "rank_transfers",
           "split_model"]

LOOPED = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}
V_SHAPED = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
MULTI_STAGE = {**LOOPED, **V_SHAPED}  # several stages per rank: torch's runtime schedules


def placement(schedule: str, world: int, per_rank: int) -> list[list[int]]:
    """The stage indices each rank holds, in the order it builds them."""
    if schedule in V_SHAPED:
        return [[r, 2 * world - 1 - r] for r in range(world)]
    return [[r + k * world for k in range(per_rank)] for r in range(world)]


def rank_actions(schedule: str, world: int, microbatches: int, per_rank: int) -> dict[int, list[tuple[int, str, int]]]:
    """Each rank's compute actions (stage, "F" | "B" | "I" | "W", micro-batch) in the order it runs them.

    The one-stage schedules are written out here (as torch runs them); the multi-stage ones are torch's own
    action lists. ``naive`` is GPipe one micro-batch at a time.
    """
    if schedule in MULTI_STAGE:
        return pipeline_actions(MULTI_STAGE[schedule], world, placement(schedule, world, per_rank), microbatches)
    out = {}
    for s in range(world):
        if schedule == "naive":
            out[s] = [(s, kind, i) for i in range(microbatches) for kind in ("F", "B")]
        elif schedule == "gpipe":
            out[s] = [(s, "F", i) for i in range(microbatches)] + [(s, "B", i) for i in range(microbatches)]
        else:  # 1f1b: world - s forwards, then one backward and one forward until the forwards run out
            warmup = min(microbatches, world - s)
            order = [(s, "F", i) for i in range(warmup)]
            for i in range(microbatches):
                order.append((s, "B", i))
                if warmup + i < microbatches:
                    order.append((s, "F", warmup + i))
            out[s] = order
    return out


def rank_transfers(schedule: str, world: int, microbatches: int,
                   per_rank: int) -> dict[int, list[tuple[int, str, int]]] | None:
    """A multi-stage schedule's transfers per rank, (stage, "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B",
    micro-batch), one per point-to-point op in the order the rank posts them; None for the others."""
    if schedule not in MULTI_STAGE:
        return None
    return pipeline_actions(MULTI_STAGE[schedule], world, placement(schedule, world, per_rank), microbatches,
                            transfers=True)


# -- splitting -------------------------------------------------------------------------
class _CharFormerStage(nn.Module):
    """A contiguous slice of a CharFormer, with the original attribute names (so state_dict keys match)."""

    def __init__(self, model: models.CharFormer, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        if is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.Sequential(OrderedDict((str(i), model.blocks[i]) for i in range(first, last)))
        if is_last:
            self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "tok"):
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        x = self.blocks(x)
        return self.head(self.ln(x)) if hasattr(self, "head") else x


def _sequential_units(model: nn.Sequential) -> list[list[int]]:
    """Module indices grouped into units, one per module with parameters (a Linear) with the
    parameter-free ones after it (its ReLU); leading ones (the Flatten) join the first unit."""
    weighted = [i for i, m in enumerate(model) if next(m.parameters(), None) is not None]
    starts = [0, *weighted[1:]]
    return [list(range(a, b)) for a, b in zip(starts, [*starts[1:], len(model)])]


def split_model(model: nn.Module, stages: int, depth: int) -> list[nn.Module]:
    """The model cut into ``stages`` contiguous stages of ``depth / stages`` layers each.

    The stages share the model's modules (no copies) and keep its parameter names.
    """
    per = depth // stages
    if isinstance(model, models.CharFormer):
        return [_CharFormerStage(model, s * per, (s + 1) * per, s == 0, s == stages - 1) for s in range(stages)]
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"cannot split a {type(model).__name__}: the pipeline tier splits an nn.Sequential mlp "
                        "or the charformer")
    units = _sequential_units(model)
    if len(units) != depth + 1:  # depth hidden layers and the classifier
        raise ValueError(f"expected {depth + 1} parameterised layers in the mlp, found {len(units)}")
    out = []
    for s in range(stages):
        mine = units[s * per:(s + 1) * per] + (units[depth:] if s == stages - 1 else [])
        out.append(nn.Sequential(OrderedDict((str(i), model[i]) for unit in mine for i in unit)))
    return out


# -- the timed stage ---------------------------------------------------------------------
class TimedStage(PipelineStage):
    """Records each micro-batch's forward and backward as phases ``pp_<kind>:<micro-batch>@<stage>``, and sums
    their seconds per step (``compute_s``, reset by the strategy). Zero-bubble schedules split a backward into
    its input part (``backward_input``, I: the gradient the previous stage waits for) and its weight part
    (``backward_weight``, W: deferred into the bubble); both count as backward. ``offset`` numbers the naive
    schedule's micro-batches (each of its one-micro-batch schedules calls its own 0). While ``live`` is set,
    what autograd saves counts for the (stage, micro-batch) whose forward ran last, until its backward is
    complete: after B, or after W when the backward was split (W still needs what the forward saved)."""

    offset = 0
    live: LiveActivations | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compute_s = {"forward": 0.0, "backward": 0.0}

    def _timed(self, kind: str, chunk: int) -> contextlib.AbstractContextManager[Any]:
        return timed_phase(f"pp_{kind}:{chunk + self.offset}@{self.stage_index}")

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            if self.live is not None:  # and its loss, which the schedule computes next
                self.live.begin((self.stage_index, fwd_chunk_id + self.offset))
            with self._timed("forward", fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.compute_s["forward"] += time.perf_counter() - start

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        start = time.perf_counter()
        try:
            with self._timed("backward" if full_backward else "backward_input", bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                  last_backward=last_backward)
        finally:
            if full_backward:
                self._release(bwd_chunk_id)
            self.compute_s["backward"] += time.perf_counter() - start

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        start = time.perf_counter()
        try:
            with self._timed("backward_weight", bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        finally:
            self._release(bwd_chunk_id)
            self.compute_s["backward"] += time.perf_counter() - start

    def _release(self, chunk: int) -> None:
        if self.live is not None:  # autograd freed what this micro-batch saved on this stage
            self.live.release((self.stage_index, chunk + self.offset))


