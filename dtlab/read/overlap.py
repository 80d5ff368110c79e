"""Communication–computation overlap per rank: the share of the time in communication that coincides with compute.

``dtlab.experiments.overlap`` measures it on four layouts.

On a rank's timeline (``RunResult.events_frame()`` and ``phases_frame()``):

* *communication* is the union of its events' spans, each from its issue (``start``) to its completion (``end``;
  a DDP bucket's by its step's backward end at the latest);
* *compute* is the union of the loop's compute phases (forward, backward, a custom step's forward_backward,
  optimizer) less the spans in which the training thread was blocked in a call: a synchronous call's whole
  span, an asynchronous one's ``wait_s`` before its ``end`` (a wait that saw it complete). DDP waits for its
  buckets in C++, below any Python wait, so a step's backward counts as compute only until its last bucket is
  launched (its gradients were the last to be ready), as ``frames.comm_overlap`` takes it;
* overlap = |communication ∩ compute| / |communication|, per rank, over the steps after the first (warm-up).

So a collective that runs while the thread computes (DDP's buckets during backward, a prefetched all-gather,
a ring transfer under a GEMM chunk) counts; one the thread waits for does not. A point-to-point transfer that
completes before anyone waits for it is seen complete only at its wait (gloo's send and receive works have no
future), so its span may reach past the data's arrival: the share is an upper bound for those.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from dtlab.core.results import RunResult

__all__ = ["COMPUTE_PHASES", "blocked_spans", "comm_spans", "compute_spans", "intersect", "length", "overlap",
           "overlap_by_rank", "subtract", "union"]


COMPUTE_PHASES = ("forward", "backward", "forward_backward", "optimizer")
Spans = list[tuple[float, float]]


def union(spans: Iterable[tuple[float, float]]) -> Spans:
    """Sorted, disjoint spans covering the same time as ``spans`` (empty ones dropped)."""
    out: Spans = []
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: Spans, y: Spans) -> Spans:
    """The time in both of two unions."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Spans, y: Spans) -> Spans:
    """The time in ``x`` and not in ``y`` (both unions)."""
    out = []
    for a, b in x:
        cursor = a
        for c, d in y:
            if d <= cursor or c >= b:
                continue
            if c > cursor:
                out.append((cursor, c))
            cursor = max(cursor, d)
        if cursor < b:
            out.append((cursor, b))
    return out


def length(spans: Spans) -> float:
    return sum(b - a for a, b in spans)


def blocked_spans(events: pd.DataFrame) -> Spans:
    """When the thread sat in a call: a synchronous call's whole span, an asynchronous call's wait."""
    sync = [(s, e) for s, e, a in zip(events["start"], events["end"], events["async"]) if not a]
    waits = [(e - w, e) for e, w, a in zip(events["end"], events["wait_s"], events["async"]) if a and w > 0]
    return union(sync + waits)


def compute_spans(events: pd.DataFrame, phases: pd.DataFrame) -> Spans:
    """One rank's compute: its compute phases, backward cut at its last DDP bucket's launch, less blocked spans."""
    spans = []
    for step, rows in phases[phases["phase"].isin(COMPUTE_PHASES)].groupby("step"):
        buckets = events[(events["step"] == step) & events["tag"].astype(str).str.startswith("ddp_bucket")]
        last_launch = buckets["start"].max() if len(buckets) else None
        for name, a, b in zip(rows["phase"], rows["start"], rows["end"]):
            if name == "backward" and last_launch is not None:
                b = min(b, last_launch)
            spans.append((a, b))
    return subtract(union(spans), blocked_spans(events))


def comm_spans(events: pd.DataFrame, phases: pd.DataFrame) -> Spans:
    """One rank's communication: each event from issue to completion. DDP's backward returns only once its
    buckets are reduced, so a bucket ends by its step's backward end at the latest (its future's callback, the
    only sighting of its completion, can come later, waiting for the GIL)."""
    backward_end = phases[phases["phase"] == "backward"].groupby("step")["end"].max()
    ends = []
    for step, tag, end in zip(events["step"], events["tag"].astype(str), events["end"]):
        if tag.startswith("ddp_bucket") and step in backward_end.index:
            end = min(end, backward_end[step])
        ends.append(end)
    return union(zip(events["start"], ends))


def overlap(events: pd.DataFrame, phases: pd.DataFrame) -> dict[str, float]:
    """One rank's communication seconds, the seconds of it under compute, and their ratio in percent."""
    comm = comm_spans(events, phases)
    hidden = length(intersect(comm, compute_spans(events, phases)))
    total = length(comm)
    return {"comm_s": total, "overlapped_s": hidden, "overlap_pct": 100 * hidden / total if total else 0.0}


def overlap_by_rank(result: RunResult, warmup_steps: int = 1) -> pd.DataFrame:
    """``overlap`` per rank over the run's steps from ``warmup_steps`` on: rank, comm_s, overlapped_s, overlap_pct."""
    events, phases = result.events_frame(), result.phases_frame()
    last = result.config.steps
    events = events[(events["step"] >= warmup_steps) & (events["step"] < last)]
    phases = phases[(phases["step"] >= warmup_steps) & (phases["step"] < last)]
    rows = [{"rank": r, **overlap(events[events["rank"] == r], phases[phases["rank"] == r])}
            for r in sorted(set(phases["rank"]))]
    return pd.DataFrame(rows, columns=["rank", "comm_s", "overlapped_s", "overlap_pct"])
