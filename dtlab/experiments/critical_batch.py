"""Data parallelism's critical batch on this machine: predicted from its roofline and its gloo link, then run.

    python -m dtlab.experiments.critical_batch [--quick] [--rounds 3]

The job (``job``) is ``ddp-naive``: after backward, one all-reduce per parameter and nothing
overlapped, so a step's ``comm`` phase is the all-reduces alone and its forward and backward the
compute alone; one thread per rank, as many ranks as cores.

**Predicted** (``predict``), for one rank at ``B`` samples: its forward and backward on this
machine's measured roofline at the job's placement (``roofline.predict.predicted_phases``: each op
of the model at the rate its shape reaches, plus eager PyTorch's cost per op), against every
parameter's all-reduce priced on the calibrated link (``LinkModel.predict``). Compute grows with
``B``, communication does not: the critical batch is the smallest ``B`` whose compute is at least
its communication. Beside it the formula of ``cost.critical``, ``(n-1)/n b C / (3 W)`` with
``C`` the placement's peak FLOP/s and ``W`` the link's bus bandwidth, ``1 / beta``: it takes every
GEMM at the peak (a slower compute catches up sooner: the formula's batch is larger) and the
all-reduces without their latency (more to catch up with: the formula's batch is smaller).

**Measured** (``measure``): the job at ``FACTOR`` below and above the predicted batch, each step's
compute the ranks' mean forward + backward and its communication the ``comm`` phase of the rank
that came last to it (it waited for no one, only for the all-reduces), medians over the steady steps
of every round. ``confirm`` holds the prediction to it: communication-bound below, compute-bound above.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from dtlab.core.config import RunConfig
from dtlab.core.job import build_job
from dtlab.cost.critical import critical_tokens
from dtlab.cost.estimate.calibration import calibrate_link
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.roofline.cpu import DEFAULT_PATH, Roofline, fit
from dtlab.cost.roofline.measure import measure as measure_roofline
from dtlab.cost.roofline.model import Op
from dtlab.cost.roofline.ops import job_ops
from dtlab.cost.roofline.predict import op_phase_seconds
from dtlab.cost.roofline.saved import machine_roofline
from dtlab.train import run

__all__ = ["CURVE_BATCHES", "FACTOR", "Critical", "confirm", "crossing", "job", "measure", "predict", "roofline_here"]

CURVE_BATCHES = tuple(2 ** k for k in range(1, 13))  # 2 ... 4096 samples per rank
# How far either side of the predicted batch the runs go. Wide: on this shared 2-core machine the compute ran
# 1-3x the roofline's prediction under other processes' load and the all-reduces 2-4x their sweep's price
# (2026-12-06), errors a factor of 4 either side did not always cover
FACTOR = 8


def job(width: int = 1024, depth: int = 2, world_size: int = 2, steps: int = 12) -> RunConfig:
    """The data-parallel job the check runs (its batch is set per run): an MLP on synthetic data, SGD."""
    return RunConfig(tier="ddp-naive", world_size=world_size, model="mlp", model_size=width, model_depth=depth,
                     dataset="synthetic", dataset_size=16384, global_batch_size=world_size, steps=steps,
                     optimizer="sgd", threads_per_rank=1)


def roofline_here(cfg: RunConfig, quick: bool = False, say: Callable[[str], None] = lambda line: None) -> Roofline:
    """The roofline to predict ``cfg`` on: the saved full measurement if it has the job's placement; else, in
    ``quick`` mode, that placement alone measured now (a smoke test, not saved); else the full measurement,
    made and saved (``roofline.saved.machine_roofline``)."""
    place = (cfg.resolved_threads, cfg.world_size)
    if DEFAULT_PATH.is_file():
        saved = Roofline.load(DEFAULT_PATH)
        if saved.matches_this_machine() and not saved.machine.get("quick") and place in saved.placements:
            say(f"roofline: {DEFAULT_PATH}, measured {saved.machine.get('measured')}")
            return saved
    if not quick:
        return machine_roofline(say=say)
    say(f"roofline: measuring {place[0]} thread(s) x {place[1]} copies now, quick (a smoke test)")
    return fit(measure_roofline([place], quick=True, log=say))


@dataclass(frozen=True)
class Critical:
    """The predicted critical batch per rank (samples), the formula's, and what they come from."""

    batch: int
    formula_batch: float
    comm_s: float
    peak_flops: float
    bus_bandwidth: float
    curve: pd.DataFrame  # batch, compute_s (forward + backward, predicted), comm_s


@functools.lru_cache(maxsize=256)
def _ops(solo: RunConfig) -> tuple[Op, ...]:
    return tuple(job_ops(solo))  # counted on fake tensors, ~0.1 s: a bisection asks again for the same batches


def _compute_s(cfg: RunConfig, roof: Roofline, batch: int) -> float:
    """One rank's forward + backward at ``batch`` samples, as ``roofline.predict.predicted_phases`` predicts it."""
    placement, scale = roof.placement(cfg.resolved_threads, cfg.world_size)
    phases = op_phase_seconds(_ops(cfg.replace(tier="single", world_size=1, global_batch_size=batch)), placement)
    return (phases.get("forward", 0.0) + phases.get("backward", 0.0)) * scale


def predict(cfg: RunConfig, roof: Roofline, link: LinkModel, batches: Sequence[int] = CURVE_BATCHES) -> Critical:
    """Where ``cfg``'s compute per rank catches up with its all-reduces, on ``roof`` and ``link`` (``batches``: the
    samples per rank the predicted curve is drawn at; the critical batch is found between them)."""
    if cfg.tier != "ddp-naive" or cfg.world_size < 2:
        raise ValueError(f"critical_batch.predict: the job must be ddp-naive at world_size >= 2 (got tier "
                         f"{cfg.tier!r}, world_size {cfg.world_size}): its comm phase is then the all-reduces alone")
    params = list(build_job(cfg, torch.device("meta"))[0].parameters())
    comm = sum(link.predict("all_reduce", p.numel() * p.element_size(), cfg.world_size) for p in params)
    curve = pd.DataFrame({"batch": list(batches), "compute_s": [_compute_s(cfg, roof, b) for b in batches]})
    curve["comm_s"] = comm
    above = curve[curve["compute_s"] >= comm]
    if above.empty:
        raise ValueError(f"critical_batch.predict: the compute stays below the all-reduces ({comm * 1e3:.3g} ms) up to "
                         f"{max(batches)} samples per rank: choose a wider model")
    high = int(above["batch"].iloc[0])
    low = max(1, high // 2)
    while high - low > 1:  # compute grows with the batch: bisect between the last below and the first above
        middle = (low + high) // 2
        low, high = (low, middle) if _compute_s(cfg, roof, middle) >= comm else (middle, high)
    peak = roof.placement(cfg.resolved_threads, cfg.world_size)[0].device.peak("fp32")
    bandwidth = 1.0 / link.beta_s_per_byte
    formula = critical_tokens("dp", peak, bandwidth, params[0].element_size(), cfg.world_size)
    return Critical(high, formula, comm, peak, bandwidth, curve)


def _medians(result: Any) -> tuple[float, float]:
    """Median over steady steps of the ranks' mean forward + backward, and of the last-arriving rank's comm."""
    steps = result.steady()
    per_step = steps.assign(compute=steps["forward"] + steps["backward"]).groupby("step")
    return float(per_step["compute"].mean().median()), float(per_step["comm"].min().median())


def measure(cfg: RunConfig, critical: Critical, factor: int = FACTOR, rounds: int = 1,
            say: Callable[[str], None] = lambda line: None) -> pd.DataFrame:
    """``cfg`` run at ``critical.batch / factor`` and ``x factor`` samples per rank, ``rounds`` times each
    (interleaved): one row per side with the measured and the predicted compute and communication."""
    sides = {"below": max(1, round(critical.batch / factor)), "above": critical.batch * factor}
    seen: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for r in range(rounds):
        for side, batch in sides.items():
            result = run(cfg.replace(global_batch_size=batch * cfg.world_size), progress=False)
            seen[side].append(_medians(result))
            say(f"round {r + 1}/{rounds}: {batch} samples per rank ({side}): compute {seen[side][-1][0] * 1e3:.2f} "
                f"ms, all-reduces {seen[side][-1][1] * 1e3:.2f} ms")
    curve = critical.curve
    rows = []
    for side, batch in sides.items():
        compute, comm = (float(np.median(v)) for v in zip(*seen[side], strict=True))
        predicted = float(np.exp(np.interp(np.log(batch), np.log(curve["batch"]), np.log(curve["compute_s"]))))
        rows.append({"side": side, "batch": batch, "compute_s": compute, "comm_s": comm,
                     "predicted_compute_s": predicted, "predicted_comm_s": critical.comm_s,
                     "bound": "communication" if comm > compute else "compute",
                     "predicted_bound": "communication" if critical.comm_s > predicted else "compute"})
    return pd.DataFrame(rows)


def crossing(frame: pd.DataFrame) -> float:
    """Where the runs either side put the critical batch: the batch at which compute / communication, taken as a
    power of the batch between the two runs, is 1 (an interpolation between two points, not a third run)."""
    below, above = (frame[frame["side"] == side].iloc[0] for side in ("below", "above"))
    ratios = [np.log(row["compute_s"] / row["comm_s"]) for row in (below, above)]
    if ratios[0] >= 0 or ratios[1] <= 0:
        raise ValueError("crossing: the run below must be communication-bound and the one above compute-bound")
    logs = np.log([below["batch"], above["batch"]])
    return float(np.exp(logs[0] - ratios[0] * (logs[1] - logs[0]) / (ratios[1] - ratios[0])))


def confirm(frame: pd.DataFrame) -> str:
    """One line saying that the run below the critical batch was communication-bound and the one above compute-
    bound; AssertionError naming the run that was not."""
    expected = {"below": "communication", "above": "compute"}
    for row in frame.itertuples(index=False):
        if row.bound != expected[row.side]:
            raise AssertionError(f"at {row.batch} samples per rank ({row.side} the predicted critical batch) the run "
                                 f"was {row.bound}-bound, not {expected[row.side]}-bound: compute "
                                 f"{row.compute_s * 1e3:.2f} ms, all-reduces {row.comm_s * 1e3:.2f} ms")
    below, above = (frame[frame["side"] == side].iloc[0] for side in ("below", "above"))
    return (f"{int(below['batch'])} samples per rank: the all-reduces took {below['comm_s'] / below['compute_s']:.1f}x "
            f"the compute (communication-bound); {int(above['batch'])}: the compute took "
            f"{above['compute_s'] / above['comm_s']:.1f}x the all-reduces (compute-bound), as predicted")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.critical_batch",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a quick roofline and link, one round: a smoke test")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    cfg = job(steps=6 if args.quick else 20)
    roof = roofline_here(cfg, quick=args.quick, say=print)
    link = calibrate_link(cfg.world_size, ("all_reduce",), quick=args.quick).default
    critical = predict(cfg, roof, link)
    print(f"predicted critical batch: {critical.batch} samples per rank (formula {critical.formula_batch:.0f})")
    sides = measure(cfg, critical, rounds=1 if args.quick else args.rounds, say=print)
    print(confirm(sides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
