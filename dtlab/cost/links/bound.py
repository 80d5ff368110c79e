"""The link a sweep gives when no line fits it: each coefficient bounded by one message size.

A sweep taken while other work shares the machine can leave the per-byte cost of a fit negative (a stalled
small message takes longer than a large one). Rather than fail, the calibration then bounds each coefficient
from above: alpha as if the smallest message's whole time were latency, beta as if the largest message's whole
time were bytes. Both are positive whatever the load, and the link says that it is a bound, not a fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from dtlab.cost.links.alpha_beta import LinkModel, check_op, coefficients
from dtlab.cost.links.linkset import LinkSet
from dtlab.cost.links.sweep import size_medians

__all__ = ["BOUND_NOTE", "bounding_link", "bounding_links"]

BOUND_NOTE = "bounded, not fitted: alpha from the smallest message's time, beta from the largest's"


def bounding_link(sweep_df: pd.DataFrame, op: str = "all_reduce", *, backend: str = "gloo",
                  label: str = "") -> LinkModel:
    """A ``LinkModel`` for ``op`` from the per-size medians of ``sweep_df`` (per repeat or per point): alpha the
    smallest size's time over its latency coefficient, beta the largest's over its byte coefficient."""
    check_op(op)
    rows = sweep_df[sweep_df["op"] == op]
    if "repeat" in rows.columns:
        rows = size_medians(rows)
    rows = rows[rows["group_size"] > 1].sort_values("bytes")
    if rows.empty:
        raise ValueError(f"bounding_link: the sweep has no {op} on more than one rank")
    n = int(rows["group_size"].max())
    a, b = coefficients(op, n, backend)
    small, large = rows.iloc[0], rows.iloc[-1]
    beta = float(large["seconds"]) / (b * float(large["bytes"]))
    return LinkModel(alpha_s=float(small["seconds"]) / a, beta_s_per_byte=beta, backend=backend, world_size=n,
                     label=f"{label or f'{backend} {op} at n={n}'} ({BOUND_NOTE})", ops=(op,), points=len(rows))


def bounding_links(sweep_df: pd.DataFrame, ops: Sequence[str], *, default: str = "all_reduce",
                   label: str = "") -> LinkSet:
    """``bounding_link`` for each of ``ops``, as ``calibrate_ops`` lays them out."""
    links = {op: bounding_link(sweep_df, op, label=f"{label} ({op})" if label else "") for op in ops}
    return LinkSet(links, links[default])
