"""Reading an elastic run: its events (starts, restarts, snapshots, faults, joins) as a timeline.

From the timeline: what a fault cost (``restart``), how an out-of-memory
restart changed the batching (``batching``), how a join changed the world
(``membership``), and how two runs' parameters compare (``agreement``).
"""

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


AGREEMENT = ("bitwise identical", "equal up to float rounding", "different")


def _frame(result: RunResult | pd.DataFrame | list[dict[str, Any]]) -> pd.DataFrame:
    return result if isinstance(result, pd.DataFrame) else timeline(result)


def snapshot_steps(result: RunResult | list[dict[str, Any]]) -> list[int]:
    """The steps after which a snapshot was saved, in order."""
    events = result.run_events if isinstance(result, RunResult) else result
    return [int(e["step"]) for e in events if e["kind"] == "snapshot"]


def _gloo_message(message: Any) -> str:
    """The gist of a failed collective's error: its first line, without the source location, first sentence."""
    return str(message).splitlines()[0].split("] ", 1)[-1].split(". ")[0]


def restart(result: RunResult | pd.DataFrame | list[dict[str, Any]]) -> dict[str, Any]:
    """A fault and the restart after it, read from the run's timeline (``timeline``'s frame or the run itself).

    Times are ``t_s`` (seconds since the run's first event). Keys:
    ``fault_t``, ``fault_rank``, ``fault_step``, ``fault_attempt`` (the first
    injected fault); ``victim`` (None, or a dict ``t``, ``rank``,
    ``error_type``, ``message``: the first other rank to fail, and the gist of
    its error); ``restart_t`` and ``restarted_workers`` (attempt 1's workers);
    ``resume_t`` and ``resume_step`` (rank 0 loading the snapshot);
    ``first_step_t`` (the first step of attempt 1 done); ``cost_s`` (fault to
    that step) and ``recomputed_steps`` (steps done since the last snapshot,
    computed again: ``fault_step - resume_step``).
    """
    df = _frame(result)
    faults = df[df["kind"] == "fault"]
    if faults.empty:
        raise ValueError("the run has no fault event: nothing was restarted")
    fault = faults.iloc[0]
    victims = df[(df["kind"] == "worker_error") & (df["rank"] != fault["rank"])]
    restarted = df[(df["kind"] == "worker_start") & (df["attempt"] == fault["attempt"] + 1)]
    resume = df[(df["kind"] == "resume") & (df["rank"] == 0)].iloc[0]
    steps_after = df[(df["kind"] == "step") & (df["attempt"] == fault["attempt"] + 1)]
    victim = None
    if len(victims):
        v = victims.iloc[0]
        victim = {"t": float(v["t_s"]), "rank": int(v["rank"]), "error_type": str(v["error_type"]),
                  "message": _gloo_message(v["message"])}
    first_step_t = float(steps_after["t_s"].iloc[0])
    return {"fault_t": float(fault["t_s"]), "fault_rank": int(fault["rank"]), "fault_step": int(fault["step"]),
            "fault_attempt": int(fault["attempt"]), "victim": victim,
            "restart_t": float(restarted["t_s"].min()), "restarted_workers": len(restarted),
            "resume_t": float(resume["t_s"]), "resume_step": int(resume["step"]), "first_step_t": first_step_t,
            "cost_s": first_step_t - float(fault["t_s"]), "recomputed_steps": int(fault["step"]) - int(resume["step"])}


def batching(result: RunResult) -> dict[str, dict[str, int]]:
    """Rank 0's batching before and after the first restart (``"before"``: its ``begin`` event, ``"after"``: its
    first ``resume``), each ``attempt``, ``step``, ``per_rank_batch``, ``accumulation_steps``, ``micro_batch``
    (per_rank_batch / accumulation_steps) and ``global_batch`` (per_rank_batch x the run's world size)."""
    out = {}
    for name, kind in (("before", "begin"), ("after", "resume")):
        found = [e for e in result.run_events if e["kind"] == kind and e["rank"] == 0]
        if not found:
            raise ValueError(f"the run has no {kind!r} event on rank 0")
        e = found[0]
        out[name] = {"attempt": int(e["attempt"]), "step": int(e["step"]), "per_rank_batch": int(e["per_rank_batch"]),
                     "accumulation_steps": int(e["accumulation_steps"]),
                     "micro_batch": int(e["per_rank_batch"]) // int(e["accumulation_steps"]),
                     "global_batch": int(e["per_rank_batch"]) * int(result.config.world_size)}
    return out


def membership(result: RunResult | pd.DataFrame | list[dict[str, Any]]) -> dict[str, Any]:
    """How the world changed size, from the timeline (``timeline``'s frame or the run itself).

    ``world_sizes``: the distinct world sizes in the order workers started with
    them; ``steps_per_world``: ``{world size: steps done at it}``;
    ``last_agent_t``: when the last agent started (the joining node);
    ``largest_world_delay_s``: from then until the first worker of the largest
    world started; ``attempts``: the restart counts the workers saw;
    ``resume_step``: the step rank 0 first resumed from (None if it never did).
    """
    df = _frame(result)
    starts = df[df["kind"] == "worker_start"].sort_values("t_s", kind="stable")
    steps = df[df["kind"] == "step"].groupby("world_size")["step"].count()
    last_agent_t = float(df[df["kind"] == "node_start"]["t_s"].iloc[-1])
    largest = starts["world_size"].max()
    resumed = df[(df["kind"] == "resume") & (df["rank"] == 0)]
    return {"world_sizes": [int(w) for w in dict.fromkeys(starts["world_size"])],
            "steps_per_world": {int(w): int(n) for w, n in steps.items()},
            "last_agent_t": last_agent_t,
            "largest_world_delay_s": float(starts[starts["world_size"] == largest]["t_s"].min()) - last_agent_t,
            "attempts": sorted(int(a) for a in starts["attempt"].unique()),
            "resume_step": int(resumed["step"].iloc[0]) if len(resumed) else None}


def agreement(max_param_diff: float, rounding: float = 1e-5) -> str:
    """How two runs' parameters compare, as one of ``AGREEMENT``: identical bits, within ``rounding``, or not."""
    if max_param_diff == 0.0:
        return AGREEMENT[0]
    return AGREEMENT[1] if max_param_diff <= rounding else AGREEMENT[2]
