"""Quantised communication measured: bytes per step, the loss curve's drift against fp32, the time on a slow link.

    python -m dtlab.experiments.quantised [--steps N] [--link-mbit MBIT] [--no-link] [--csv FILE]

Each variant is one run of the same job (an mlp on the digits, Adam) with the fsdp tier's
``gather_comm_dtype``/``reduce_comm_dtype`` or the ddp tier's ``comm_dtype`` set; its reference is the same
tier with fp32 (the collectives as they were). Per variant:

* ``bytes_per_step``: rank 0's recorded bytes per step (steps after the first; nccl-tests' sizes: an
  all-gather counts its whole output), ``sent_per_step``: what a ring algorithm sends of them (times the bus
  factor: ``(n−1)/n`` for an all-gather or all-to-all, ``2(n−1)/n`` for an all-reduce), and ``sent_ratio``
  against fp32. A gathered all-reduce (ddp's quantised hook) sends ``(n−1)`` encoded buckets where a ring
  all-reduce sends ``2(n−1)/n`` buckets: its saving shrinks as the world grows;
* ``drift_max`` and ``drift_last``: the largest |loss − loss(fp32)| over the steps, and its mean over the
  last fifth: quantisation changes the numbers on purpose, so what it costs is how far the curve wanders;
* ``final_loss`` (the last step's training loss, for scale) and ``eval_loss_diff``: the held-out loss after
  training, minus fp32's;
* with ``--link-mbit`` (default 200) and root: ``step_ms`` of the same variant on a wider mlp (width 512, as
  ``benchmarks/link_sweep.py``; 12 steps) on two simulated hosts (one rank each, network namespaces, links
  capped with ``tc``), median over steps after the first; without root it says why and measures the rest.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from dtlab.core.comm import bus_factor
from dtlab.core.config import RunConfig
from dtlab.core.results import RunResult
from dtlab.launch import netns
from dtlab.tiers import ddp, fsdp
from dtlab.train import run
from dtlab.train.runner import run_on_hosts

__all__ = ["DDP_VARIANTS", "FSDP_VARIANTS", "LINK_WIDTH", "base_job", "drift", "link_step_ms", "main", "measure",
           "recorded_bytes", "variants"]

# (all-gather code, reduce-scatter code): both, and each alone, against fp32
FSDP_VARIANTS = (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8"), ("fp8", "fp8"), ("int8", "fp32"),
                 ("fp32", "int8"))
DDP_VARIANTS = ("fp32", "bf16", "int8", "fp8")
LINK_WIDTH = 512  # the link runs' mlp: 1.2 MB of fp32 parameters, so that the link, not the CPU, sets the step


def base_job(steps: int = 300) -> RunConfig:
    """The job every variant runs: a small mlp on the digits, Adam, at world 2 (one thread per rank)."""
    return RunConfig(tier="ddp", model="mlp", model_size=128, model_depth=2, steps=steps, optimizer="adam",
                     lr=0.003, global_batch_size=64, world_size=2, threads_per_rank=1)


def variants(base: RunConfig, fsdp_codes: Sequence[tuple[str, str]] = FSDP_VARIANTS,
             ddp_codes: Sequence[str] = DDP_VARIANTS) -> dict[str, RunConfig]:
    """Label -> config: the fsdp variants (``fsdp ag=<code> rs=<code>``), then ddp's (``ddp <code>``); each tier's
    fp32 (its reference) is added where it is missing."""
    fsdp_codes = [("fp32", "fp32"), *(c for c in fsdp_codes if c != ("fp32", "fp32"))] if fsdp_codes else []
    ddp_codes = ["fp32", *(c for c in ddp_codes if c != "fp32")] if ddp_codes else []
    out = {f"fsdp ag={g} rs={r}": base.replace(tier="fsdp", tier_options=fsdp.Options(gather_comm_dtype=g,
                                                                                        reduce_comm_dtype=r))
           for g, r in fsdp_codes}
    out |= {f"ddp {c}": base.replace(tier="ddp", tier_options=ddp.Options(comm_dtype=c)) for c in ddp_codes}
    return out


def recorded_bytes(result: RunResult, rank: int = 0, warmup_steps: int = 1) -> tuple[float, float]:
    """``rank``'s recorded bytes per training step (from step ``warmup_steps`` on), and what a ring sends of them."""
    ev = result.events_frame()
    ev = ev[(ev["rank"] == rank) & (ev["step"] >= warmup_steps) & (ev["step"] < result.config.steps)]
    steps = max(1, result.config.steps - warmup_steps)
    sent = sum(b * bus_factor(op, int(n)) for b, op, n in zip(ev["bytes"], ev["op"], ev["group_size"]))
    return float(ev["bytes"].sum()) / steps, float(sent) / steps


def drift(result: RunResult, reference: RunResult) -> dict[str, float]:
    """How far ``result``'s loss curve is from ``reference``'s: the largest gap, the mean gap over the last fifth,
    and the held-out loss difference."""
    gap = (result.loss_curve() - reference.loss_curve()).abs()
    tail = gap.iloc[-max(1, len(gap) // 5):]
    return {"drift_max": float(gap.max()), "drift_last": float(tail.mean()),
            "eval_loss_diff": result.ranks[0].evaluation["loss"] - reference.ranks[0].evaluation["loss"]}


def link_step_ms(cfg: RunConfig, link_mbit: float) -> float:
    """The median step (ms, steps after the first) of ``cfg`` on two simulated hosts with ``link_mbit`` links."""
    result = run_on_hosts(cfg, nnodes=2, link_mbit=link_mbit)
    return float(result.steady(1).groupby("step")["total"].max().median()) * 1e3


def measure(configs: dict[str, RunConfig], link_mbit: float | None = None, link_steps: int = 12,
            progress: Callable[[str], None] | None = print) -> pd.DataFrame:
    """One row per variant: label, tier, codes, bytes per step and their ratio to fp32's, drift; ``step_ms`` on the
    capped link when ``link_mbit`` is given (its runs are ``link_steps`` long)."""
    results = {label: run(cfg, progress=False) for label, cfg in configs.items()}
    rows = []
    for label, result in results.items():
        reference = results[_fp32_label(result.config)]
        o = result.config.tier_options
        (recorded, sent), (_, sent_fp32) = recorded_bytes(result), recorded_bytes(reference)
        row: dict[str, Any] = {"variant": label, "tier": result.config.tier,
                               "gather": getattr(o, "gather_comm_dtype", getattr(o, "comm_dtype", "")),
                               "reduce": getattr(o, "reduce_comm_dtype", getattr(o, "comm_dtype", "")),
                               "bytes_per_step": recorded, "sent_per_step": sent, "sent_ratio": sent / sent_fp32,
                               "final_loss": result.final_loss(), **drift(result, reference)}
        if link_mbit:
            row["step_ms"] = link_step_ms(result.config.replace(steps=link_steps, model_size=LINK_WIDTH), link_mbit)
        rows.append(row)
        if progress is not None:
            progress(f"{label}: sends {row['sent_per_step'] / 1e3:.1f} kB/step ({row['sent_ratio']:.3f} of fp32), "
                     f"drift {row['drift_last']:.2e}" + (f", {row['step_ms']:.1f} ms/step" if link_mbit else ""))
    return pd.DataFrame(rows)


def _fp32_label(cfg: RunConfig) -> str:
    return "fsdp ag=fp32 rs=fp32" if cfg.tier == "fsdp" else "ddp fp32"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.quantised", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps of each drift run (default 300)")
    p.add_argument("--link-mbit", type=float, default=200.0, help="the simulated hosts' link cap (default 200)")
    p.add_argument("--no-link", action="store_true", help="skip the runs on simulated hosts")
    p.add_argument("--csv", default="", help="also write the table here")
    args = p.parse_args(argv)
    link: float | None = None if args.no_link else args.link_mbit
    if link is not None:
        ok, reason = netns.available()
        if not ok:
            print(f"step times on a {link:g} Mbit/s link not measured: {reason.split(':')[0]}")
            link = None
    table = measure(variants(base_job(args.steps)), link)
    if args.csv:
        table.to_csv(args.csv, index=False)
    with pd.option_context("display.width", 200, "display.float_format", "{:.4g}".format):
        print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
