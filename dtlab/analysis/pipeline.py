"""Reading a pipeline run: its schedule per stage, the bubble, and their ideal values."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dtlab import plots
from dtlab.tiers.pipeline import GATHER_TAG, SETUP_TAG

_COMPUTE = r"^pp_(forward|backward):(\d+)$"


P2P_OPS = ("isend", "irecv", "send", "recv")


def ideal_bubble(schedule: str, stages: int, microbatches: int) -> float:
    """The idle share of each stage with equal stage times and free communication:
    (S-1)/(M+S-1) for GPipe and 1F1B, (S-1)/S when micro-batches go one at a time."""
    return (stages - 1) / (stages if schedule == "naive" else microbatches + stages - 1)


def _compute_rows(result: Any) -> pd.DataFrame:
    ph = result.phases_frame()
    parts = ph["phase"].str.extract(_COMPUTE)
    ph = ph[parts[0].notna()].assign(phase=parts[0], microbatch=parts[1].astype(float).astype("Int64"))
    return ph.sort_values(["rank", "start"]).reset_index(drop=True)


def schedule_frame(result: Any, step: int | None = None, p2p: bool = False) -> pd.DataFrame:
    """One step of a pipeline run as the lanes frame of ``plots.gantt(df, lane="lane", color_by="phase")``.

    One lane per stage, one bar per micro-batch's forward or backward (columns rank,
    lane, phase, microbatch, start, end). With ``p2p``, each stage gets a second lane
    of its recorded transfers, named by what they carry ("send act", "recv grad", ...):
    a send is matched to the compute just before it, a receive to the one it feeds.
    ``step`` defaults to the middle step (step 0 also pays set-up).
    """
    step = result.config.steps // 2 if step is None else step
    compute = _compute_rows(result)
    compute = compute[compute["step"] == step]
    if compute.empty:
        raise ValueError(f"schedule_frame: no pipeline phases recorded for step {step} (was the run recorded?)")
    compute = compute.assign(lane=[f"stage {r}" for r in compute["rank"]], order=compute["rank"] * 2)
    frames = [compute]
    if p2p:
        ev = result.events_frame()
        ev = ev[(ev["step"] == step) & ev["op"].isin(P2P_OPS) & ~ev["tag"].isin([SETUP_TAG, GATHER_TAG])]
        rows = []
        for e in ev.itertuples():
            mine = compute[compute["rank"] == e.rank]
            sending = e.op in ("isend", "send")
            match = mine[mine["start"] <= e.start].tail(1) if sending else mine[mine["start"] >= e.start].head(1)
            if match.empty:
                continue
            what = "act" if match["phase"].iloc[0] == "forward" else "grad"  # short: the legend is one line
            rows.append({"rank": e.rank, "lane": f"stage {e.rank} p2p", "order": e.rank * 2 + 1,
                         "phase": f"{'send' if sending else 'recv'} {what}", "microbatch": match["microbatch"].iloc[0],
                         "start": e.start, "end": e.end, "step": step})
        frames.append(pd.DataFrame(rows))
    out = pd.concat(frames, ignore_index=True).sort_values(["order", "start"], kind="stable")
    return out.drop(columns="order").reset_index(drop=True)


def schedule_figure(result: Any, step: int | None = None, p2p: bool = False, title: str | None = None) -> Any:
    """``plots.gantt`` of ``schedule_frame``, each compute bar labelled with its micro-batch."""
    step = result.config.steps // 2 if step is None else step
    df = schedule_frame(result, step, p2p)
    o = result.config.tier_options
    title = title or (f"{o.schedule}: {result.config.world_size} stages, {o.microbatches} micro-batch"
                      f"{'es' if o.microbatches > 1 else ''} (step {step})")
    fig = plots.gantt(df, lane="lane", color_by="phase", title=title)
    ax, t0 = fig.axes[0], float(df["start"].min())
    lanes = list(pd.unique(df["lane"]))
    for row in df[df["phase"].isin(["forward", "backward"])].itertuples():
        ax.text(((row.start + row.end) / 2 - t0) * 1e3, lanes.index(row.lane), str(row.microbatch),
                ha="center", va="center", fontsize=7, color="white")
    return fig


def bubble_frame(result: Any) -> pd.DataFrame:
    """Per step and stage: busy seconds (its forwards and backwards), the step's pipeline
    span (first stage's first start to the last end on any stage) and the idle fraction."""
    compute = _compute_rows(result)
    busy = (compute["end"] - compute["start"]).groupby([compute["step"], compute["rank"]]).sum()
    window = compute.groupby("step").agg(first=("start", "min"), last=("end", "max"))
    out = busy.rename("busy_s").reset_index().merge(window, on="step")
    out["span_s"] = out.pop("last") - out.pop("first")
    out["idle_fraction"] = 1 - out["busy_s"] / out["span_s"]
    return out
