"""Figures of tensor, sequence and context parallelism: who calls what, the ring's messages, the work per rank,
the bytes per degree, and activation checkpointing's trade.

The tables come from ``dtlab.read.tp`` and ``dtlab.read.cp``; here they are
only drawn.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch

from dtlab.plots.style import OP_PALETTE, TIER_PALETTE, figure, require

__all__ = ["attention_work", "calls_by_tag", "checkpointing", "comm_vs_width", "cp_bytes", "ring_messages"]

MB = 1e6


def calls_by_tag(tables: Mapping[str, pd.DataFrame], who: str = "rank 0") -> Figure:
    """One panel per run: calls per step by the tag that issued them (rows, first issued on top), stacked by op.

    ``tables``: label -> a table tag x op of calls per step (``read.tp.calls_by_tag``)."""
    if not tables:
        raise ValueError("calls_by_tag: no runs given")
    tags = list(dict.fromkeys(t for table in tables.values() for t in table.index))
    ops = sorted({op for table in tables.values() for op in table.columns})
    colors = dict(zip(ops, OP_PALETTE))
    fig = figure(1.4 + 0.28 * len(tags))
    axes = np.atleast_1d(fig.subplots(1, len(tables), sharey=True, sharex=True))
    for ax, (name, table) in zip(axes, tables.items()):
        table = table.reindex(index=tags, columns=ops, fill_value=0)
        left = np.zeros(len(tags))
        for op in ops:
            ax.barh(range(len(tags)), table[op], left=left, color=colors[op], label=op, height=0.6)
            left += table[op].to_numpy()
        ax.set(title=name, xlabel=f"calls per step ({who})")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(tags)), tags, fontsize=8)
    axes[0].invert_yaxis()
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(ops), frameon=False)
    return fig


def comm_vs_width(lines: pd.DataFrame, measured: pd.DataFrame, crossing: Mapping[str, int],
                  ticks: list[int], names: Mapping[str, str] | None = None) -> Figure:
    """Bytes per step (left) and parameter bytes per rank (right) against the width, log-log: a line per tier
    from the formulas, measured runs as markers, and where tp's line crosses below each other tier's.

    ``lines``: rows of width, tier, comm, params (formulas); ``measured``: rows of tier, width, comm_bytes,
    param_bytes (``experiments.tp_widths.width_sweep``); ``crossing``: tier -> the first width where tp
    communicates less."""
    require(lines, ["width", "tier", "comm", "params"], "comm_vs_width")
    require(measured, ["tier", "width", "comm_bytes", "param_bytes"], "comm_vs_width")
    names = dict(names or {})
    colors = {t: TIER_PALETTE[i] for i, t in enumerate(dict.fromkeys(lines["tier"]))}
    fig = figure(3.6)
    ax_comm, ax_mem = fig.subplots(1, 2)
    for tier, color in colors.items():
        f, m = lines[lines["tier"] == tier], measured[measured["tier"] == tier]
        label = names.get(tier, tier)
        ax_comm.plot(f["width"], f["comm"] / MB, color=color, lw=1.2, label=f"{label} (formula)")
        ax_comm.plot(m["width"], m["comm_bytes"] / MB, "o", color=color, label=f"{label} (measured)")
        ax_mem.plot(f["width"], f["params"] / MB, color=color, lw=1.2)
        ax_mem.plot(m["width"], m["param_bytes"] / MB, "o", color=color)
    for tier, w in crossing.items():
        ax_comm.axvline(w, color=colors.get(tier, "k"), ls=":", lw=1)
        label = f"{names.get('tp', 'tp')} < {names.get(tier, tier)}\nfrom {w}"
        ax_comm.annotate(label, (w, ax_comm.get_ylim()[1]), fontsize=7, ha="left", va="top", xytext=(2, -2),
                         textcoords="offset points")
    for ax in (ax_comm, ax_mem):
        ax.set(xscale="log", yscale="log", xlabel="hidden size (model_size, log scale)")
        ax.set_xticks(ticks, [str(w) for w in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    ax_comm.set(ylabel="communicated per step, rank 0 (MB/step)", title="bytes per step (log-log)")
    ax_mem.set(ylabel="parameters held per rank (MB)", title="parameter memory (log-log)")
    handles, labels = ax_comm.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False, fontsize=8)
    return fig


def ring_messages(events: pd.DataFrame, phases: pd.DataFrame, colors: Mapping[str, str],
                  title: str = "ring attention: K/V (and dK/dV) blocks around the ring") -> Figure:
    """One step of a ring: each rank's lane with its passes shaded, and an arrow per message from where its
    isend was posted to where the matching irecv completed.

    ``events``: the step's isend and irecv rows (rank, peer, tag, start, end, seq); ``phases``: its rows of
    the passes (rank, phase, start, end), a phase named as its tag with ``_`` for ``:``; ``colors``: tag ->
    colour. The k-th isend from r to p with a tag is matched with the k-th irecv on p from r with that tag."""
    require(events, ["rank", "peer", "op", "tag", "start", "end", "seq"], "ring_messages")
    events = events.sort_values("seq")
    t0 = min(events["start"].min(), phases["start"].min() if len(phases) else np.inf)
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    ranks = sorted(set(events["rank"]))
    lane = {r: float(len(ranks) - 1 - i) for i, r in enumerate(ranks)}  # rank 0 on top
    fig = figure(1.6 + 0.6 * len(ranks))
    ax = fig.subplots()
    for _, ph in phases.iterrows():
        ax.barh(lane[ph["rank"]], ms(ph["end"]) - ms(ph["start"]), left=ms(ph["start"]), height=0.3,
                color=colors[ph["phase"].replace("_", ":")], alpha=0.25)

    def numbered(op: str) -> pd.DataFrame:
        mine = events[events["op"] == op]
        return mine.assign(k=mine.groupby(["rank", "peer", "tag"]).cumcount())

    pairs = numbered("isend").merge(numbered("irecv"), left_on=["rank", "peer", "tag", "k"],
                                    right_on=["peer", "rank", "tag", "k"], suffixes=("_send", "_recv"))
    if len(pairs) != (events["op"] == "isend").sum():
        raise ValueError("ring_messages: an isend has no matching irecv in the events given")
    for _, m in pairs.iterrows():
        ax.add_patch(FancyArrowPatch((ms(m["start_send"]), lane[m["rank_send"]]),
                                     (ms(m["end_recv"]), lane[m["rank_recv"]]), arrowstyle="-|>",
                                     mutation_scale=9, color=colors[m["tag"]], lw=1))
    handles = []
    for tag, color in colors.items():
        handles += [Line2D([], [], color=color, label=f"{tag} message (posted -> received)"),
                    Patch(facecolor=color, alpha=0.25, label=f"{tag.split(':')[-1]} pass")]
    ax.set_yticks(list(lane.values()), [f"rank {r}" for r in lane])
    ax.set_ylim(-0.5, len(ranks) - 0.5)
    ax.set(xlabel="time since the step's first shown event (ms)", title=title)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False, fontsize=8)
    return fig


def attention_work(table: pd.DataFrame, title: str = "attention work per rank, one block's forward and "
                   "backward") -> Figure:
    """One panel per balance: each rank's measured FLOPs (bars) and the formula's (black ticks).

    ``table``: rows of balance, rank, flops, formula (``experiments.cp_work.work_table``)."""
    require(table, ["balance", "rank", "flops", "formula"], "attention_work")
    balances = list(dict.fromkeys(table["balance"]))
    fig = figure(2.8)
    axes = np.atleast_1d(fig.subplots(1, len(balances), sharey=True))
    for i, (ax, balance) in enumerate(zip(axes, balances)):
        rows = table[table["balance"] == balance]
        ax.bar(rows["rank"], rows["flops"] / MB, color=TIER_PALETTE[i], width=0.6, label="measured")
        ax.scatter(rows["rank"], rows["formula"] / MB, marker="_", s=400, color="k", zorder=3, label="formula")
        ax.set(title=balance, xlabel="rank", xticks=list(rows["rank"]))
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("MFLOP (matrix products)")
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False, fontsize=8)
    return fig


def cp_bytes(measured: pd.DataFrame, formula: pd.DataFrame,
             title: str = "the attention's bytes per step and rank") -> Figure:
    """Two panels, bytes as the recorder counts them and bytes that leave the rank, against the degree: a
    line per method from the formula, measured runs as markers.

    ``measured``: rows of method, degree, counted, sent (``read.cp.bytes_table``);
    ``formula``: the same columns over more degrees (``cost.cp.bytes_formula``)."""
    require(measured, ["method", "degree", "counted", "sent"], "cp_bytes")
    require(formula, ["method", "degree", "counted", "sent"], "cp_bytes")
    fig = figure(3.0)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, column, what in zip(axes, ("counted", "sent"), ("as counted (an all-to-all: its input)",
                                                             "leaving the rank")):
        for i, method in enumerate(dict.fromkeys(formula["method"])):
            f, m = formula[formula["method"] == method], measured[measured["method"] == method]
            ax.plot(f["degree"], f[column] / MB, color=TIER_PALETTE[i], lw=1.2, label=f"{method} (formula)")
            ax.plot(m["degree"], m[column] / MB, "o", color=TIER_PALETTE[i], label=f"{method} (measured)")
        ax.set(xscale="log", xlabel="degree (ranks)", title=what)
        ax.set_xticks(sorted(set(formula["degree"])), [str(d) for d in sorted(set(formula["degree"]))])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MB per step")
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, frameon=False, fontsize=8)
    return fig


def checkpointing(table: pd.DataFrame) -> Figure:
    """Activations saved (left) and the step split into recomputation and the rest (right), a bar per run.

    ``table``: rows of run, activations_MB, step_ms, recompute_ms; a run whose name holds "check" is drawn
    lighter."""
    require(table, ["run", "activations_MB", "step_ms", "recompute_ms"], "checkpointing")
    fig = figure(2.8)
    ax_a, ax_t = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(table))
    colors = ["tab:purple" if "check" not in n else "plum" for n in table["run"]]
    ax_a.barh(y, table["activations_MB"], color=colors, height=0.6)
    ax_a.set(xlabel="activations saved for backward, rank 0 (MB)")
    rest = table["step_ms"] - table["recompute_ms"]
    ax_t.barh(y, rest, color="0.6", height=0.6, label="rest of the step")
    ax_t.barh(y, table["recompute_ms"], left=rest, color="tab:orange", height=0.6, label="recompute (in backward)")
    ax_t.set(xlabel="median step time (ms)")
    ax_a.set_yticks(y, table["run"])
    ax_a.invert_yaxis()
    for ax in (ax_a, ax_t):
        ax.grid(axis="x", alpha=0.3)
    fig.legend(*ax_t.get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False, fontsize=8)
    return fig


def activations_saved(act: pd.Series, title: str = "") -> Figure:
    """A bar per run of the bytes it saves for backward. ``act``: run label -> bytes; a label with "SP" is drawn
    as sequence parallelism, one with "tp" as tensor parallelism, the rest grey."""
    if act.empty:
        raise ValueError("activations_saved: no runs to draw")
    mb = act / 1e6
    colors = ["tab:purple" if "SP" in n else "tab:red" if "tp" in n else "0.6" for n in act.index]
    fig = figure(0.45 * len(act) + 1.0)
    ax = fig.subplots()
    ax.barh(act.index, mb, color=colors, height=0.6)
    for y, v in enumerate(mb):
        ax.text(v, y, f" {v:.2f} MB", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, mb.max() * 1.2)
    ax.set(xlabel="activations saved for backward (MB)", title=title)
    ax.grid(axis="x", alpha=0.3)
    return fig
