"""Reading an FSDP run: how much of each collective the training thread waited for."""

from __future__ import annotations

from typing import Any


def comm_exposure(result: Any) -> Any:
    """Per (rank, step, op): seconds in the collective and how much of it the training thread waited.

    A synchronous collective blocks the thread for its whole duration; an async one only
    for its ``wait_s``. ``hidden_s`` is the rest: time it ran while the thread computed.
    """
    df = result.events_frame()
    df = df[(df["step"] >= 0) & (df["step"] < result.config.steps)].copy()  # the training steps
    df["blocked_s"] = df["duration_s"].where(~df["async"].astype(bool), df["wait_s"])
    df["hidden_s"] = (df["duration_s"] - df["blocked_s"]).clip(lower=0)
    return df.groupby(["rank", "step", "op"])[["duration_s", "blocked_s", "hidden_s"]].sum().reset_index()
