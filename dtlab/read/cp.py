"""Reading a context-parallel run: the attention's communication per step and rank, set beside the formula's
(``dtlab.cost.cp.attention_bytes``).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from dtlab.core.results import RunResult
from dtlab.cost.cp import attention_bytes
from dtlab.tiers.parts.cp_layout import BACKWARD_TAG, FORWARD_TAG

__all__ = ["bytes_table", "recorded_bytes"]


def _sent(row: Any) -> float:
    """What leaves the rank: an isend all of it, an all-to-all all but its own split."""
    splits = row.get("input_splits")  # absent from a run without all-to-alls
    if row["op"] != "all_to_all_single" or not isinstance(splits, list | tuple) or not sum(splits):
        return float(row["bytes"])
    return row["bytes"] * (sum(splits) - splits[int(row["rank"])]) / sum(splits)


def recorded_bytes(result: RunResult) -> pd.DataFrame:
    """Per rank: the attention's communication per training step in a cp run (the calls tagged by its
    forward and backward passes: isends, or all-to-alls), counted and sent, from the recorded events."""
    steps = result.config.steps
    ev = result.events_frame()
    ev = ev[(ev["step"] >= 0) & (ev["step"] < steps) & ev["tag"].isin([FORWARD_TAG, BACKWARD_TAG])
            & ev["op"].isin(["isend", "all_to_all_single"])]
    ev = ev.assign(sent=ev.apply(_sent, axis=1) if len(ev) else 0.0)
    table = ev.groupby("rank").agg(counted=("bytes", "sum"), sent=("sent", "sum"), calls=("op", "size")) / steps
    return table.reindex(range(result.config.world_size), fill_value=0.0)


def bytes_table(results: list[RunResult]) -> pd.DataFrame:
    """One row per cp run: method, degree, the busiest rank's recorded bytes per step and the formula's."""
    rows = []
    for r in results:
        cfg, recorded = r.config, recorded_bytes(r)
        want = attention_bytes(cfg.tier_options.method, cfg.world_size, cfg.global_batch_size, cfg.model_size,
                               cfg.model_depth)
        rows.append({"method": cfg.tier_options.method, "degree": cfg.world_size,
                     "counted": recorded["counted"].max(), "counted_formula": want["counted"],
                     "sent": recorded["sent"].max(), "sent_formula": want["sent"]})
    return pd.DataFrame(rows)
