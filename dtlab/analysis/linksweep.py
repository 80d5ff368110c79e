"""What the network does to DDP: step time over link caps and gradient compression hooks.

One multi-node DDP run per (link cap, comm hook) on simulated hosts
(``multinode`` tier, ``network="netns"``): each node its own network
namespace, its link capped with ``tc tbf``. Per run, from the recorded
events: the step time, the communication per step, the part of it that
backward did not hide (``analysis.comm_overlap``), and the bytes sent.
Compression hooks (fp16: half the bytes; PowerSGD: a rank-r approximation)
send less, so they recover time where the link is slow -- and cost a little
compute where it is fast.

Needs root (network namespaces); where it cannot run, ``link_sweep`` raises
``ValueError`` with the reason before starting anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from dtlab.analysis import frames
from dtlab.core.config import RunConfig
from dtlab.launch import netns
from dtlab.tiers import ddp, multinode
from dtlab.train import run

__all__ = ["DEFAULT_CAPS_MBIT", "DEFAULT_HOOKS", "link_configs", "link_sweep", "mbit_label", "sweep_row"]

DEFAULT_CAPS_MBIT = (10_000.0, 1_000.0, 200.0)
DEFAULT_HOOKS = ("allreduce", "fp16", "powersgd")
# More than RunResult.steady's default (1), on purpose: PowerSGD compresses only from step 2 (the ddp tier's
# start_powerSGD_iter), so steps 0 and 1 would mix uncompressed steps into the powersgd points.
WARMUP_STEPS = 2


def link_configs(base: RunConfig, caps_mbit: Sequence[float] = DEFAULT_CAPS_MBIT,
                 hooks: Sequence[str] = DEFAULT_HOOKS, *, nnodes: int = 2) -> list[RunConfig]:
    """The multinode configs of the sweep, cap-major: every hook at each cap (all validated here)."""
    if not caps_mbit or any(not c > 0 for c in caps_mbit):
        raise ValueError(f"caps_mbit={tuple(caps_mbit)!r} is invalid: give one or more link caps > 0 Mbit/s")
    unknown = [h for h in hooks if h not in ddp.COMM_HOOKS]
    if not hooks or unknown:
        raise ValueError(f"hooks={tuple(hooks)!r} is invalid: choose from {', '.join(ddp.COMM_HOOKS)}")
    ok, reason = netns.available()
    if not ok:
        raise ValueError(f"the link sweep needs simulated hosts: {reason.split(':')[0]}")
    opts = base.tier_options if isinstance(base.tier_options, ddp.Options) else ddp.Options()
    ddp_fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(ddp.Options)}
    world = base.world_size if base.world_size % nnodes == 0 and base.world_size >= nnodes else nnodes
    return [base.replace(tier="multinode", world_size=world, tier_options=multinode.Options(
        **{**ddp_fields, "comm_hook": hook}, nnodes=nnodes, network="netns", link_mbit=float(cap)))
        for cap in caps_mbit for hook in hooks]


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
    return {"link_mbit": float(o.link_mbit), "comm_hook": o.comm_hook, "world_size": result.config.world_size,
            "nnodes": o.nnodes, "step_ms": step_ms,
            "comm_ms": float(rank0["duration_s"].sum()) * 1e3 / n_steps,
            "exposed_comm_ms": exposed_ms, "compute_ms": max(0.0, step_ms - exposed_ms),
            "comm_mb_per_step": float(rank0["bytes"].sum()) / 1e6 / n_steps,
            "final_loss": result.final_loss(), "steps_measured": n_steps}


def link_sweep(base: RunConfig, caps_mbit: Sequence[float] = DEFAULT_CAPS_MBIT,
               hooks: Sequence[str] = DEFAULT_HOOKS, *, nnodes: int = 2,
               progress: Callable[[str], None] | None = print) -> pd.DataFrame:
    """Run the sweep; one row per (cap, hook) with ``sweep_row``'s columns, plus ``label``.

    ``base``: the job (model, batch, steps, optimizer; a ddp config's bucket
    settings are kept). Each run is a fresh pair of torchrun agents in fresh
    namespaces, removed afterwards. ``progress`` gets one line per run.
    """
    configs = link_configs(base, caps_mbit, hooks, nnodes=nnodes)
    rows = []
    for i, cfg in enumerate(configs, 1):
        row = sweep_row(run(cfg, progress=False))
        row["label"] = f"{mbit_label(row['link_mbit'])} · {row['comm_hook']}"
        rows.append(row)
        if progress is not None:
            progress(f"[{i}/{len(configs)}] {row['label']}: step {row['step_ms']:.1f} ms, "
                     f"exposed comm {row['exposed_comm_ms']:.1f} ms, {row['comm_mb_per_step']:.2f} MB/step")
    return pd.DataFrame(rows)


def mbit_label(mbit: float) -> str:
    """A link speed as people write it: 10 Gbit/s, 200 Mbit/s."""
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"
