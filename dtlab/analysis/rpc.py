"""Tables and figures of a run's RPC calls, and the parameter server's staleness."""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from dtlab import plots
from dtlab.core.results import RunResult
from dtlab.instrument.rpc import events_frame


def call_table(events: Any) -> Any:
    """One row per (caller, callee, function): calls, request and response bytes, median latency."""
    df = events if hasattr(events, "columns") else events_frame(events)
    g = df.groupby(["caller", "peer", "op", "tag"], sort=True)
    out = g.agg(calls=("seq", "size"), request_bytes=("bytes", "sum"), response_bytes=("response_bytes", "sum"),
                median_latency_ms=("duration_s", "median")).reset_index().rename(columns={"peer": "callee",
                                                                                          "tag": "function"})
    out["median_latency_ms"] *= 1e3
    return out


def call_matrix(events: Any, value: str = "calls") -> Any:
    """Caller x callee: ``calls``, ``request_bytes``, ``response_bytes`` or ``bytes`` (both ways)."""
    table = call_table(events)
    table["bytes"] = table["request_bytes"] + table["response_bytes"]
    if value not in ("calls", "request_bytes", "response_bytes", "bytes"):
        raise ValueError(f"value={value!r}: choose calls, request_bytes, response_bytes or bytes")
    return table.pivot_table(index="caller", columns="callee", values=value, aggfunc="sum", fill_value=0)


def call_matrix_figure(events: Any, value: str = "calls", title: str = "") -> Any:
    """The call matrix as an annotated heat map (matplotlib Figure)."""
    m = call_matrix(events, value)
    fig = Figure(figsize=(4.8, 1.6 + 0.5 * len(m)), layout="constrained")
    ax = fig.subplots()
    values = m.to_numpy(float)
    top = values.max() or 1.0
    ax.imshow(values, cmap="Blues", aspect="auto", vmin=0, vmax=top)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            v = values[i, j]
            text = f"{v:,.0f}" if value == "calls" else f"{v / 1024:,.1f} KiB"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if v > top / 2 else "black")
    ax.set_xticks(range(m.shape[1]), m.columns)
    ax.set_yticks(range(m.shape[0]), m.index)
    ax.set(xlabel="callee", ylabel="caller", title=title or f"RPC {value.replace('_', ' ')}, caller x callee")
    return fig


def timeline_figure(events: Any, phases: Any, names: tuple[str, ...] | list[str], step: int | None = None) -> Any:
    """Per-worker timeline: each worker's compute phases in one lane, its outgoing RPCs in another."""
    ev = events if hasattr(events, "columns") else events_frame(events)
    ph = phases if hasattr(phases, "columns") else pd.DataFrame(list(phases), columns=["rank", "phase", "start",
                                                                                        "end", "step"])
    if step is not None:
        ev, ph = ev[ev["step"] == step], ph[ph["step"] == step]
    lanes = [pd.DataFrame({"lane": [f"{names[int(r)]} compute" for r in ph["rank"]], "kind": ph["phase"],
                           "start": ph["start"], "end": ph["end"], "order": ph["rank"] * 2}),
             pd.DataFrame({"lane": [f"{names[int(r)]} rpc" for r in ev["rank"]], "kind": ev["op"],
                           "start": ev["start"], "end": ev["end"], "order": ev["rank"] * 2 + 1})]
    df = pd.concat([d for d in lanes if not d.empty]).sort_values(["order", "start"], kind="stable")
    where = f"step {step}" if step is not None else "whole run"
    return plots.gantt(df, lane="lane", color_by="kind", title=f"RPC timeline per worker ({where})")


def staleness_frame(result: RunResult) -> Any:
    """One row per applied gradient: trainer, step, read_version, applied_version, staleness."""
    return pd.DataFrame(result.ranks[0].strategy["staleness"],
                        columns=["trainer", "step", "read_version", "applied_version", "staleness"])
