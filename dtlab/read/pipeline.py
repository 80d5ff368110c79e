"""Reading a pipeline run: its schedule per stage and its bubble, beside their ideal values (``cost.pipeline``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from dtlab.cost.pipeline import ideal_bubble, simulated_bubble
from dtlab.plots.pipeline import pipeline_schedule
from dtlab.tiers.parts.pipeline_stages import placement, rank_transfers
from dtlab.tiers.pipeline import GATHER_TAG, SETUP_TAG, stages_per_rank

_COMPUTE = r"^pp_(forward|backward|backward_input|backward_weight):(\d+)(?:@(\d+))?$"
P2P_OPS = ("isend", "irecv", "send", "recv")


def _compute_rows(result: Any) -> pd.DataFrame:
    ph = result.phases_frame()
    parts = ph["phase"].str.extract(_COMPUTE)
    ph = ph[parts[0].notna()].assign(phase=parts[0], microbatch=parts[1].astype(float).astype("Int64"))
    stage = parts[2].astype(float).astype("Int64")
    ph = ph.assign(stage=stage.fillna(ph["rank"].astype("Int64")))  # one stage per rank: its rank
    return ph.sort_values(["rank", "start"]).reset_index(drop=True)


def schedule_frame(result: Any, step: int | None = None, p2p: bool = False) -> pd.DataFrame:
    """One step of a pipeline run as the frame of ``plots.pipeline_schedule`` (or ``plots.gantt``).

    One lane per stage ("stage r"; per rank, "rank r", where ranks hold several), one bar per micro-batch's
    forward or backward (zero bubble: its input and weight parts). Columns rank, lane, stage, hold (the
    rank's how-manyth stage), phase, microbatch, start, end. With ``p2p``, each rank gets a second lane of
    its recorded transfers, named by what they carry ("send act", "recv grad", ...): a send is matched to the
    compute just before it, a receive to the one it feeds. ``step`` defaults to the middle step (step 0
    also pays set-up).
    """
    step = result.config.steps // 2 if step is None else step
    compute = _compute_rows(result)
    compute = compute[compute["step"] == step]
    if compute.empty:
        raise ValueError(f"schedule_frame: no pipeline phases recorded for step {step} (was the run recorded?)")
    cfg = result.config
    per = stages_per_rank(cfg.tier_options)
    holds = {s: k for held in placement(cfg.tier_options.schedule, cfg.world_size, per) for k, s in enumerate(held)}
    name = "rank" if per > 1 else "stage"
    compute = compute.assign(lane=[f"{name} {r}" for r in compute["rank"]], order=compute["rank"] * 2,
                             hold=compute["stage"].map(holds).fillna(0).astype(int))
    frames = [compute]
    if p2p:
        frames.append(_p2p_rows(result, compute, step, name))
    out = pd.concat(frames, ignore_index=True).sort_values(["order", "start"], kind="stable")
    return out.drop(columns="order").reset_index(drop=True)


def _p2p_rows(result: Any, compute: pd.DataFrame, step: int, name: str) -> pd.DataFrame:
    """Each recorded transfer, named. Where the schedule's own list of transfers is known (the multi-stage
    ones), the rank's n-th send is its n-th planned send, and so for receives; otherwise a send is matched to
    the compute just before it, a receive to the compute just after (what it feeds)."""
    cfg = result.config
    planned = rank_transfers(cfg.tier_options.schedule, cfg.world_size, cfg.tier_options.microbatches,
                             stages_per_rank(cfg.tier_options))
    ev = result.events_frame()
    ev = ev[(ev["step"] == step) & ev["op"].isin(P2P_OPS) & ~ev["tag"].isin([SETUP_TAG, GATHER_TAG])]
    rows = []
    for (rank, sending), group in ev.groupby([ev["rank"], ev["op"].isin(("isend", "send"))], sort=False):
        group = group.sort_values("start", kind="stable")
        plan = [a for a in (planned or {}).get(rank, []) if a[1].startswith("SEND" if sending else "RECV")]
        mine = compute[compute["rank"] == rank]
        for n, e in enumerate(group.itertuples()):
            if len(plan) == len(group):
                stage, kind, mb = plan[n]
                what = "act" if kind.endswith("F") else "grad"
            else:
                match = mine[mine["start"] <= e.start].tail(1) if sending else mine[mine["start"] >= e.start].head(1)
                if match.empty:
                    continue
                what = "act" if match["phase"].iloc[0] == "forward" else "grad"  # short: the legend is one line
                mb = match["microbatch"].iloc[0]
            rows.append({"rank": rank, "lane": f"{name} {rank} p2p", "order": rank * 2 + 1, "microbatch": mb,
                         "phase": f"{'send' if sending else 'recv'} {what}", "start": e.start, "end": e.end,
                         "step": step})
    return pd.DataFrame(rows)


def schedule_figure(result: Any, step: int | None = None, p2p: bool = False, title: str | None = None) -> Any:
    """``plots.pipeline_schedule`` of ``schedule_frame``: each compute bar labelled with its micro-batch,
    a rank's second stage hatched."""
    step = result.config.steps // 2 if step is None else step
    o, world = result.config.tier_options, result.config.world_size
    per = stages_per_rank(o)
    stages = f"{world} ranks x {per} stages" if per > 1 else f"{world} stages"
    title = title or f"{o.schedule}: {stages}, {o.microbatches} micro-batch{'es' if o.microbatches > 1 else ''} " \
                     f"(step {step})"
    return pipeline_schedule(schedule_frame(result, step, p2p), title=title)


def bubble_frame(result: Any) -> pd.DataFrame:
    """Per step and rank: busy seconds (its forwards and backwards), the step's pipeline span (first stage's
    first start to the last end on any stage), the idle fraction, and what the recorded transfers explain of
    the idle time: ``transfer_s`` (the time the rank had a send or receive in flight, overlaps counted once),
    ``idle_in_transfer_s`` (idle time with one in flight) and ``idle_in_arrival_s`` (idle time while a
    receive whose matching send the peer had already posted was still arriving: the transfer's own cost; a
    receive posted before its send waits for the peer's compute, which is the schedule's bubble, not the
    transfer's)."""
    compute = _compute_rows(result)
    busy = (compute["end"] - compute["start"]).groupby([compute["step"], compute["rank"]]).sum()
    window = compute.groupby("step").agg(first=("start", "min"), last=("end", "max"))
    out = busy.rename("busy_s").reset_index().merge(window, on="step")
    transfers = _transfer_rows(result)
    arrivals = _arrivals(transfers)
    moved, idle_moved, idle_arriving = [], [], []
    for row in out.itertuples():
        bars = compute[(compute["step"] == row.step) & (compute["rank"] == row.rank)]
        sent = transfers[(transfers["step"] == row.step) & (transfers["rank"] == row.rank)]
        came = arrivals[(arrivals["step"] == row.step) & (arrivals["rank"] == row.rank)]
        inflight = _union(zip(sent["start"].clip(row.first, row.last), sent["end"].clip(row.first, row.last)))
        arriving = _union(zip(came["start"].clip(row.first, row.last), came["end"].clip(row.first, row.last)))
        idle = _gaps(_union(zip(bars["start"], bars["end"])), row.first, row.last)
        moved.append(sum(b - a for a, b in inflight))
        idle_moved.append(_overlap(idle, inflight))
        idle_arriving.append(_overlap(idle, arriving))
    out["span_s"] = out.pop("last") - out.pop("first")
    out["idle_fraction"] = 1 - out["busy_s"] / out["span_s"]
    out["transfer_s"], out["idle_in_transfer_s"], out["idle_in_arrival_s"] = moved, idle_moved, idle_arriving
    return out


def _arrivals(transfers: pd.DataFrame) -> pd.DataFrame:
    """Per receive: from when both sides had posted (the later of the receive and its matching send, the
    sender's n-th send to this rank in the step for the n-th receive from it) to its end."""
    rows = []
    if transfers.empty or "peer" not in transfers:
        return pd.DataFrame(columns=["rank", "step", "start", "end"])
    sends = transfers[transfers["op"].isin(("isend", "send"))]
    recvs = transfers[transfers["op"].isin(("irecv", "recv"))]
    for (step, rank, peer), got in recvs.groupby(["step", "rank", "peer"]):
        put = sends[(sends["step"] == step) & (sends["rank"] == peer) & (sends["peer"] == rank)]
        for r, s in zip(got.sort_values("start").itertuples(), put.sort_values("start").itertuples()):
            rows.append({"rank": rank, "step": step, "start": max(r.start, s.start), "end": r.end})
    return pd.DataFrame(rows, columns=["rank", "step", "start", "end"])


def _transfer_rows(result: Any) -> pd.DataFrame:
    """The run's recorded point-to-point transfers inside its steps (set-up and the final gather left out)."""
    ev = result.events_frame()
    if ev.empty:
        return pd.DataFrame(columns=["rank", "step", "start", "end"])
    return ev[ev["op"].isin(P2P_OPS) & ~ev["tag"].isin([SETUP_TAG, GATHER_TAG])]


def _union(intervals: Any) -> list[tuple[float, float]]:
    """Sorted, merged intervals (empty ones dropped)."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _gaps(merged: list[tuple[float, float]], first: float, last: float) -> list[tuple[float, float]]:
    """The parts of [first, last] that ``merged`` leaves uncovered."""
    gaps, at = [], first
    for a, b in merged:
        if a > at:
            gaps.append((at, min(a, last)))
        at = max(at, b)
    return gaps + ([(at, last)] if last > at else [])


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def measured_idle(result: Any) -> float:
    """The run's bubble: each rank's idle share, median over the steps after the first, mean over ranks."""
    b = bubble_frame(result)
    return float(b[b["step"] > 0].groupby("rank")["idle_fraction"].median().mean())


def transfer_share(result: Any) -> tuple[float, float, float]:
    """The run's recorded transfers against its idle time, over the steps after the first (medians over steps,
    means over ranks): the time a transfer was in flight as a share of the step's span; the share of the
    idle time that had one in flight (posted receives waiting for the peer included); and the share of the
    idle time spent on receives whose send was already posted (what the transfers themselves cost)."""
    b = bubble_frame(result)
    b = b[b["step"] > 0]
    idle_s = (b["span_s"] - b["busy_s"]).where(lambda x: x > 0)
    in_flight = (b["transfer_s"] / b["span_s"]).groupby(b["rank"]).median().mean()
    posted = (b["idle_in_transfer_s"] / idle_s).groupby(b["rank"]).median().mean()
    arriving = (b["idle_in_arrival_s"] / idle_s).groupby(b["rank"]).median().mean()
    return float(in_flight), float(posted), float(arriving)


def bubble_table(results: Mapping[str, Any]) -> pd.DataFrame:
    """Per run: its schedule, ranks p, stages per rank v, micro-batches M, the measured idle share, the formula's
    (NaN where none) and the simulated one (its own action order, equal stages, free transfers); then
    ``transfer_share`` of the step, ``idle_in_transfer`` and ``idle_in_arrival`` (``transfer_share``'s values)."""
    rows = []
    for label, r in results.items():
        o, p = r.config.tier_options, r.config.world_size
        v, m = stages_per_rank(o), o.microbatches
        try:
            formula = ideal_bubble(o.schedule, p, m, v)
        except ValueError:
            formula = float("nan")
        rows.append({"run": label, "schedule": o.schedule, "p": p, "v": v, "M": m, "measured": measured_idle(r),
                     "formula": formula, "simulated": simulated_bubble(o.schedule, p, m, v),
                     **dict(zip(("transfer_share", "idle_in_transfer", "idle_in_arrival"), transfer_share(r)))})
    return pd.DataFrame(rows)
