"""Figures of a mixture of experts: the router's choices, the load per expert, the all-to-all bytes, the ranks.

The tables come from ``dtlab.read.ep``; here they are only drawn.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dtlab.plots.style import TIER_PALETTE, figure, require

__all__ = ["all_to_all_bytes", "expert_load", "rank_load", "router_heatmap"]

KB = 1e3


def router_heatmap(share: pd.DataFrame, title: str = "Which expert each character picks first") -> Figure:
    """``share``: rows (characters, tokens...) x columns (experts), each row's shares; drawn as a heat map."""
    if share.empty:
        raise ValueError("router_heatmap: the table is empty")
    fig = figure(max(2.6, 0.9 + 0.22 * len(share)))
    ax = fig.subplots()
    image = ax.imshow(share.to_numpy(float), aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(share.shape[1]), [str(c) for c in share.columns])
    ax.set_yticks(range(len(share)), [str(i) for i in share.index], fontsize=8)
    ax.set(title=title, xlabel="expert", ylabel=share.index.name or "")
    fig.colorbar(image, ax=ax, label="share of its tokens")
    return fig


def expert_load(loads: Mapping[str, pd.DataFrame], title: str = "Tokens per expert") -> Figure:
    """One panel per run: each expert's share of the step's assignments over training.

    ``loads``: label -> a table step x expert of token counts (``read.ep.expert_load``)."""
    if not loads:
        raise ValueError("expert_load: no runs given")
    fig = figure(3.4)
    axes = np.atleast_1d(fig.subplots(1, len(loads), sharey=True))
    for ax, (label, load) in zip(axes, loads.items()):
        share = load.div(load.sum(axis=1), axis=0)
        for i, expert in enumerate(share.columns):
            ax.plot(share.index, share[expert], color=TIER_PALETTE[i % len(TIER_PALETTE)], label=f"expert {expert}")
        ax.axhline(1 / share.shape[1], color="k", ls="--", lw=1, label="even")
        ax.set(title=label, xlabel="step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of the assignments")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6), frameon=False)
    fig.suptitle(title)
    return fig


def all_to_all_bytes(df: pd.DataFrame, formula: float, title: str = "All-to-all bytes per step (one rank)") -> Figure:
    """Recorded bytes of each kind of all-to-all per step against ``formula`` (the dispatches' bytes per step).

    ``df``: columns step, kind, bytes, sent_bytes (``read.ep.all_to_all_bytes``)."""
    require(df, ("step", "kind", "bytes", "sent_bytes"), "all_to_all_bytes")
    fig = figure(3.4)
    ax = fig.subplots()
    kinds = sorted(df["kind"].unique(), key=lambda k: (k.startswith("counts"), k))
    for i, kind in enumerate(kinds):
        rows = df[df["kind"] == kind]
        # equal sizes (a dispatch and the combine's backward) overlap: the markers tell them apart
        ax.plot(rows["step"], rows["bytes"] / KB, marker="os^vxD"[i % 6], ms=7 - i, lw=1.5,
                color=TIER_PALETTE[i % len(TIER_PALETTE)], label=kind)
    dispatch = df[df["kind"] == "dispatch"]
    if not dispatch.empty:
        ax.plot(dispatch["step"], dispatch["sent_bytes"] / KB, ls=":", color="k", label="dispatch: leaves the rank")
    ax.axhline(formula / KB, color="k", ls="--", lw=1, label="dispatch: formula")
    ax.set(title=title, xlabel="step", ylabel="kB per step", ylim=(0, None))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def rank_load(df: pd.DataFrame, title: str = "Each rank's experts") -> Figure:
    """Per rank, the rows its experts ran on and the seconds it spent in all-to-alls (medians over steps).

    ``df``: columns rank, tokens, all_to_all_s (``read.ep.rank_load``)."""
    require(df, ("rank", "tokens", "all_to_all_s"), "rank_load")
    med = df.groupby("rank")[["tokens", "all_to_all_s"]].median()
    fig = figure(3.0)
    left, right = fig.subplots(1, 2)
    labels = [f"rank {r}" for r in med.index]
    left.barh(labels, med["tokens"], color="tab:blue")
    right.barh(labels, med["all_to_all_s"] * 1e3, color="tab:purple")
    left.set(title="rows its experts ran on", xlabel="rows per step")
    right.set(title="time in all-to-alls (waiting included)", xlabel="ms per step")
    for ax in (left, right):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    return fig
