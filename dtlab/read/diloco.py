"""DiLoCo against DDP, like for like: the held-out loss of the model a user would keep, against training samples
and training time, and each run's time to first reach one held-out target.

A *curve* is a DataFrame with the columns ``step`` (steps done), ``samples`` (global training samples consumed,
every group's counted), ``time_s`` (training time to that point: the slowest rank's step times added up, as
``dtlab.read.ft.loss_by_time``) and ``heldout_loss`` (mean loss on the job's held-out split).

* DiLoCo (``diloco_curve``): the model each group holds right after each synchronisation, which the tier
  evaluates with ``evaluate_syncs=True`` (the synchronised outer model when ``fragments`` = 1).
* DDP (``ddp_curve``): the same data-parallel job replayed in this process (each step's global batch: the ranks'
  shards in rank order, one mean gradient, the job's optimizer), evaluated after the requested steps. The replay
  is checked against the run: ``replay_gap`` is its final held-out loss minus the run's own final evaluation,
  and ``consistency_problems`` refuses a gap over ``REPLAY_TOLERANCE``.

``first_reach`` is the training time of the first evaluated point at or below the target, not interpolated
between evaluations by default (a run only knows it reached a loss when it evaluates); NaN means "not reached".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from dtlab.core import data as datasets
from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job, make_optimizer
from dtlab.core.results import RunResult
from dtlab.read.ft import loss_by_time
from dtlab.read.rounds import median

__all__ = ["CURVE_COLUMNS", "REPLAY_TOLERANCE", "consistency_problems", "ddp_curve", "diloco_curve", "first_reach",
           "reached_text", "replay_heldout", "time_ratio", "verdict"]

CURVE_COLUMNS = ("step", "samples", "time_s", "heldout_loss")
# diloco_link's target: DiLoCo reaches the held-out target in at most this share of DDP's time, every seed
BOUND = 0.5
REPLAY_TOLERANCE = 0.01  # |replayed - run's own final held-out loss|: float32 rounding stays far below this


def _timeline(result: RunResult) -> pd.DataFrame:
    """Per step: steps done, cumulative global samples and cumulative training time."""
    steps = result.steps_frame()
    samples = steps.groupby("step")["samples"].sum().cumsum()
    frame = loss_by_time(result).set_index("step")
    return pd.DataFrame({"step": frame.index + 1, "samples": samples.reindex(frame.index).to_numpy(),
                         "time_s": frame["time_s"].to_numpy()}, index=frame.index)


def diloco_curve(result: RunResult) -> pd.DataFrame:
    """The held-out loss recorded at each synchronisation of a ``diloco`` run made with ``evaluate_syncs=True``."""
    syncs = result.ranks[0].strategy.get("syncs", [])
    if not syncs or any("heldout_loss" not in s for s in syncs):
        raise ValueError("this diloco run recorded no held-out loss at its synchronisations: run it with "
                         "tier_options evaluate_syncs=True")
    line = _timeline(result)
    rows = [{**line.loc[s["step"]].to_dict(), "heldout_loss": float(s["heldout_loss"])} for s in syncs]
    return pd.DataFrame(rows, columns=list(CURVE_COLUMNS)).astype({"step": int, "samples": int})


def replay_heldout(cfg: RunConfig, at_steps: Iterable[int]) -> dict[int, float]:
    """Held-out loss after each of ``at_steps`` (steps done) of ``cfg``'s data-parallel job replayed here, and
    after its last step: the model DDP holds, up to float rounding of the gradient's sum."""
    torch.set_num_threads(1)
    model, data = build_job(cfg, torch.device("cpu"))
    optimizer = make_optimizer(cfg, model)
    shards = [datasets.ShardedBatches(len(data), cfg.global_batch_size, r, cfg.world_size, cfg.seed)
              for r in range(cfg.world_size)]
    wanted, out = set(at_steps) | {cfg.steps}, {}
    for step in range(cfg.steps):
        idx = torch.cat([s.indices(step) for s in shards])
        loss = models.training_loss(model, model(data.train_x[idx]), data.train_y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step + 1 in wanted:
            out[step + 1] = models.evaluate(model, data, torch.device("cpu"))["loss"]
    return out


def ddp_curve(result: RunResult, at_steps: Iterable[int]) -> tuple[pd.DataFrame, float]:
    """DDP's held-out curve after ``at_steps`` (steps done), on the run's own timeline, and ``replay_gap``."""
    heldout = replay_heldout(result.config, at_steps)
    line = _timeline(result).set_index("step")
    rows = [{"step": s, "samples": int(line.loc[s, "samples"]), "time_s": float(line.loc[s, "time_s"]),
             "heldout_loss": loss} for s, loss in sorted(heldout.items())]
    gap = heldout[result.config.steps] - float(result.ranks[0].evaluation["loss"])
    return pd.DataFrame(rows, columns=list(CURVE_COLUMNS)), gap


def first_reach(curve: pd.DataFrame, target: float, *, interpolate: bool = False) -> float:
    """Training time at which ``curve`` first reaches ``heldout_loss <= target``; NaN if it never does.

    Not interpolated: the time of the first evaluation at or below the target. ``interpolate``: the time where
    the straight line from the previous evaluation (or from the start, at time 0) crosses the target."""
    below = curve.index[curve["heldout_loss"] <= target]
    if not len(below):
        return math.nan
    i = curve.index.get_loc(below[0])
    t1, l1 = float(curve["time_s"].iloc[i]), float(curve["heldout_loss"].iloc[i])
    if not interpolate or i == 0:
        return t1
    t0, l0 = float(curve["time_s"].iloc[i - 1]), float(curve["heldout_loss"].iloc[i - 1])
    return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)


def time_ratio(candidate: pd.DataFrame, reference: pd.DataFrame, target: float) -> float:
    """``candidate``'s time to ``target`` over ``reference``'s (NaN when either never reaches it)."""
    return first_reach(candidate, target) / first_reach(reference, target)


def reached_text(seconds: float) -> str:
    """A time to quality as read by a person: "not reached" rather than NaN."""
    return "not reached" if math.isnan(seconds) else f"{seconds:.2f} s"


def consistency_problems(curves: Mapping[str, pd.DataFrame], replay_gaps: Mapping[str, float],
                         tolerance: float = REPLAY_TOLERANCE) -> list[str]:
    """Why a comparison of ``curves`` would not be like for like (empty: it is): runs that consumed different
    sample budgets, or a DDP replay that does not end where its run ended."""
    problems = []
    budgets = {name: int(c["samples"].iloc[-1]) if len(c) else 0 for name, c in curves.items()}
    if len(set(budgets.values())) > 1:
        problems.append("the runs consumed different sample budgets: "
                        + ", ".join(f"{n} {b}" for n, b in budgets.items()))
    for name, gap in replay_gaps.items():
        if not abs(gap) <= tolerance:
            problems.append(f"{name}: the replayed held-out loss ends {gap:+.4f} from the run's own "
                            f"(tolerance {tolerance})")
    return problems


def verdict(ratios: Sequence[float], bound: float) -> dict[str, Any]:
    """Met only if every ratio was reached and is at most ``bound`` (a NaN, "not reached", fails)."""
    reached = [r for r in ratios if not math.isnan(r)]
    return {"met": len(reached) == len(ratios) > 0 and max(reached) <= bound, "ratios": list(ratios),
            "not_reached": len(ratios) - len(reached), "bound": bound}


def best_h(rows: Iterable[Mapping[str, Any]], link_mbit: float) -> str:
    """The fp32 DiLoCo variant on ``link_mbit`` with the lowest median time ratio over the seeds (not reached:
    inf); between equal ones, the lowest median final held-out loss."""
    rows = list(rows)
    names = {r["variant"] for r in rows if r["h"] and r["comm_dtype"] == "fp32" and r["link_mbit"] == link_mbit}
    if not names:
        raise ValueError(f"no fp32 DiLoCo rows at {link_mbit:g} Mbit/s")
    score = {n: (median([r["time_ratio"] if not math.isnan(r["time_ratio"]) else math.inf
                         for r in rows if r["variant"] == n]),
                 median([r["heldout_final"] for r in rows if r["variant"] == n])) for n in names}
    return min(sorted(score), key=score.get)
