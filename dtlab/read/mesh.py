"""A rank's traffic by mesh axis: which of its collectives served the pipeline, data parallelism or TP.

On a mesh (``fsdp-tp``'s dp x tp, ``nd``'s pp x dp x tp) every collective of a rank runs in one of its
groups: point-to-point sends and receives between pipeline stages (the ``pp`` axis), FSDP2's gathers and
reductions of parameters and gradients along its ``dp`` column (tagged ``fsdp:...``), and TP's exchanges of
activations along its ``tp`` row (everything else).
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from dtlab.core.results import RunResult

__all__ = ["AXES", "axis_of", "traffic_by_axis"]

AXES = {"pp": "pp (pipeline: activations and their gradients)",
        "dp": "dp column (FSDP2: parameters, gradients)",
        "tp": "tp row (TP: activations)"}


def axis_of(op: str, tag: str) -> str:
    """The mesh axis (``pp``, ``dp`` or ``tp``) a recorded call of ``op`` with ``tag`` served."""
    if op in ("isend", "irecv", "send", "recv"):
        return "pp"
    return "dp" if str(tag).startswith("fsdp:") else "tp"


def traffic_by_axis(result: RunResult, rank: int = 0, steps: Iterable[int] | None = None) -> pd.DataFrame:
    """Calls and kB per step of one rank, indexed by (axis, op), over ``steps`` (default: every training step;
    give the steady ones where the first step also exchanges shapes, as a pipeline's does)."""
    chosen = list(range(result.config.steps)) if steps is None else list(steps)
    if not chosen:
        raise ValueError("traffic_by_axis: no steps given")
    ev = result.events_frame()
    ev = ev[(ev["rank"] == rank) & ev["step"].isin(chosen)]
    axis = [AXES[axis_of(op, tag)] for op, tag in zip(ev["op"], ev["tag"])]
    table = ev.assign(axis=axis).groupby(["axis", "op"]).agg(calls=("bytes", "size"), kB=("bytes", "sum"))
    return table.assign(calls=table["calls"] / len(chosen), kB=table["kB"] / len(chosen) / 1e3)
