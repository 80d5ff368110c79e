"""What a fault cost, part by part, read from a run's events: ``elastic``'s restart and ``ft``'s rejoin.

Each function returns one row per part, as intervals in seconds since the fault
(``start_s``, ``end_s``) on a named ``lane``, so that the parts of several runs
line up on one timeline (``dtlab.plots.recovery.recovery_timeline``). The parts:

- ``elastic`` (one lane, the whole world): ``detection`` (fault to the surviving
  rank's failed collective), ``restart`` (to attempt 1's workers started: the
  agents stop every worker and meet again), ``rendezvous`` (to the new process
  group), ``snapshot load`` (to rank 0's ``resume``) and ``redone steps`` (to the
  step the fault interrupted, done again).
- ``ft``, lane ``live group`` (the group that did not fail: what the run's
  progress waits on): ``detection`` (to its step that was not committed),
  ``quorum`` (waiting for the next quorum) and ``redone steps`` (the step run
  again); lane ``restarted group``: ``detection`` (the launcher sees the
  process gone), ``restart`` (to its new manager beating), ``quorum`` (to its
  first quorum), ``state transfer`` (to the live state loaded from a peer).
  Where the run ended before that group came back (with torchft's default
  timeouts a short run can end first), ``ft_parts(..., unfinished=True)`` ends
  its lane with ``not back by the end`` (to the run's last event).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from dtlab.core.results import RunResult
from dtlab.cost.goodput import break_even_steps
from dtlab.read import elastic, ft
from dtlab.read.rounds import median, per_round, ratios

__all__ = ["NOT_BACK", "PARTS", "elastic_parts", "ft_against_elastic", "ft_parts"]

NOT_BACK = "not back by the end"
# ft_recovery's target: per fault, ft loses at most a fifth of the seconds elastic loses
FT_TARGET = 0.2
PARTS = ("detection", "restart", "rendezvous", "quorum", "snapshot load", "state transfer", "redone steps", NOT_BACK)
# the restarted ft group's parts, each ending at the first event of its kind after the previous one
_REJOIN = (("detection", "replica_failed"), ("restart", "ft_manager_ready"), ("quorum", "ft_begin"),
           ("state transfer", "ft_state_loaded"))


def _frame(result: RunResult | pd.DataFrame) -> pd.DataFrame:
    return result if isinstance(result, pd.DataFrame) else elastic.timeline(result)


def _first(df: pd.DataFrame, kind: str, after: float, **match: object) -> float:
    """The time of the first ``kind`` event at or after ``after`` whose fields match; ValueError if none."""
    rows = df[(df["kind"] == kind) & (df["t_s"] >= after)]
    for key, value in match.items():
        rows = rows[rows[key] == value]
    if rows.empty:
        raise ValueError(f"the run has no {kind!r} event after its fault ({match or 'any'}): no recovery to read")
    return float(rows["t_s"].min())


def _rows(lane: str, fault_t: float, marks: list[tuple[str, float]]) -> list[dict[str, object]]:
    """Contiguous parts: each from the previous mark (the fault first) to its own."""
    out, start = [], fault_t
    for part, end in marks:
        out.append({"lane": lane, "part": part, "start_s": start - fault_t, "end_s": end - fault_t,
                    "seconds": end - start})
        start = end
    return out


def elastic_parts(result: RunResult | pd.DataFrame, lane: str = "elastic") -> pd.DataFrame:
    """The first fault of an elastic run, part by part (see the module's docstring)."""
    df = _frame(result)
    r = elastic.restart(df)
    t0, after = r["fault_t"], r["fault_attempt"] + 1
    detected = r["victim"]["t"] if r["victim"] else r["restart_t"]
    ready = df[(df["kind"] == "process_group_ready") & (df["attempt"] == after)]
    steps = df[(df["kind"] == "step") & (df["attempt"] == after) & (df["step"] >= r["fault_step"])]
    if ready.empty or steps.empty:
        raise ValueError("the elastic run did not reach its fault's step again after the restart")
    return pd.DataFrame(_rows(lane, t0, [("detection", detected), ("restart", r["restart_t"]),
                                         ("rendezvous", float(ready["t_s"].max())),
                                         ("snapshot load", r["resume_t"]),
                                         ("redone steps", float(steps["t_s"].min()))]))


def ft_parts(result: RunResult | pd.DataFrame, label: str = "ft", unfinished: bool = False) -> pd.DataFrame:
    """The first fault of an ft run, part by part, on lanes ``{label}: live group`` and ``{label}: restarted
    group`` (see the module's docstring). ValueError if the killed group did not come back, unless
    ``unfinished``: then its lane ends with ``NOT_BACK``, to the run's last event."""
    df = _frame(result)
    fault = ft.recovery(df)[0]
    t0, dead = fault["fault_t"], fault["replica"]
    steps = ft.step_log(df)
    live = steps[(steps["replica"] != dead) & (steps["t_s"] >= t0)]
    failed = live[~live["committed"]]
    detected = float(failed["t_s"].min()) if len(failed) else t0
    committed = live[live["committed"] & (live["step"] >= fault["fault_step"])]
    if committed.empty:
        raise ValueError("the live replica group committed no step after the fault")
    done = float(committed["t_s"].min())
    ordinary = float(steps[steps["committed"]].groupby(["replica", "attempt"])["t_s"].diff().median())
    rows = _rows(f"{label}: live group", t0, [("detection", detected), ("quorum", max(detected, done - ordinary)),
                                               ("redone steps", done)])
    marks, after = [], t0
    for part, kind in _REJOIN:
        try:
            after = _first(df, kind, after, replica=dead)
        except ValueError:
            if not unfinished:
                raise
            marks.append((NOT_BACK, float(df["t_s"].max())))
            break
        marks.append((part, after))
    return pd.DataFrame(rows + _rows(f"{label}: restarted group", t0, marks))


def ft_against_elastic(rows: Iterable[Mapping[str, Any]], settings: Iterable[str] = ("torchft", "tuned")
                       ) -> dict[str, Any]:
    """What ``benchmarks/ft_recovery.py`` reports, read from its rows (one per round and variant: ``elastic``,
    ``ft_<setting>``, each also ``_killed``, and ``ddp``; with ``lost_s``, ``span_step_s``, ``step_s``,
    ``redone_steps``, ``samples_lost``): medians over the measured rounds and each round's ratios.

    Per setting: ``ratios`` (``ft``'s time lost per fault over ``elastic``'s, per round), ``lost_s``,
    ``redone_steps``, ``samples_lost`` and ``break_even_steps`` (on the training spans per step). Without
    faults: ``span_ratios`` (``ft`` tuned over ``elastic``, per step of the span, elastic's snapshots
    included) and ``step_ratios`` (``ft`` tuned over ``ddp`` and over ``elastic``, the steps alone).
    """
    rows = [dict(r) for r in rows]

    def med(variant: str, key: str) -> float:
        return median(per_round(rows, variant, key).values())

    lost_e, span_e = med("elastic_killed", "lost_s"), med("elastic", "span_step_s")
    out: dict[str, Any] = {"rounds": len({r["round"] for r in rows if r["round"] >= 0}),
                           "elastic": {"lost_s": lost_e, "redone_steps": med("elastic_killed", "redone_steps"),
                                       "span_step_s": span_e, "step_s": med("elastic", "step_s")},
                           "ddp": {"step_s": med("ddp", "step_s")}}
    for setting in settings:
        v = f"ft_{setting}"
        lost_f = med(f"{v}_killed", "lost_s")
        out[setting] = {"ratios": ratios(rows, f"{v}_killed", "elastic_killed", "lost_s"), "lost_s": lost_f,
                        "redone_steps": med(f"{v}_killed", "redone_steps"),
                        "samples_lost": med(f"{v}_killed", "samples_lost"),
                        "span_step_s": med(v, "span_step_s"), "step_s": med(v, "step_s"),
                        "break_even_steps": break_even_steps(med(v, "span_step_s") - span_e,
                                                             max(lost_e, 0.0) - max(lost_f, 0.0))}
    out["span_ratios"] = ratios(rows, "ft_tuned", "elastic", "span_step_s")
    out["step_ratios"] = {base: ratios(rows, "ft_tuned", base, "step_s") for base in ("ddp", "elastic")}
    return out
