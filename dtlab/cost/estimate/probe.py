"""One rank of a job on torch's fake backend: its compute plus the tier's own CPU work, with free collectives.

torch.distributed's ``fake`` process group returns from every collective at once without moving a byte,
so a single process can be one rank of a world of n: the tier shards, splits and hooks exactly as at world
n (FSDP2's copy-in and copy-out around each all-gather, DTensor's dispatch on every op, the optimizer on
sharded parameters), and dtlab's own training loop times what is left of a step when communication
costs nothing. The n ranks run at once, each in its own child process (the caller's process-group state
stays untouched), so they contend for this machine's cores and memory as the job's ranks do. Each runs
two loops:

* one recorded for a few steps: the collectives the tier itself calls in a steady step, op and bytes
  (``Probe.collectives``), its communication inventory for the link to price;
* one unrecorded, timed: the median steady step (``Probe.step_s``) and its phases.

Nothing of a real distributed run is looked at, so a prediction built on a probe is not fitted on the
run it predicts. The fake backend is what torch's own tests use for this (``compat.register_fake_backend``).
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtlab.core.compat import register_fake_backend
from dtlab.core.config import RunConfig
from dtlab.core.env import DistInfo
from dtlab.launch.rank import call_recorded
from dtlab.launch.together import run_together
from dtlab.train.loop import train

__all__ = ["Probe", "link_op", "loop_phases", "probe"]

TIMED_STEPS = 15
WARMUP = 2  # the first steps set up buckets, optimizer state and DTensor's caches
RECORDED_STEPS = 2  # step 1 is steady: its collectives are every later step's


@dataclass(frozen=True)
class Probe:
    step_s: float
    phases: dict[str, float]
    collectives: list[tuple[str, int, int]]  # (op as the recorder names it, bytes, group size), one steady step


def link_op(op: str) -> str | None:
    """The LinkModel op that prices a recorded collective (None: not priced, e.g. a barrier)."""
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        if op.startswith(name):
            return name
    if op in ("send", "isend"):  # a ring exchange: every rank sends and receives at once, counted once
        return "send_recv"
    return None


def _measure(cfg: RunConfig, rank: int) -> Probe:
    # FSDP2's all_gather_into_tensor/reduce_scatter_tensor names are deprecated in torch 2.13: not news here
    warnings.filterwarnings("ignore", category=FutureWarning)
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=cfg.world_size)
    # The tier's code paths are gloo's: the fake group stands in for it.
    info = DistInfo(rank, rank, cfg.world_size, cfg.world_size, "gloo", torch.device("cpu"))
    try:
        recorded = call_recorded(train, info, (cfg.replace(steps=RECORDED_STEPS),), True)
        timed = train(info, cfg.replace(steps=WARMUP + TIMED_STEPS))
    finally:
        dist.destroy_process_group()
    steady = timed.steps[WARMUP:]
    collectives = [(e["op"], int(e["bytes"]), int(e["group_size"])) for e in recorded.events
                   if e["step"] == RECORDED_STEPS - 1 and e["op"] != "barrier"]
    phases = {k: statistics.median(s[k] for s in steady) for k in ("data", "forward", "backward", "optimizer")
              if k in steady[0]}
    return Probe(statistics.median(s["total"] for s in steady), phases, collectives)


def loop_phases(cfg: RunConfig, copies: int) -> dict[str, float]:
    """One rank's compute as dtlab's loop runs it: ``cfg`` (one process, e.g. the ``single`` tier at a rank's
    batch) in ``copies`` processes at once; the slowest copy's phases, the loop's own work between them
    (batch indexing, bookkeeping) added to ``data``."""
    answers = run_together(_measure, [(cfg, 0)] * copies, f"timing {copies} rank(s) of {cfg.tier} in dtlab's loop")
    slowest = max(answers, key=lambda p: p.step_s)
    phases = dict(slowest.phases)
    phases["data"] += max(0.0, slowest.step_s - sum(phases.values()))
    return phases


def probe(cfg: RunConfig) -> Probe:
    """Every rank of ``cfg`` on the fake backend, each in a spawned child process, all at once: they share
    this machine's cores and memory as the job's ranks would. The step is the slowest rank's; the
    collectives are rank 0's. A few seconds: each child imports torch."""
    answers = run_together(_measure, [(cfg, rank) for rank in range(cfg.world_size)],
                           f"the fake-backend probe of tier {cfg.tier}")
    slowest = max(answers, key=lambda p: p.step_s)
    return Probe(slowest.step_s, slowest.phases, answers[0].collectives)
