"""Reading a run of replica groups (``ft``, ``diloco``): who took part in each step, who missed what, recovery.

The run's events (``RunResult.run_events``) hold the launcher's view -- each
replica group's starts, failures and restarts, the lighthouse -- and what each
group's rank 0 reported: ``ft_begin`` (its first quorum: healing or not),
``ft_step`` (every step it ran: committed or not, with how many groups, healing
or not), ``diloco_sync`` (every synchronisation) and ``fault``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from dtlab.core.results import RunResult
from dtlab.read.elastic import timeline

__all__ = ["loss_by_time", "missed_steps", "participants", "recovery", "report", "step_log", "sync_log",
           "timeline"]


def _kind(result: RunResult | pd.DataFrame, kind: str) -> pd.DataFrame:
    df = result if isinstance(result, pd.DataFrame) else timeline(result)
    if df.empty or "kind" not in df:
        return pd.DataFrame()
    return df[df["kind"] == kind].reset_index(drop=True)


def step_log(result: RunResult | pd.DataFrame) -> pd.DataFrame:
    """Every step every replica group ran: t_s, replica, attempt, step, committed, participants, healing."""
    df = _kind(result, "ft_step")
    if df.empty:
        raise ValueError("the run has no ft_step events: it is not an ft run")
    cols = ["t_s", "replica", "attempt", "step", "committed", "participants", "healing", "quorum_id"]
    return df[cols].astype({"replica": int, "attempt": int, "step": int, "committed": bool, "healing": bool})


def sync_log(result: RunResult | pd.DataFrame) -> pd.DataFrame:
    """Every DiLoCo synchronisation of every replica group: t_s, replica, attempt, step, participants, healed_to."""
    df = _kind(result, "diloco_sync")
    if df.empty:
        raise ValueError("the run has no diloco_sync events: it is not a diloco run")
    df = df[["t_s", "replica", "attempt", "step", "syncs_committed", "participants", "healed_to"]]
    return df.astype({c: int for c in ("replica", "attempt", "step", "syncs_committed", "participants")})


def participants(result: RunResult | pd.DataFrame) -> pd.Series:
    """Per committed step: how many replica groups' gradients were averaged in it."""
    steps = step_log(result)
    done = steps[steps["committed"]]
    return done.groupby("step")["participants"].max().astype(int).rename("participants")


def missed_steps(result: RunResult | pd.DataFrame, replicas: int | None = None) -> dict[int, list[int]]:
    """Per replica group: the committed steps it put no gradient into (it was down, or healing)."""
    steps = step_log(result)
    done = steps[steps["committed"]]
    every = sorted(done["step"].unique())
    groups = range(replicas) if replicas is not None else sorted(steps["replica"].unique())
    out = {}
    for r in groups:
        mine = set(done[(done["replica"] == r) & ~done["healing"]]["step"])
        out[int(r)] = [int(s) for s in every if s not in mine]
    return out


def recovery(result: RunResult | pd.DataFrame) -> list[dict[str, Any]]:
    """One dict per fault: what it cost the group that failed and the groups that did not.

    Keys: ``replica``, ``fault_step``, ``fault_t``; ``restart_t`` (the launcher started the group again),
    ``rejoin_t`` and ``rejoin_step`` (its first quorum: it received the live state for that step),
    ``recovered_t`` (its first committed step with its own gradient in it again) and ``recovery_s``
    (fault to then); for the others ``redone_steps`` (steps they ran again, uncommitted) and
    ``others_lost_s`` (fault to their next committed step, minus one ordinary step).
    """
    df = result if isinstance(result, pd.DataFrame) else timeline(result)
    steps, out = step_log(df), []
    ordinary = float(steps[steps["committed"]].groupby(["replica", "attempt"])["t_s"].diff().median())
    for _, fault in _kind(df, "fault").iterrows():
        r, t = int(fault["replica"]), float(fault["t_s"])
        later = lambda frame, t=t: frame[frame["t_s"] >= t]  # noqa: E731 - a filter read once per fault
        restart = later(_kind(df, "replica_start"))
        restart = restart[restart["replica"] == r]
        begin = later(_kind(df, "ft_begin"))
        begin = begin[begin["replica"] == r]
        mine = later(steps)
        mine = mine[(mine["replica"] == r) & mine["committed"] & ~mine["healing"]]
        others = later(steps)
        others = others[others["replica"] != r]
        # a step of theirs that ended just after the fault, but began before it, cost them nothing
        next_commit = others[others["committed"] & (others["step"] >= int(fault["step"]))]["t_s"].min()
        recovered = float(mine["t_s"].min()) if len(mine) else float("nan")
        out.append({"replica": r, "fault_step": int(fault["step"]), "fault_t": t,
                    "restart_t": float(restart["t_s"].min()) if len(restart) else float("nan"),
                    "rejoin_t": float(begin["t_s"].min()) if len(begin) else float("nan"),
                    "rejoin_step": int(begin["step"].iloc[0]) if len(begin) else None,
                    "recovered_t": recovered, "recovery_s": recovered - t,
                    "redone_steps": int((~others["committed"]).sum()),
                    "others_lost_s": max(0.0, float(next_commit) - t - ordinary)})
    return out


def loss_by_time(result: RunResult) -> pd.DataFrame:
    """step, time_s (training time to the end of that step: the slowest rank's step times added up) and the
    global training loss: any run, so that DDP and DiLoCo compare on one axis of time."""
    loss = result.loss_curve()
    seconds = result.steps_frame().groupby("step")["total"].max()
    frame = pd.DataFrame({"loss": loss, "time_s": seconds.cumsum()}).reset_index()
    return frame[["step", "time_s", "loss"]]


def report(result: RunResult, replicas: int | None = None) -> dict[str, Any]:
    """The run in a few numbers: participants per step, missed steps, recovery, and whether the groups agree."""
    strategy = result.ranks[0].strategy
    n = replicas or result.config.tier_options.replicas
    return {"participants": participants(result).to_dict(), "missed_steps": missed_steps(result, n),
            "recovery": recovery(result), "replicas_finished": strategy.get("replicas_finished"),
            "replicas_max_param_diff": strategy.get("replicas_max_param_diff"),
            "replicas_equal": strategy.get("replicas_max_param_diff") == 0.0}
