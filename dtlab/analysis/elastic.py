"""Reading an elastic run: its events (starts, restarts, snapshots, faults, joins) as a timeline."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dtlab.core.results import RunResult


def timeline(result: RunResult | list[dict[str, Any]]) -> Any:
    """The run's events as a DataFrame: t_s (since the first), kind, rank, node, attempt, world_size, step."""
    events = result.run_events if isinstance(result, RunResult) else result
    df = pd.DataFrame(events)
    if df.empty:
        return df
    df["t_s"] = df["time"] - df["time"].min()
    first = ["t_s", "kind", "rank", "node", "attempt", "world_size", "step"]
    return df[[c for c in first if c in df] + [c for c in df if c not in first and c != "time"]]
