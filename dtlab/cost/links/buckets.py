"""One DDP step, predicted: compute phases and bucket sizes in, a step time and a bucket timeline out.

Nothing here knows how the ranks were launched: the numbers may come from
loopback, simulated hosts or anywhere else.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from dtlab.cost.links.alpha_beta import LinkModel, check_bytes, check_world_size

__all__ = ["BucketTiming", "COMPUTE_PHASES", "StepPrediction", "bucket_schedule", "predict_ddp_step",
           "spare_cores", "timeline_frame"]

COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class BucketTiming:
    """One bucket in a predicted step, in seconds from the start of backward."""

    index: int
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepPrediction:
    """A predicted DDP step: its parts in seconds and the bucket timeline."""

    step_s: float
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    overhead_s: float
    comm_s: float  # all the buckets' all-reduce time, hidden or not
    exposed_comm_s: float  # the part after backward's compute ended: it adds to the step
    world_size: int
    busy_s: float = 0.0  # the link's busy_s, paid once: the step blocks once on its all-reduces
    buckets: tuple[BucketTiming, ...] = ()

    @property
    def compute_s(self) -> float:
        return self.data_s + self.forward_s + self.backward_s + self.optimizer_s

    @property
    def hidden_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "buckets"}
        return {**out, "compute_s": self.compute_s, "hidden_comm_s": self.hidden_comm_s,
                "buckets": len(self.buckets)}


def _check_phases(phases: Mapping[str, float]) -> dict[str, float]:
    missing = [p for p in COMPUTE_PHASES if p not in phases]
    if missing:
        raise ValueError(f"phases lack {missing}: need seconds for {', '.join(COMPUTE_PHASES)}")
    out = {p: float(phases[p]) for p in COMPUTE_PHASES}
    bad = {p: v for p, v in out.items() if not (math.isfinite(v) and v >= 0)}
    if bad:
        raise ValueError(f"phases {bad} are invalid: seconds must be >= 0")
    return out


def spare_cores(world_size: int, threads_per_rank: int, cores: int | None = None) -> bool:
    """Whether the ranks leave a core free for communication: ``world_size * threads_per_rank < cores``.

    On CPU a gloo collective is work for the cores (copies, the reduction,
    the kernel's socket copies on loopback), done by gloo's threads in the
    rank's process. Where the ranks' compute threads take every core, that
    work takes its time from backward: an all-reduce that starts during
    backward delays it by as much, and overlap saves nothing (measured here
    with 2 ranks on 2 cores: DDP with 3 buckets, two of them ready during
    backward, was slower than with 1 in 8 of 10 ``costmodel_error`` runs,
    e.g. 32.1 ms against 30.0 ms; in the other two 31.9 against 32.1 and 34.9
    against 39.1). A GPU's collectives run on the device, so there this test
    does not apply.
    """
    return world_size * threads_per_rank < (cores or os.cpu_count() or 1)


def bucket_schedule(bucket_bytes: Sequence[int], backward_s: float, link: LinkModel, world_size: int,
                    op: str = "all_reduce", *, overlap: bool = True) -> tuple[BucketTiming, ...]:
    """When each bucket is ready, starts and ends, in seconds from the start of backward.

    Buckets come in gradient-ready order (DDP's, after its rebuild at step 0).
    Bucket i is ready when its share of the gradient bytes has been produced,
    gradients being produced uniformly through backward; the all-reduces run
    one after another on the link, each starting when its bucket is ready and
    the previous one has finished. ``overlap=False`` (no core to spare:
    ``spare_cores``): an all-reduce during backward would delay backward by its
    own time, so the schedule starts them all when backward's compute ends --
    the same step time, drawn without pretending to overlap.
    """
    sizes = check_bytes(list(bucket_bytes), "bucket_bytes")
    total = float(sizes.sum())
    timings, free_at, produced = [], 0.0, 0.0
    for i, size in enumerate(sizes.tolist()):
        produced += size
        ready = backward_s * (produced / total if total > 0 else 1.0) if overlap else backward_s
        start = max(ready, free_at)
        free_at = start + link.predict(op, size, world_size)
        timings.append(BucketTiming(i, int(size), ready, start, free_at))
    return tuple(timings)


def predict_ddp_step(phases: Mapping[str, float], bucket_bytes: Sequence[int], link: LinkModel, world_size: int,
                     *, overhead_s: float = 0.0, op: str = "all_reduce", overlap: bool = True) -> StepPrediction:
    """A DDP step from one rank's compute phases (seconds) and DDP's bucket sizes (bytes).

    ``phases``: data, forward, backward and optimizer seconds of one rank
    computing its own (per-rank) batch without DDP. ``overhead_s``: DDP's own
    per-step work (copying gradients into buckets and back, dividing by n,
    hooks), measured elsewhere (``ddp_overhead``). The step is
    data + forward + max(backward, end of the last all-reduce) + optimizer + overhead,
    plus the link's ``busy_s`` once at n > 1 (``costmodel.calibrate_busy``: what a
    collective costs beyond its price between compute; 0 unless measured).
    ``overlap``: whether an all-reduce can run beside backward's compute
    (``bucket_schedule``; False where the ranks have no core to spare).
    """
    check_world_size(world_size)
    p = _check_phases(phases)
    if not (math.isfinite(overhead_s) and overhead_s >= 0):
        raise ValueError(f"overhead_s={overhead_s!r} is invalid: must be >= 0 seconds")
    buckets = bucket_schedule(bucket_bytes, p["backward"], link, world_size, op, overlap=overlap) \
        if world_size > 1 else ()
    comm_end = buckets[-1].end_s if buckets else 0.0
    exposed = max(0.0, comm_end - p["backward"])
    comm = sum(b.end_s - b.start_s for b in buckets)
    busy = float(getattr(link, "busy_s", 0.0)) if buckets else 0.0
    step = p["data"] + p["forward"] + max(p["backward"], comm_end) + busy + p["optimizer"] + overhead_s
    return StepPrediction(step_s=step, data_s=p["data"], forward_s=p["forward"], backward_s=p["backward"],
                          optimizer_s=p["optimizer"], overhead_s=overhead_s, comm_s=comm, exposed_comm_s=exposed,
                          world_size=int(world_size), busy_s=busy, buckets=buckets)


def timeline_frame(prediction: StepPrediction) -> pd.DataFrame:
    """The predicted step as Gantt rows (lane, phase, start, end in seconds): for ``plots.gantt``.

    Lane "compute" holds the phases, with "idle" where backward's compute has
    ended but the last all-reduce has not; lane "comm" holds the buckets.
    """
    p = prediction
    t_bwd = p.data_s + p.forward_s
    wait = max(p.backward_s, p.buckets[-1].end_s if p.buckets else 0.0) - p.backward_s
    parts = [("data", p.data_s), ("forward", p.forward_s), ("backward", p.backward_s), ("idle", wait),
             ("busy", p.busy_s), ("ddp overhead", p.overhead_s), ("optimizer", p.optimizer_s)]
    rows, t = [], 0.0
    for name, seconds in parts:
        if seconds > 0:
            rows.append({"lane": "compute", "phase": name, "start": t, "end": t + seconds})
        t += seconds
    rows += [{"lane": "comm", "phase": "all_reduce", "start": t_bwd + b.start_s, "end": t_bwd + b.end_s}
             for b in p.buckets]
    return pd.DataFrame(rows, columns=["lane", "phase", "start", "end"])
