"""Goodput measured here: checkpoint costs (DCP ``save`` and ``async_save``), runs with faults at random, their costs.

Faults are a Poisson process over the steps a run executes (gaps drawn from an
exponential distribution of mean ``M / step_s`` steps, with a fixed seed), injected
through each tier's own faults option: ``elastic`` ``sigkill:STEP:1`` (the world
restarts from the last snapshot), ``ft`` and ``diloco`` ``kill:STEP:1`` (always
group 1, so that the two groups are never down together; a fault whose step
group 1 skips while it rejoins does not fire, as a machine that is already down
cannot fail again). Each run is read from its events into one row: the useful
steps (global-batch steps: a step or a synchronisation round that one of two
groups missed counts half), the span (first to last finished step), faults
fired, the step time without faults and what each fault cost.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
import warnings
from typing import Any

import pandas as pd
import torch

from dtlab.analysis.elastic import timeline
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job, optimizer_factory
from dtlab.core.results import RunResult
from dtlab.tiers import diloco, elastic, ft
from dtlab.train import run

__all__ = ["checkpoint_costs", "elastic_schedule", "measure", "read_run", "replica_schedule"]


def checkpoint_costs(cfg: RunConfig, repeats: int = 15) -> dict[str, float]:
    """Median seconds of DCP ``save``, ``async_save`` (blocking part, and until durable) and ``load`` of the job's
    model and Adam state, in this process (one rank: a 2-rank DDP save writes the same replicated state once),
    and ``step_guess_s``, one step here."""
    import torch.distributed.checkpoint as dcp  # deferred: about 1 s to import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, data = build_job(cfg, torch.device("cpu"))
    optimizer = optimizer_factory(cfg)(model.parameters())
    x, y = data.train_x[: cfg.global_batch_size], data.train_y[: cfg.global_batch_size]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()  # Adam's moments exist: the state a snapshot holds
    times: dict[str, list[float]] = {"save_s": [], "async_block_s": [], "async_total_s": [], "load_s": []}
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        for i in range(repeats + 1):  # the first round warms DCP up and is not counted
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=f"{tmp}/sync-{i}", no_dist=True)
            t1 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=f"{tmp}/async-{i}", no_dist=True)
            t2 = time.perf_counter()
            future.result()
            t3 = time.perf_counter()
            msd, osd = get_state_dict(model, optimizer)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/sync-{i}", no_dist=True)
            t4 = time.perf_counter()
            if i:
                for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t1, t4 - t3)):
                    times[key].append(value)
    out = {key: statistics.median(values) for key, values in times.items()}
    out["step_guess_s"] = _step_seconds(model, optimizer, x, y)
    return out


def _step_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  repeats: int = 20) -> float:
    """One training step in this process (median): the step time a fault schedule is drawn with, before a run."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def elastic_schedule(mean_steps: float, steps: int, every: int, rng: random.Random) -> list[int]:
    """Fault steps for ``elastic``: each drawn ``Exp(mean_steps)`` executed steps after the resume point, which is
    the last snapshot (every ``every`` steps) before the previous fault. Also: executed steps = steps + redone."""
    out, resume = [], 0
    while True:
        fault = resume + max(1, math.ceil(rng.expovariate(1.0 / mean_steps)))
        if fault >= steps:
            return out
        out.append(fault)
        resume = fault // every * every


def replica_schedule(mean_steps: float, steps: int, rng: random.Random, first: int = 1) -> list[int]:
    """Fault steps for ``ft``/``diloco``: a Poisson process over the steps, gaps ``Exp(mean_steps)``, increasing."""
    out, at = [], first - 1
    while True:
        at += max(1, math.ceil(rng.expovariate(1.0 / mean_steps)))
        if at >= steps:
            return out
        out.append(at)


def redone_steps(faults: list[int], every: int) -> int:
    """Steps ``elastic`` computes twice for these faults: each fault's step minus its last snapshot."""
    return sum(f - f // every * every for f in faults)


def _median_gap(times: pd.Series) -> float:
    return float(times.sort_values().diff().median())


def read_run(result: RunResult) -> dict[str, Any]:
    """One run in numbers: useful (global-batch) steps, span, faults fired, fault-free step, per-fault costs."""
    df, cfg = timeline(result), result.config
    faults = df[df["kind"] == "fault"]
    row: dict[str, Any] = {"tier": cfg.tier, "steps": cfg.steps, "faults": len(faults)}
    if cfg.tier == "elastic":
        steps = df[df["kind"] == "step"]
        row.update(useful_steps=cfg.steps - 1, span_s=float(steps["t_s"].max() - steps["t_s"].min()),
                   executed_steps=len(steps), step_s=_median_gap(steps[steps["attempt"] == 0]["t_s"]))
        saves = df[df["kind"] == "snapshot"]
        row["save_in_run_s"] = float(saves["seconds"].median()) if len(saves) else float("nan")
        # faults strike while it trains or saves: the time exposed to them
        row["exposed_s"] = len(steps) * row["step_s"] + float(saves["seconds"].sum())
        # a fault's restart: the fault to the first step of the next attempt done, less that one step
        restarts = [float(steps[steps["attempt"] > f["attempt"]]["t_s"].min()) - float(f["t_s"]) - row["step_s"]
                    for _, f in faults.iterrows()]
        row["restart_s"] = statistics.median(restarts) if restarts else float("nan")
    elif cfg.tier == "ft":
        steps = df[(df["kind"] == "ft_step") & df["committed"].astype(bool)]
        share = steps[~steps["healing"].astype(bool)].groupby("step")["replica"].nunique() / cfg.tier_options.replicas
        first = steps["t_s"].min()
        row.update(useful_steps=float(share.iloc[1:].sum()), span_s=float(steps["t_s"].max() - first),
                   step_s=_median_gap(steps[(steps["replica"] == 0) & (steps["attempt"] == 0)]["t_s"]))
    else:
        syncs = df[df["kind"] == "diloco_sync"]
        rounds = syncs[syncs["healed_to"].isna()].groupby("syncs_committed")["replica"].nunique()
        h = cfg.tier_options.sync_every
        row.update(useful_steps=float(rounds.iloc[1:].sum() / cfg.tier_options.replicas * h),
                   span_s=float(syncs["t_s"].max() - syncs["t_s"].min()),
                   step_s=_median_gap(syncs[(syncs["replica"] == 0) & (syncs["attempt"] == 0)]["t_s"]) / h)
    row.setdefault("exposed_s", cfg.steps * row["step_s"])
    row["goodput"] = row["useful_steps"] / row["span_s"]
    if cfg.tier != "elastic":  # what the faults cost, as time: the span beyond the useful steps' fault-free time
        row["lost_per_fault_s"] = ((row["span_s"] - row["useful_steps"] * row["step_s"]) / row["faults"]
                                   if row["faults"] else float("nan"))
    return row


def measure(tier: str, job: dict[str, Any], mtbf_s: float, step_s: float, seed: int, **options: Any) -> dict[str, Any]:
    """One run of ``tier`` with Poisson faults of mean ``mtbf_s`` training seconds (``step_s`` converts it to
    steps); ``options`` go to the tier (``elastic``: ``snapshot_every``; ``ft``: ``timeouts``; ``diloco``:
    ``sync_every``). Returns ``read_run``'s row with the schedule and the nominal MTBF."""
    rng, steps = random.Random(seed), job["steps"]
    mean_steps = mtbf_s / step_s
    if tier == "elastic":
        every = options["snapshot_every"]
        faults = elastic_schedule(mean_steps, steps, every, rng)
        # headroom in the restarts: a rendezvous that fails under load takes one too
        opts: Any = elastic.Options(snapshot_format="dcp", faults=tuple(f"sigkill:{s}:1" for s in faults),
                                    max_restarts=2 * len(faults) + 2, **options)
    else:
        first = options.get("sync_every", 1)  # diloco: no fault before the first synchronisation
        faults = replica_schedule(mean_steps, steps, rng, first=first)
        module = ft if tier == "ft" else diloco
        opts = module.Options(faults=tuple(f"kill:{s}:1" for s in faults), max_restarts=len(faults) + 1,
                              **options)
    cfg = RunConfig(tier=tier, **job, tier_options=opts)
    row = read_run(run(cfg, progress=False))
    if tier == "elastic":
        row["predicted_executed_steps"] = steps + redone_steps(faults, options["snapshot_every"])
    option_text = ",".join(f"{k}={v}" for k, v in options.items())
    return {**row, "mtbf_nominal_s": mtbf_s, "seed": seed, "scheduled": len(faults), "options": option_text,
            "schedule": " ".join(map(str, faults))}

