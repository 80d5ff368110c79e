"""Predict a job's memory per rank before running it: ``dtlab.estimate(cfg)``, ``python -m dtlab estimate``.

For memory nothing is launched: the model is built and run on fake tensors
(shapes and dtypes only), so the estimate works for a user's own model and for
sizes this machine could never hold. For step time (given a link) the compute is
timed here; for fsdp, tp, fsdp-tp and cp the job's ranks run a few steps on
torch's fake backend in child processes (``probe``: no peers, collectives free).
What comes back (``Estimate``):

* ``memory``: kind -> bytes on the rank that needs the most (``per_rank`` has every rank);
* ``memory_max_over_ranks``: kind -> the most bytes of that kind on any rank, each kind's own maximum
  (``result.json``'s key of the same name, so prediction and measurement line up by name);
* ``peak_bytes``: that rank's kinds added up -- an upper bound on what it holds at once,
  since activations are freed during backward while gradients fill in;
* ``step_ms``: the predicted step time where the cost model covers the tier, else None;
* ``assumptions``: what each number rests on, in words.

The kinds are the ones a run measures (``RunResult.ranks[r].memory``), so
``compare(estimate, result)`` lines prediction and measurement up kind by kind.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from dtlab.core.config import RunConfig
from dtlab.core.job import build_job
from dtlab.core.results import RunResult, max_per_kind
from dtlab.cost.estimate import step
from dtlab.cost.estimate.memory import RankMemory, per_rank
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.links.linkset import LinkSet
from dtlab.cost.roofline.cpu import Roofline

KINDS = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers")

__all__ = ["KINDS", "Estimate", "compare", "estimate", "max_over_ranks"]


def max_over_ranks(ranks: list[RankMemory]) -> dict[str, int]:
    """Per kind, the most bytes any rank needs: ``RunResult.summary()``'s ``memory_max_over_ranks``, predicted.
    Unlike ``Estimate.memory`` (one rank's whole breakdown), each kind may come from another rank."""
    return max_per_kind([{k: r.memory.get(k, 0) for k in KINDS} for r in ranks])


@dataclass
class Estimate:
    memory: dict[str, int]
    peak_bytes: int
    step_ms: float | None
    assumptions: list[str]
    per_rank: list[RankMemory] = field(repr=False, default_factory=list)

    @property
    def memory_max_over_ranks(self) -> dict[str, int]:
        return max_over_ranks(self.per_rank)

    def to_json(self) -> str:
        out = {"memory": self.memory, "memory_max_over_ranks": self.memory_max_over_ranks,
               "peak_bytes": self.peak_bytes, "step_ms": self.step_ms,
               "assumptions": self.assumptions,
               "per_rank": [dataclasses.asdict(r) | {"total": r.total} for r in self.per_rank]}
        return json.dumps(out, indent=2)


def estimate(cfg: RunConfig, link: LinkModel | LinkSet | None = None,
             compute: str | Roofline = "timed") -> Estimate:
    """The job's predicted memory per rank (and its largest rank's), without starting a process; with a
    ``link`` (an alpha-beta LinkModel, or a LinkSet of one per collective), also its step time, its
    compute ``"timed"`` here (the default) or ``"predicted"`` on this machine's saved roofline (or on
    the ``Roofline`` given): see ``estimate.step``."""
    ranks = per_rank(cfg)
    top = max(ranks, key=lambda r: r.total)
    notes = [f"tier {cfg.tier}, world size {cfg.world_size}, {cfg.model} width {cfg.model_size} depth "
             f"{cfg.model_depth}, global batch {cfg.global_batch_size}, {cfg.precision}, optimizer {cfg.optimizer}",
             "bytes counted from the tensors' shapes and dtypes, as a run counts its tensors (no allocator "
             "overhead, no framework workspace)", *dict.fromkeys(a for r in ranks for a in r.assumptions)]
    if cfg.activation_checkpointing:
        notes.append("activation checkpointing: each block keeps only its input")
    step_ms = None
    if link is None:
        notes.append("step time: give a link (dtlab.cost.links: calibrate a sweep, or "
                     "LinkModel.from_bandwidth) to predict it")
    else:
        model = build_job(cfg, torch.device("meta"))[0]
        seconds, step_notes = step.predict(cfg, model, link, compute)
        step_ms, notes = seconds * 1e3, notes + step_notes
    return Estimate({k: top.memory.get(k, 0) for k in KINDS}, top.total, step_ms, notes, ranks)


def compare(est: Estimate, result: RunResult) -> pd.DataFrame:
    """Predicted against measured bytes per rank and kind, with the relative error."""
    rows: list[dict[str, Any]] = []
    for predicted, measured in zip(est.per_rank, result.ranks):
        for kind in KINDS:
            got = measured.memory.get(kind)
            if got is None:
                continue
            want = predicted.memory.get(kind, 0)
            error = (want - got) / got if got else (0.0 if want == 0 else float("inf"))
            rows.append({"rank": predicted.rank, "kind": kind, "predicted": want, "measured": got, "error": error})
    return pd.DataFrame(rows, columns=["rank", "kind", "predicted", "measured", "error"])
