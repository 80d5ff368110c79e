"""Figures of fault-tolerant runs: replica groups over time, and loss against steps and against wall time."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dtlab.plots.style import LINESTYLES, TIER_PALETTE, bottom_legend, figure, require

__all__ = ["loss_vs_time", "replica_timeline"]

# event kind -> (legend label, colour, marker)
_MARKS = {"fault": ("fault", "tab:red", "X"), "replica_start": ("group restarted", "tab:green", "^"),
          "ft_begin": ("rejoined: state from a peer", "tab:purple", "o")}


def _lanes(ax: object, df: pd.DataFrame, replicas: list[int]) -> None:
    """One lane per replica group: its steps (committed, healing, not committed) and its events."""
    steps = df[df["kind"] == "ft_step"] if "committed" in df else df.iloc[0:0]
    styles = (("step committed", "tab:blue", "|", lambda s: s["committed"] & ~s["healing"]),
              ("step while healing (no own gradient)", "tab:orange", "|", lambda s: s["committed"] & s["healing"]),
              ("step not committed (run again)", "black", "x", lambda s: ~s["committed"]))
    if len(steps) and "quorum_id" in steps:  # the lighthouse re-formed the quorum: groups left or joined
        firsts = steps.dropna(subset=["quorum_id"]).groupby("quorum_id")["t_s"].min().sort_index().iloc[1:]
        for i, t in enumerate(firsts):
            ax.axvline(t, color="0.5", ls=":", lw=1, label="quorum change" if i == 0 else None, zorder=1)
    if len(steps):
        steps = steps.astype({"committed": bool, "healing": bool})
        for label, color, marker, pick in styles:
            rows = steps[pick(steps)]
            if len(rows):
                ax.scatter(rows["t_s"], rows["replica"], color=color, marker=marker, s=60, label=label, zorder=2)
    syncs = df[df["kind"] == "diloco_sync"]
    if len(syncs):
        ax.scatter(syncs["t_s"], syncs["replica"], color="tab:cyan", marker="D", s=30, label="synchronisation",
                   zorder=2)
    for kind, (label, color, marker) in _MARKS.items():
        rows = df[(df["kind"] == kind) & df["replica"].notna()]
        if kind == "replica_start":
            rows = rows[rows["attempt"] > 0]
        if kind == "ft_begin" and "healing" in rows:
            rows = rows[rows["healing"].astype(bool)]
        if len(rows):
            ax.scatter(rows["t_s"], rows["replica"], color=color, marker=marker, s=70, label=label, zorder=3)
    ax.set_yticks(replicas, [f"group {r}" for r in replicas])
    ax.set_ylim(max(replicas) + 0.6, -0.6)


def replica_timeline(df: pd.DataFrame) -> Figure:
    """A run of replica groups: what each group did over time, and how many groups each step averaged.

    ``df``: ``dtlab.read.ft.timeline``'s frame (t_s, kind, replica, attempt, step; ``ft_step`` rows
    with committed, participants, healing). Top: one lane per group -- steps, faults, restarts, the
    first quorum of a restarted group. Bottom (ft runs): participants per committed step, the quorum
    changes where it steps.
    """
    require(df, ("t_s", "kind", "replica"), "replica_timeline")
    replicas = sorted(int(r) for r in df["replica"].dropna().unique())
    has_steps = "committed" in df and (df["kind"] == "ft_step").any()
    fig = figure(4.8 if has_steps else 2.2 + 0.45 * len(replicas))
    axes = fig.subplots(2, 1, height_ratios=(1.4, 1)) if has_steps else [fig.subplots()]
    top = axes[0]
    _lanes(top, df, replicas)
    top.set(title="Replica groups over time", xlabel="time since the first event (s)")
    top.grid(axis="x", alpha=0.3)
    bottom_legend(fig, top, max_cols=2 if has_steps else 3)
    if has_steps:
        steps = df[(df["kind"] == "ft_step")].astype({"committed": bool})
        per_step = steps[steps["committed"]].groupby("step")["participants"].max()
        ax = axes[1]
        ax.step(per_step.index, per_step.to_numpy(float), where="mid", color="tab:blue")
        ax.set(xlabel="step", ylabel="groups averaged", ylim=(0, max(replicas) + 1.5))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return fig


def loss_vs_time(curves: Mapping[str, pd.DataFrame]) -> Figure:
    """Training loss against steps (left) and against training time (right), one line per run.

    ``curves``: label -> frame with columns step, time_s (training time up to the end of that step) and
    loss (``dtlab.read.ft.loss_by_time``). A run that sends less per step reaches a loss sooner in
    time even when it needs more steps for it: the right panel shows which wins on a given link.
    """
    if not curves:
        raise ValueError("loss_vs_time: no curves given")
    fig = figure(3.4)
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    for i, (label, frame) in enumerate(curves.items()):
        require(frame, ("step", "time_s", "loss"), f"loss_vs_time[{label!r}]")
        style = dict(label=str(label), ls=LINESTYLES[i % len(LINESTYLES)], color=TIER_PALETTE[i % len(TIER_PALETTE)])
        by_step.plot(frame["step"], frame["loss"], **style)
        by_time.plot(frame["time_s"], frame["loss"], **style)
    by_step.set(title="loss against steps", xlabel="step", ylabel="training loss")
    by_time.set(title="loss against training time", xlabel="training time (s)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    bottom_legend(fig, by_step, max_cols=3)
    return fig
