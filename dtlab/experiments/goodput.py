"""Goodput over a long run: ``python -m dtlab.experiments.goodput [--quick] [--out DIR] [--seed N]``.

Measures DCP's checkpoint costs, runs ``elastic`` (restart from a DCP snapshot
every Daly interval), ``ft`` (per-step recovery; both timeout settings in full
mode) and ``diloco`` with faults at random (``goodput_measure``), fits each
tier's few costs (``goodput_model``) and writes ``goodput.csv`` (rows of kind
``checkpoint``, ``point``, ``curve``, ``projection``) and ``goodput.png``.
A point's prediction uses costs from the tier's *other* runs where there are
any (full mode); in quick mode, one run per tier, from the run itself.

Goodput measured here: checkpoint costs (DCP ``save`` and ``async_save``), runs with faults at random, their costs.

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

import argparse
import dataclasses
import math
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from dtlab.core.config import RunConfig
from dtlab.core.job import build_job, make_optimizer
from dtlab.core.results import RunResult
from dtlab.cost import goodput as model
from dtlab.plots.goodput import goodput_figure
from dtlab.read.elastic import timeline
from dtlab.tiers import diloco, elastic, ft
from dtlab.train import run

__all__ = ["BREAK_EVEN_CHOICES", "break_even_here", "checkpoint_costs", "costs", "curves", "elastic_schedule", "main",
           "measure", "points", "predict_points", "projection", "read_run", "replica_schedule"]

PER_STEP = "per-step recovery, no step overhead"  # the projection's: what an overhead per step may cost
MTBF_GRID = np.logspace(-1.3, 3, 60)  # seconds of training between faults, for the curves


def _job(quick: bool) -> dict[str, Any]:
    return dict(world_size=2, model_size=64 if quick else 256, steps=60 if quick else 300, optimizer="adam",
                threads_per_rank=1)


def _plan(quick: bool) -> list[tuple[str, dict[str, Any]]]:
    """(tier, options) for each tier and fault-time setting measured."""
    plan: list[tuple[str, dict[str, Any]]] = [("elastic", {}), ("ft", {"timeouts": "tuned"}),
                                             ("diloco", {"sync_every": 5 if quick else 10})]
    return plan if quick else [*plan, ("ft", {"timeouts": "torchft"})]


def variant(tier: str, options: str) -> str:
    return {"elastic": "restart, DCP save", "diloco": "DiLoCo"}.get(tier, "ft") + (
        f" ({options})" if options and tier != "elastic" else "")


def points(quick: bool, seed: int, ckpt: dict[str, float], log: Any = print) -> pd.DataFrame:
    """Every measured run, one row each, with the realised MTBF (seconds exposed to faults per fault fired)."""
    job, rows = _job(quick), []
    means = [20.0] if quick else [30.0, 60.0, 100.0]  # mean steps between faults
    for i, mean_steps in enumerate(means):
        for tier, options in _plan(quick):
            extra = dict(options)
            guess = ckpt["step_guess_s"]
            if tier == "elastic":  # the interval is chosen before the run, from the step measured in-process
                extra["snapshot_every"] = model.interval_steps(
                    model.Restart(guess, ckpt["save_s"], 0.0), mean_steps * guess)
            t0 = time.perf_counter()
            row = measure(tier, job, mean_steps * guess, guess, seed + i, **extra)
            row.update(kind="point", variant=variant(tier, row["options"]), mean_steps=mean_steps,
                       mtbf_s=row["exposed_s"] / row["faults"] if row["faults"] else math.inf)
            log(f"{row['variant']}: {row['faults']} faults, {row['goodput']:.1f} steps/s "
                f"({time.perf_counter() - t0:.0f} s)")
            rows.append(row)
    return pd.DataFrame(rows)


def costs(runs: pd.DataFrame, ckpt: dict[str, float], exclude: int | None = None) -> dict[str, Any]:
    """Each variant's model costs: medians over its runs (less row ``exclude`` where another run is left)."""
    out: dict[str, Any] = {}
    for name, group in runs.groupby("variant"):
        if exclude is not None and exclude in group.index and len(group) > 1:
            group = group.drop(index=exclude)
        step = float(group["step_s"].median())
        if name.startswith("restart"):
            out[name] = model.Restart(step, float(group["save_in_run_s"].median()),
                                      float(group["restart_s"].median()))
        else:
            out[name] = model.PerFault(step, float(group["lost_per_fault_s"].median()))
    elastic = out.get("restart, DCP save")
    if elastic is not None:  # async_save in its place: the micro-benchmark's blocking and durable times
        out["restart, DCP async_save"] = model.Restart(elastic.step_s, ckpt["async_block_s"], elastic.restart_s,
                                                       ckpt["async_total_s"] - ckpt["async_block_s"])
    return out


def predict_points(runs: pd.DataFrame, ckpt: dict[str, float]) -> pd.Series:
    """Each run's predicted goodput at its realised MTBF: what a fault costs from its variant's other runs, the
    step from its own fault-free steps (the machine's load moves a step's time from run to run)."""
    out = []
    for i, row in runs.iterrows():
        c = dataclasses.replace(costs(runs, ckpt, exclude=i)[row["variant"]], step_s=float(row["step_s"]))
        if row["tier"] == "elastic":  # as run: the tier's own save, at the interval it used
            c = model.Restart(c.step_s, float(row["save_in_run_s"]), c.restart_s)
            every = int(row["options"].split("snapshot_every=")[1])
            out.append(model.restart_goodput(c, row["mtbf_s"], every=every))
        else:
            out.append(model.goodput(c, row["mtbf_s"]))
    return pd.Series(out, index=runs.index)


def curves(fitted: dict[str, Any]) -> pd.DataFrame:
    rows = [{"kind": "curve", "variant": name, "mtbf_s": m, "goodput": model.goodput(c, m),
             "interval_steps": model.interval_steps(c, m) if isinstance(c, model.Restart) else None}
            for name, c in fitted.items() for m in MTBF_GRID]
    return pd.DataFrame(rows)


def projection(p: model.Projection = model.LLAMA3) -> pd.DataFrame:
    """The model at a published cluster's failure rate and assumed costs: fraction of fault-free throughput."""
    variants = {"restart, sync save": model.Restart(p.step_s, p.save_s, p.restart_s),
                "restart, async save": model.Restart(p.step_s, p.async_save_s, p.restart_s, p.persist_s),
                PER_STEP: model.PerFault(p.step_s, p.ft_lost_s)}
    gpus = [1024, 2048, 4096, 8192, p.gpus, 32768, 65536, 131072]
    return pd.DataFrame([{"kind": "projection", "variant": name, "gpus": g, "mtbf_s": m,
                          "fraction": model.goodput(c, m) * c.step_s}
                         for name, c in variants.items() for g, m in zip(gpus, p.mtbf_at(gpus))])


BREAK_EVEN_CHOICES = ("every 10 steps", "every 100 steps", "every 1,000 steps", "every 10,000 steps",
                      "every 100,000 steps", "at any rate: ft's step is no slower here")


def break_even_here(restart_run: RunResult, per_step_run: RunResult) -> dict[str, Any]:
    """From one faulted ``elastic`` run and one faulted ``ft`` run: the fault interval (training seconds and
    ``ft`` steps) below which ``ft``'s slower step pays for its cheaper faults (the models' crossing; ``steps``
    is None if one is better at every rate), the costs it used, and ``answer``, the nearest of
    ``BREAK_EVEN_CHOICES``."""
    el, per = read_run(restart_run), read_run(per_step_run)
    restart = model.Restart(el["step_s"], el["save_in_run_s"], el["restart_s"])
    cheap = model.PerFault(per["step_s"], per["lost_per_fault_s"])
    mtbf = model.break_even_mtbf(cheap, restart)
    steps = mtbf / cheap.step_s if mtbf else None
    faster = cheap.step_s <= restart.step_s
    answer = BREAK_EVEN_CHOICES[-1] if faster else \
        BREAK_EVEN_CHOICES[min(4, max(0, round(math.log10(steps)) - 1))] if steps else None
    return {"mtbf_s": mtbf, "steps": steps, "answer": answer, "restart": restart, "per_step": cheap}


def _summary(runs: pd.DataFrame, fitted: dict[str, Any], proj: pd.DataFrame, ckpt: dict[str, float]) -> list[str]:
    lines = [f"DCP (in-process, median): save {ckpt['save_s'] * 1e3:.1f} ms; async_save blocks "
             f"{ckpt['async_block_s'] * 1e3:.1f} ms, durable after {ckpt['async_total_s'] * 1e3:.1f} ms; "
             f"load {ckpt['load_s'] * 1e3:.1f} ms"]
    for _, r in runs.iterrows():
        lines.append(f"{r['variant']}: MTBF {r['mtbf_s']:.2f} s ({r['faults']} faults), measured "
                     f"{r['goodput']:.1f} steps/s, predicted {r['predicted']:.1f} ({r['ratio']:.2f})")
    for name in [n for n in fitted if n.startswith("ft") or n == "DiLoCo"]:
        m = model.break_even_mtbf(fitted[name], fitted["restart, DCP save"])
        text = f"{m:.2f} s, {m / fitted[name].step_s:.0f} steps" if m else "none in range"
        lines.append(f"break-even MTBF, {name} against restart (DCP save): {text}")
    llama = proj[proj["gpus"] == model.LLAMA3.gpus]
    at = llama.set_index("variant")["fraction"]
    lines.append(f"PROJECTION ({model.LLAMA3.source}; costs assumed): MTBF {model.LLAMA3.mtbf_s / 3600:.2f} h at "
                 f"{model.LLAMA3.gpus} GPUs; fraction of fault-free throughput: "
                 + ", ".join(f"{name} {value:.3f}" for name, value in at.items())
                 + f"; per-step recovery pays off there while its per-step overhead is below "
                 f"{100 * model.break_even_overhead(at['restart, async save'], at[PER_STEP]):.1f} %")
    return lines


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.goodput", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one run per tier, 60 steps of a width-64 MLP (~30 s)")
    p.add_argument("--out", type=Path, default=Path("results/goodput"))
    p.add_argument("--seed", type=int, default=0, help="the fault schedules' seed")
    args = p.parse_args(argv)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    ckpt = checkpoint_costs(RunConfig(tier="single", **{**_job(args.quick), "world_size": 1}),
                               repeats=5 if args.quick else 15)
    runs = points(args.quick, args.seed, ckpt)
    runs["predicted"] = predict_points(runs, ckpt)
    runs["ratio"] = runs["goodput"] / runs["predicted"]
    fitted = costs(runs, ckpt)
    proj = projection()
    checkpoint = pd.DataFrame([{"kind": "checkpoint", "variant": k, "seconds": v} for k, v in ckpt.items()])
    frame = pd.concat([checkpoint, runs, curves(fitted), proj], ignore_index=True)
    frame.attrs["loadavg"] = " ".join(load) + " -> " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "goodput.csv", index=False)
    goodput_figure(frame).savefig(args.out / "goodput.png", dpi=110, bbox_inches="tight")
    for line in [*_summary(runs, fitted, proj, ckpt), f"load average {frame.attrs['loadavg']}",
                 f"wrote {args.out / 'goodput.csv'} and goodput.png"]:
        print(line)
    return frame





def checkpoint_costs(cfg: RunConfig, repeats: int = 15) -> dict[str, float]:
    """Median seconds of DCP ``save``, ``async_save`` (blocking part, and until durable) and ``load`` of the job's
    model and Adam state, in this process (one rank: a 2-rank DDP save writes the same replicated state once),
    and ``step_guess_s``, one step here."""
    import torch.distributed.checkpoint as dcp  # deferred: about 1 s to import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, data = build_job(cfg, torch.device("cpu"))
    optimizer = make_optimizer(cfg, model)
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


if __name__ == "__main__":
    main()
