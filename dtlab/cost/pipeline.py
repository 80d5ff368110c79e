"""A pipeline's bubble before it runs: the closed forms, and a simulator that lays out any schedule's actions.

``ideal_bubble`` is the published formula where one exists; ``simulate`` lays out a schedule's own action order
(``dtlab.tiers.parts.pipeline_stages``) on equal stage times with free transfers, and ``simulated_bubble`` reads its
idle share. ``dtlab.read.pipeline`` measures the same share on a run.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from dtlab.tiers.parts.pipeline_stages import LOOPED, V_SHAPED, placement, rank_actions

__all__ = ["KINDS", "UNIT_TIMES", "ideal_bubble", "idle_share", "simulate", "simulated_bubble"]


KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
UNIT_TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward = its input part + its weight part = 2 forwards


def ideal_bubble(schedule: str, stages: int, microbatches: int, per_rank: int = 1) -> float:
    """The idle share of each rank with equal stage times and free communication, where a formula gives it:
    (p-1)/(M+p-1) for GPipe and 1F1B over p ranks (``stages``), (p-1)/p when micro-batches go one at a time,
    and for interleaving (M >= p) the bubble divided by v (``per_rank``, stages per rank):
    (p-1)/v / (M + (p-1)/v). The zero-bubble schedules have no closed form here: ``simulated_bubble`` lays out
    their actions."""
    p, m = stages, microbatches
    if schedule == "naive":
        return (p - 1) / p
    if schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise ValueError(f"ideal_bubble: no formula for schedule {schedule!r}: use simulated_bubble")
    v = per_rank if schedule == "interleaved-1f1b" else 1
    if v > 1 and m < p:  # Megatron's formula assumes every rank has a micro-batch to start each round with
        raise ValueError(f"ideal_bubble: the interleaved formula needs M >= p (M={m}, p={p}): use simulated_bubble")
    return (p - 1) / v / (m + (p - 1) / v)


def simulate(schedule: str, world: int, microbatches: int, per_rank: int = 0,
             times: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Each rank's actions in its schedule's order, started as soon as the rank is free and their inputs are
    ready (a forward: the previous stage's forward; a backward or its input part: the next stage's; a weight
    part: its own input part), with equal stages, free transfers and ``times`` per action (default: F = I =
    W = 1, B = 2). Columns: rank, lane, stage, hold, phase, microbatch, start, end (``plots.pipeline_schedule``
    draws it with ``seconds=False``)."""
    per = per_rank or (2 if schedule in (*LOOPED, *V_SHAPED) else 1)  # 0: the schedule's own
    cost = {**UNIT_TIMES, **(times or {})}
    queues = {r: list(acts) for r, acts in rank_actions(schedule, world, microbatches, per).items()}
    holds = {s: k for held in placement(schedule, world, per) for k, s in enumerate(held)}
    last, done, free, rows = world * per - 1, {}, dict.fromkeys(queues, 0.0), []
    while any(queues.values()):
        moved = False
        for rank, queue in queues.items():
            while queue and all(d in done for d in _needs(queue[0], last, schedule)):
                stage, kind, mb = queue.pop(0)
                start = max([free[rank], *(done[d] for d in _needs((stage, kind, mb), last, schedule))])
                free[rank] = done[(stage, "I" if kind == "B" else kind, mb)] = start + cost[kind]
                rows.append({"rank": rank, "lane": f"rank {rank}", "stage": stage, "hold": holds[stage],
                             "phase": KINDS[kind], "microbatch": mb, "start": start, "end": free[rank]})
                moved = True
        if not moved:
            raise ValueError(f"simulate: {schedule} with {world} ranks and {microbatches} micro-batches deadlocks")
    return pd.DataFrame(rows)


def _needs(action: tuple[int, str, int], last: int, schedule: str) -> list[tuple[int, str, int]]:
    """What an action waits for; a full backward's end is stored as its input part's (``I``), what a
    previous stage needs from it."""
    stage, kind, mb = action
    if kind == "F":
        follows = [(0, "I", mb - 1)] if schedule == "naive" and stage == 0 and mb else []  # one at a time
        return ([(stage - 1, "F", mb)] if stage else []) + follows
    if kind == "W":
        return [(stage, "I", mb)]
    return [(stage, "F", mb)] + ([(stage + 1, "I", mb)] if stage < last else [])


def simulated_bubble(schedule: str, world: int, microbatches: int, per_rank: int = 0,
                     times: Mapping[str, float] | None = None) -> float:
    """The idle share of the ranks (mean) in ``simulate``'s layout: the schedule's own bubble."""
    return float(idle_share(simulate(schedule, world, microbatches, per_rank, times)).mean())


def idle_share(frame: pd.DataFrame) -> pd.Series:
    span = frame["end"].max() - frame["start"].min()
    return 1 - (frame["end"] - frame["start"]).groupby(frame["rank"]).sum() / span
