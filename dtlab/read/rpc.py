"""Tables and figures of a run's RPC calls, the parameter server's staleness, and async against sync."""

from __future__ import annotations

from collections.abc import Mapping
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


def run_summary(result: RunResult) -> dict[str, Any]:
    """A run's ``final_loss`` and ``test_accuracy``; for an rpc run also its parameter server's ``updates``,
    ``mean_staleness``, ``max_staleness`` and ``stale_share`` (the share of updates applied stale)."""
    row: dict[str, Any] = {"final_loss": result.final_loss(), "test_accuracy": result.ranks[0].evaluation["accuracy"]}
    if result.config.tier == "rpc":
        st = staleness_frame(result)["staleness"]
        row.update(updates=len(st), mean_staleness=st.mean(), max_staleness=st.max(), stale_share=(st > 0).mean())
    return row


def runs_table(runs: Mapping[Any, Mapping[str, RunResult]], key: str = "lr") -> pd.DataFrame:
    """``run_summary`` of every run, indexed by (``key``, label): ``runs`` maps e.g. a learning rate to
    ``{label: run}``; columns that a run lacks (staleness, for a non-rpc run) are NaN."""
    rows = [{key: k, "run": label, **run_summary(r)} for k, group in runs.items() for label, r in group.items()]
    return pd.DataFrame(rows).set_index([key, "run"])


def _mode(result: RunResult) -> str | None:
    return getattr(result.config.tier_options, "mode", "sync") if result.config.tier == "rpc" else None


def async_vs_sync(runs: Mapping[Any, Mapping[str, RunResult]], key: str = "lr") -> pd.DataFrame:
    """Each async parameter-server run against the sync one of its group.

    ``runs`` as for ``runs_table``; each group needs one sync rpc run. Indexed
    by (``key``, ``trainers``): ``stale_share``, ``mean_staleness``,
    ``max_staleness``, ``final_loss``, ``test_accuracy``, the sync run's
    ``sync_loss`` and ``sync_accuracy``, and ``verdict``: ``"lower"`` if the
    async run's final loss is below the sync run's, else ``"higher"``.
    """
    rows = []
    for k, group in runs.items():
        syncs = [r for r in group.values() if _mode(r) == "sync"]
        if len(syncs) != 1:
            raise ValueError(f"{key}={k!r}: expected one sync rpc run, found {len(syncs)}")
        s = run_summary(syncs[0])
        for r in group.values():
            if _mode(r) != "async":
                continue
            a = run_summary(r)
            rows.append({key: k, "trainers": int(r.config.world_size),
                         **{c: a[c] for c in ("stale_share", "mean_staleness", "max_staleness", "final_loss",
                                              "test_accuracy")},
                         "sync_loss": s["final_loss"], "sync_accuracy": s["test_accuracy"],
                         "verdict": "lower" if a["final_loss"] < s["final_loss"] else "higher"})
    columns = [key, "trainers", "stale_share", "mean_staleness", "max_staleness", "final_loss", "test_accuracy",
               "sync_loss", "sync_accuracy", "verdict"]
    return pd.DataFrame(rows, columns=columns).set_index([key, "trainers"])


def trainer_calls(calls: pd.DataFrame) -> dict[str, float]:
    """From ``call_table``'s frame of a parameter-server run: ``calls_min`` and ``calls_max`` (calls per caller),
    the forward's ``forward_kib_out`` and ``forward_kib_back`` per call and ``forward_median_ms`` (median of the
    callers' medians), and the optimizer step's ``step_median_ms``."""
    fwd = calls[calls["function"] == "_forward"]
    opt = calls[calls["function"] == "_local_optimizer_step"]
    per_caller = calls.groupby("caller")["calls"].sum()
    n = fwd["calls"].sum()
    return {"calls_min": int(per_caller.min()), "calls_max": int(per_caller.max()),
            "forward_kib_out": float(fwd["request_bytes"].sum() / n / 1024),
            "forward_kib_back": float(fwd["response_bytes"].sum() / n / 1024),
            "forward_median_ms": float(fwd["median_latency_ms"].median()),
            "step_median_ms": float(opt["median_latency_ms"].median())}


def action_requests(events: pd.DataFrame, phases: Any, tag: str = "_select_action") -> dict[str, float]:
    """The RL agent's action requests: ``requests``, medians ``latency_ms``, ``bytes_out``, ``bytes_back``, and
    ``policy_ms``, the median of the agent's (rank 0's) ``forward`` phases: the part of a request spent computing.

    ``events``: the run's RPC events frame; ``phases``: its phases (records or a frame with rank, phase, start, end).
    """
    actions = events[events["tag"] == tag]
    ph = phases if isinstance(phases, pd.DataFrame) else pd.DataFrame(list(phases))
    policy = (ph["end"] - ph["start"])[(ph["phase"] == "forward") & (ph["rank"] == 0)]
    return {"requests": len(actions), "latency_ms": float(actions["duration_s"].median()) * 1e3,
            "bytes_out": float(actions["bytes"].median()), "bytes_back": float(actions["response_bytes"].median()),
            "policy_ms": float(policy.median()) * 1e3}
