"""What the network does to DDP: step time over link caps and gradient compression hooks.

    python -m dtlab.experiments.linksweep [--caps-mbit 10000,1000,200] [--hooks allreduce,fp16,powersgd] [--steps 12]

One multi-node DDP run per (link cap, delay, comm hook) on simulated hosts
(``multinode`` tier, ``network="netns"``): each node its own network
namespace, its link capped with ``tc tbf`` and, with a delay, every packet
held that long one way (``dtlab.launch.netdelay``). Per run, from the recorded
events: the step time, the communication per step, the part of it that
backward did not hide (``read.frames.comm_overlap``), and the bytes sent.
Compression hooks (fp16: half the bytes; PowerSGD: a rank-r approximation)
send less, so they recover time where the link is slow -- and cost a little
compute where it is fast.

Needs root (network namespaces); where it cannot run, ``link_sweep`` raises
``ValueError`` with the reason before starting anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from dtlab.core.config import RunConfig
from dtlab.cost import links as costmodel
from dtlab.experiments import simlinks
from dtlab.experiments.simlinks import link_label, mbit_label
from dtlab.read import frames
from dtlab.train import run

__all__ = ["DEFAULT_CAPS_MBIT", "DEFAULT_HOOKS", "TABLE_COLUMNS", "allreduce_sizes", "beta_terms", "fastest_hook",
           "hook_comparison", "link_configs", "link_label", "link_sweep", "mbit_label", "step_ms_at", "sweep_summary",
           "sweep_row",
           "sweep_table"]

DEFAULT_CAPS_MBIT = (10_000.0, 1_000.0, 200.0)
DEFAULT_HOOKS = ("allreduce", "fp16", "powersgd")
# More than RunResult.steady's default (1), on purpose: PowerSGD compresses only from step 2 (the ddp tier's
# start_powerSGD_iter), so steps 0 and 1 would mix uncompressed steps into the powersgd points.
WARMUP_STEPS = 2
TABLE_COLUMNS = ("label", "step_ms", "compute_ms", "exposed_comm_ms", "comm_ms", "comm_mb_per_step", "final_loss")


def link_configs(base: RunConfig, caps_mbit: Sequence[float] = DEFAULT_CAPS_MBIT,
                 hooks: Sequence[str] = DEFAULT_HOOKS, *, nnodes: int = 2,
                 delays_ms: Sequence[float] = (0.0,)) -> list[RunConfig]:
    """The multinode configs of the sweep, link-major: every hook at each (cap, delay) (all validated here)."""
    return simlinks.link_configs(base, caps_mbit, hooks, nnodes=nnodes, delays_ms=delays_ms)


def sweep_row(result: Any, warmup_steps: int = WARMUP_STEPS) -> dict[str, Any]:
    """One run's numbers: step, communication and exposed communication per step (ms), MB sent per step."""
    o = result.config.tier_options
    steady = result.steady(warmup_steps)
    first = steady["step"].min()  # the same steps for the communication as for the step times
    per_step = steady.groupby("step")["total"].max()
    overlap = frames.comm_overlap(result)
    rank0 = overlap[(overlap["rank"] == 0) & (overlap["step"] >= first)]
    n_steps = max(1, int(per_step.size))
    step_ms = float(per_step.median()) * 1e3
    exposed_ms = float(rank0.groupby("step")["exposed_s"].sum().median()) * 1e3 if len(rank0) else 0.0
    evaluation = result.ranks[0].evaluation or {}
    return {"link_mbit": float(o.link_mbit), "link_delay_ms": float(getattr(o, "link_delay_ms", 0.0)),
            "comm_hook": o.comm_hook, "world_size": result.config.world_size,
            "nnodes": o.nnodes, "step_ms": step_ms,
            "comm_ms": float(rank0["duration_s"].sum()) * 1e3 / n_steps,
            "exposed_comm_ms": exposed_ms, "compute_ms": max(0.0, step_ms - exposed_ms),
            "comm_mb_per_step": float(rank0["bytes"].sum()) / 1e6 / n_steps,
            "final_loss": result.final_loss(), "eval_loss": float(evaluation.get("loss", float("nan"))),
            "steps_measured": n_steps}


def link_sweep(base: RunConfig, caps_mbit: Sequence[float] = DEFAULT_CAPS_MBIT,
               hooks: Sequence[str] = DEFAULT_HOOKS, *, nnodes: int = 2,
               progress: Callable[[str], None] | None = print, delays_ms: Sequence[float] = (0.0,)) -> pd.DataFrame:
    """Run the sweep; one row per (cap, delay, hook) with ``sweep_row``'s columns, plus ``label``.

    ``base``: the job (model, batch, steps, optimizer; a ddp config's bucket
    settings are kept). Each run is a fresh pair of torchrun agents in fresh
    namespaces, removed afterwards. ``progress`` gets one line per run.
    """
    configs = link_configs(base, caps_mbit, hooks, nnodes=nnodes, delays_ms=delays_ms)
    rows = []
    for i, cfg in enumerate(configs, 1):
        row = sweep_row(run(cfg, progress=False))
        row["label"] = f"{link_label(row['link_mbit'], row['link_delay_ms'])} · {row['comm_hook']}"
        rows.append(row)
        if progress is not None:
            progress(f"[{i}/{len(configs)}] {row['label']}: step {row['step_ms']:.1f} ms, "
                     f"exposed comm {row['exposed_comm_ms']:.1f} ms, {row['comm_mb_per_step']:.2f} MB/step")
    return pd.DataFrame(rows)


def sweep_table(sweep: pd.DataFrame, columns: Sequence[str] = TABLE_COLUMNS, decimals: int = 3) -> pd.DataFrame:
    """The sweep's main columns (one row per run, in sweep order), rounded for reading."""
    return sweep[list(columns)].round(decimals)


def hook_comparison(sweep: pd.DataFrame, baseline: str = "allreduce") -> pd.DataFrame:
    """Every run beside the ``baseline`` hook's run on the same link cap.

    Indexed by (``comm_hook``, ``link_mbit``), sorted: ``step_ms``,
    ``compute_ms``, ``exposed_comm_ms``, ``exposed_share`` (of the step),
    ``comm_mb_per_step`` and ``final_loss``, then ``step_ratio`` and
    ``bytes_ratio`` (this run's step time and bytes over the baseline's at that
    cap) and the baseline's ``baseline_compute_ms``.
    """
    if baseline not in set(sweep["comm_hook"]):
        raise ValueError(f"baseline={baseline!r} is not in the sweep "
                         f"(hooks: {', '.join(dict.fromkeys(sweep['comm_hook']))})")
    cols = ["step_ms", "compute_ms", "exposed_comm_ms", "comm_mb_per_step", "final_loss"]
    df = sweep[["comm_hook", "link_mbit", *cols]].copy()
    df["exposed_share"] = df["exposed_comm_ms"] / df["step_ms"]
    base = sweep[sweep["comm_hook"] == baseline].set_index("link_mbit")
    df["step_ratio"] = df["step_ms"] / df["link_mbit"].map(base["step_ms"])
    df["bytes_ratio"] = df["comm_mb_per_step"] / df["link_mbit"].map(base["comm_mb_per_step"])
    df["baseline_compute_ms"] = df["link_mbit"].map(base["compute_ms"])
    return df.set_index(["comm_hook", "link_mbit"]).sort_index()


def sweep_summary(sweep: pd.DataFrame, single_loss: float | None = None, baseline: str = "allreduce") -> str:
    """The sweep in sentences: the baseline on the fastest and the slowest cap, each other hook against it, losses.

    Caps and hooks are taken in sweep order; ``single_loss`` (a single-device
    run's final loss), when given, ends the last line.
    """
    cmp = hook_comparison(sweep, baseline)
    caps = list(dict.fromkeys(sweep["link_mbit"]))
    hooks = list(dict.fromkeys(sweep["comm_hook"]))
    fast, slow = max(caps), min(caps)
    full = cmp.loc[baseline]
    lines = [f"{baseline}: {full.step_ms[slow]:.1f} ms per step at {slow:g} Mbit/s against {full.step_ms[fast]:.1f} "
             f"ms at {fast:g} Mbit/s; exposed communication {full.exposed_comm_ms[slow]:.1f} ms "
             f"({full.exposed_share[slow]:.0%} of the step) against {full.exposed_comm_ms[fast]:.1f} ms "
             f"({full.exposed_share[fast]:.0%})"]
    for hook in hooks:
        if hook == baseline:
            continue
        rows = cmp.loc[hook]
        per_cap = [f"at {cap:g} Mbit/s step {rows.step_ratio[cap]:.2f}x {baseline}'s, compute "
                   f"{rows.compute_ms[cap]:.1f} ms ({baseline} {rows.baseline_compute_ms[cap]:.1f})" for cap in caps]
        lines.append(f"{hook}: sends {rows.bytes_ratio[slow]:.1%} of {baseline}'s bytes; " + "; ".join(per_cap))
    losses = ", ".join(f"{h} {sweep[sweep['comm_hook'] == h]['final_loss'].iloc[0]:.4f}" for h in hooks)
    lines.append(f"final loss: {losses}" + (f" (single device {single_loss:.4f})" if single_loss is not None else ""))
    return "\n".join(lines)


def step_ms_at(sweep: pd.DataFrame, link_mbit: float) -> pd.Series:
    """Step time (ms) per comm hook on the ``link_mbit`` cap, fastest first."""
    rows = sweep[sweep["link_mbit"] == float(link_mbit)]
    if rows.empty:
        raise ValueError(f"link_mbit={link_mbit!r} is not in the sweep (caps: "
                         f"{', '.join(f'{c:g}' for c in dict.fromkeys(sweep['link_mbit']))})")
    return rows.set_index("comm_hook")["step_ms"].sort_values(kind="stable")


def fastest_hook(sweep: pd.DataFrame, link_mbit: float) -> str:
    """The comm hook with the shortest step on the ``link_mbit`` cap."""
    return str(step_ms_at(sweep, link_mbit).index[0])


def beta_terms(sweep: pd.DataFrame) -> pd.DataFrame:
    """Each run's all-reduce against the alpha-beta model's bandwidth term alone.

    One row per run: ``label``, ``MB_per_step``, ``beta_term_ms`` (a ring
    all-reduce of the run's bytes per step over its world size, on a link of
    the run's cap with no latency: ``LinkModel.from_bandwidth(mbit, alpha_s=0)``),
    ``measured_comm_ms`` and ``rest_ms`` (measured minus the bandwidth term).
    """
    rows = []
    for r in sweep.itertuples():
        bandwidth_only = costmodel.LinkModel.from_bandwidth(r.link_mbit, alpha_s=0.0)
        beta_ms = bandwidth_only.predict("all_reduce", r.comm_mb_per_step * 1e6, int(r.world_size)) * 1e3
        rows.append({"label": r.label, "MB_per_step": r.comm_mb_per_step, "beta_term_ms": beta_ms,
                     "measured_comm_ms": r.comm_ms, "rest_ms": r.comm_ms - beta_ms})
    return pd.DataFrame(rows, columns=["label", "MB_per_step", "beta_term_ms", "measured_comm_ms", "rest_ms"])


def allreduce_sizes(result: Any, rank: int = 0) -> pd.Series:
    """Per step, the sizes in bytes of ``rank``'s all-reduces, in the order it issued them (a list per step)."""
    ev = result.events_frame()
    ev = ev[(ev["rank"] == rank) & (ev["op"] == "all_reduce")]
    return ev.groupby("step")["bytes"].apply(list)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.linksweep", description=__doc__.split("\n")[0])
    p.add_argument("--caps-mbit", default=",".join(f"{c:g}" for c in DEFAULT_CAPS_MBIT), help="link caps, Mbit/s")
    p.add_argument("--hooks", default=",".join(DEFAULT_HOOKS), help="DDP comm hooks")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    caps = [float(c) for c in args.caps_mbit.split(",") if c.strip()]
    hooks = [h for h in args.hooks.split(",") if h.strip()]
    base = RunConfig(tier="ddp", world_size=2, steps=args.steps, threads_per_rank=1)
    sweep = link_sweep(base, caps, hooks)
    with pd.option_context("display.width", 200):
        print(sweep_table(sweep).to_string(index=False))
    print(sweep_summary(sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
