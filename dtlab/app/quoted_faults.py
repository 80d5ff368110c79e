"""Texts ``docs/measurement.md`` quotes on faults and slow links (``dtlab.app.quoted`` registers them in
``QUOTES``): one SIGKILL's parts under ``ft`` and ``elastic``, and what DiLoCo's sweep tuned.

Each function reads a result under ``docs/figures/`` beneath the checkout's root it is given and returns the
text between a page's markers (``dtlab.app.quotes``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dtlab.app.quoted_docs import FIGURES
from dtlab.core.ft import TIMEOUTS

FT_RECOVERY = FIGURES / "ft_recovery.csv"
FT_PARTS = FIGURES / "ft_recovery_parts.csv"
DILOCO_SWEEP = FIGURES / "diloco_link_sweep.csv"
DILOCO_RUNS = FIGURES / "diloco_link.csv"
NEAR_BEST = 0.001  # a held-out loss this close to the chosen one's is named beside it

__all__ = ["FAULTS"]


def _parts(root: Path) -> pd.DataFrame:
    """One SIGKILL's parts, medians over the rounds: (lane, part) -> start_s, end_s, seconds."""
    return pd.read_csv(root / FT_PARTS).set_index(["lane", "part"])


def ft_quorum_wait(root: Path) -> str:
    """The live group's wait for a quorum without the dead one, against the lighthouse's heartbeat timeout; the
    restarted group's manager's start and its state transfer."""
    parts = _parts(root)
    lanes = {name: f"ft ({name} timeouts)" for name in ("torchft", "tuned")}
    waits = ", ".join(f"{parts.loc[(f'{lane}: live group', 'quorum'), 'seconds']:.2f} s against "
                      f"{TIMEOUTS[name].heartbeat_timeout_ms / 1000:g} s" for name, lane in lanes.items())
    up = [parts.loc[(f"{lane}: restarted group", "restart"), "end_s"] for lane in lanes.values()]
    transfer = max(parts.loc[(f"{lane}: restarted group", "state transfer"), "seconds"] for lane in lanes.values())
    return (f"lighthouse's heartbeat timeout: {waits}. The restarted group's new manager is up {up[0]:.2f} s "
            f"(torchft's) or {up[1]:.2f} s (tuned) after the fault, yet its first quorum comes at the same moment as "
            f"the live group's; receiving the live state from the peer takes {1e3 * transfer:.0f} ms")


def ft_elastic_parts(root: Path) -> str:
    """``elastic``'s parts of one SIGKILL, their sum, and the median of its whole loss over the rounds."""
    parts = _parts(root).loc["elastic", "seconds"]
    rounds = pd.read_csv(root / FT_RECOVERY)
    killed = rounds[(rounds["variant"] == "elastic_killed") & (rounds["round"] >= 0)]  # round -1: the warm-up
    lost, redone = killed["lost_s"], killed["redone_steps"].median()
    return (f"the surviving rank's all-reduce fails within {1e3 * parts['detection']:.0f} ms, the agents stop every "
            f"worker and meet again ({parts['restart']:.2f} s), the new process group forms "
            f"({parts['rendezvous']:.2f} s), the snapshot loads ({parts['snapshot load']:.2f} s) and the "
            f"{redone:.0f} steps since it run again ({parts['redone steps']:.2f} s); the medians of its parts add up "
            f"to {parts.sum():.2f} s, the median of its whole loss is {lost.median():.2f} s")


def _grid(values: pd.Series) -> str:
    return ", ".join(f"{v:g}" for v in sorted(values.dropna().unique()))


def _chosen(runs: pd.DataFrame, column: str) -> str:
    """The chosen run's value of ``column``, and whether the grid's edge held it."""
    value, grid = runs.loc[runs["chosen"], column].iloc[0], runs[column]
    return f"{value:g}" + (", the grid's edge" if value in (grid.min(), grid.max()) else "")


def diloco_sweep(root: Path) -> str:
    """What the sweep tuned, over which grids, and what it chose (the lowest final held-out loss)."""
    sweep = pd.read_csv(root / DILOCO_SWEEP)
    ddp, h20 = sweep[sweep["h"] == 0], sweep[sweep["h"] == 20]
    best = h20.loc[h20["chosen"]].iloc[0]
    near = h20[~h20["chosen"] & (h20["heldout_final"] - best["heldout_final"]).abs().le(NEAR_BEST)]
    near_text = "".join(f"; {r.lr:g} and {r.outer_lr:g} came within {NEAR_BEST:g}" for r in near.itertuples())
    inner = "" if _chosen(ddp, "lr").endswith("edge") else ", an inner point"
    parts = [_chosen(sweep[sweep["h"] == h], "outer_lr") for h in sorted(set(sweep["h"]) - {0, 20})]
    others = (", and " if any("," in p for p in parts) else " and ").join(parts)
    return (f"DDP's learning rate over {_grid(ddp['lr'])} (chosen {_chosen(ddp, 'lr')}{inner}); DiLoCo H = 20's "
            f"inner learning rate over the same ones and its outer learning rate over "
            f"{_grid(h20['outer_lr'])} (chosen {best['lr']:g} and {best['outer_lr']:g}{near_text}); then the outer "
            f"rate of H = {' and H = '.join(str(h) for h in sorted(set(sweep['h']) - {0, 20}))} at that inner rate "
            f"(chosen {others})")


def diloco_load(root: Path) -> str:
    """The machine's load average over the main run and over the sweep, before and after each run."""
    def span(path: Path) -> str:
        loads = pd.read_csv(root / path)[["loadavg_before", "loadavg_after"]].to_numpy()
        return f"{loads.min():.1f}–{loads.max():.1f}"
    return f"load average {span(DILOCO_RUNS)} over the main run, {span(DILOCO_SWEEP)} over the sweep"


FAULTS: dict[str, Callable[[Path], str]] = {
    "diloco-load": diloco_load,
    "diloco-sweep": diloco_sweep,
    "ft-elastic-parts": ft_elastic_parts,
    "ft-quorum-wait": ft_quorum_wait,
}
