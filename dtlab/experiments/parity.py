"""Parity in float32 and float64: how far each tier ends from one device on the same global batch.

    python -m dtlab.experiments.parity [--only NAME,...] [--dtypes float32,float64] [--csv FILE] [--by-tier]

Each case is a short job run by one tier and by ``single`` (world 1, the same
global batch); its gap is the largest absolute difference over the final
parameters. In float64 the gap is the tier's arithmetic against the single
device's, rounding at about 1e-16 of a parameter: a gap above 1e-10 is a bug, not
rounding. In float32 the same sums in another order round differently, and Adam,
whose update is about ``lr * sign(g)`` where a gradient is near zero, turns that
into differences of up to the learning rate per step (discrete routing to experts
can amplify it too), so a float32 gap says little beyond its size. ``ulps`` puts
a gap in units of the run's own precision: ``gap / (eps(dtype) * max |parameter|)``.

The ``diloco`` tier is no single-device job: its reference is ``diloco_reference``,
the same algorithm (every replica's inner steps, the averaged pseudo-gradient,
the outer Nesterov step) computed in this process.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from dtlab.core import data as datasets
from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job, make_optimizer
from dtlab.core.results import max_param_diff
from dtlab.tiers import cp, diloco, elastic, ep, fsdp, fsdp_tp, ft, multinode, nd, pipeline, rpc, tp, zero
from dtlab.train import run

__all__ = ["CASES", "FLOAT64_BOUND", "Case", "by_tier", "case", "diloco_reference", "gap", "main", "measure",
           "reference", "wide"]

FLOAT64_BOUND = 1e-10  # rounding in float64 stays near 1e-14 here; anything above this is not rounding


@dataclass(frozen=True)
class Case:
    """One tier's parity job (float32; ``gap`` runs it in either dtype)."""

    name: str
    config: RunConfig


def _job(optimizer: str, **changes: Any) -> RunConfig:
    """Short jobs, SGD at 0.05 and Adam at RunConfig's default lr 0.01, one thread per rank."""
    base = dict(steps=8, optimizer=optimizer, lr={"sgd": 0.05, "adam": 0.01}[optimizer], global_batch_size=64,
                threads_per_rank=1)
    return RunConfig(**{**base, **changes})


def _cases() -> list[Case]:
    char = dict(model="charformer", dataset="text", model_size=32, global_batch_size=16)
    moe = dict(model="moe", dataset="text", model_size=32, global_batch_size=32)  # 4 experts, top 2, dropless
    deep = dict(model_depth=8, steps=6)  # every schedule's stages hold two Linear layers
    out: list[Case] = []
    for opt in ("sgd", "adam"):
        add = [
            *((f"{t} w2", _job(opt, tier=t, world_size=2)) for t in ("dp", "ddp-naive", "ddp", "zero")),
            ("rpc w2 sync", _job(opt, tier="rpc", world_size=2, tier_options=rpc.Options())),
            *((f"pipeline {s} w2 mlp-8", _job(opt, tier="pipeline", world_size=2, **deep,
                                               tier_options=pipeline.Options(schedule=s, microbatches=4)))
              for s in pipeline.SCHEDULES),
            ("fsdp w2", _job(opt, tier="fsdp", world_size=2)),
            ("multinode w2", _job(opt, tier="multinode", world_size=2,
                                  tier_options=multinode.Options(nnodes=2, network="loopback"))),
            ("ft 2x1", _job(opt, tier="ft", world_size=2, tier_options=ft.Options())),
            ("diloco 2x1 H=4", _job(opt, tier="diloco", world_size=2,
                                    tier_options=diloco.Options(sync_every=4))),
            ("tp w2 mlp", _job(opt, tier="tp", world_size=2)),
            ("tp w2 charformer", _job(opt, tier="tp", world_size=2, **char)),
            ("fsdp-tp 2x2 charformer", _job(opt, tier="fsdp-tp", world_size=4, **char,
                                            tier_options=fsdp_tp.Options(sequence_parallel=opt == "adam"))),
            ("cp w2 charformer", _job(opt, tier="cp", world_size=2, **char)),
            ("ep w2 moe", _job(opt, tier="ep", world_size=2, **moe)),
            ("nd pp2 tp2 charformer", _job(opt, tier="nd", world_size=4, **char,
                                           tier_options=nd.Options(pp=2, dp=1, tp=2, microbatches=2))),
        ]
        if opt == "sgd":  # Adam: the restarted run below (torchrun's start is the cost: about 7 s a run)
            add.append(("elastic w2", _job(opt, tier="elastic", world_size=2)))
        out += [Case(f"{name} {opt}", cfg) for name, cfg in add]
    adam = [
        ("ddp w4", _job("adam", tier="ddp", world_size=4)),
        ("zero w2 bucket view", _job("adam", tier="zero", world_size=2,
                                     tier_options=zero.Options(parameters_as_bucket_view=True))),
        ("elastic w2 restart", _job("adam", tier="elastic", world_size=2,  # resumes from its step-4 snapshot
                                    tier_options=elastic.Options(snapshot_every=4, faults=("exception:6:1",)))),
        ("fsdp w2 charformer", _job("adam", tier="fsdp", world_size=2, **char)),
        ("fsdp hsdp 2x2", _job("adam", tier="fsdp", world_size=4, tier_options=fsdp.Options(replicate=2))),
        ("ddp w2 moe", _job("adam", tier="ddp", world_size=2, **moe)),
        ("ddp w2 moe-64", _job("adam", tier="ddp", world_size=2, **{**moe, "model_size": 64})),
        ("ep w2 moe-64", _job("adam", tier="ep", world_size=2, **{**moe, "model_size": 64})),
        ("fsdp w2 moe", _job("adam", tier="fsdp", world_size=2, **moe)),
        ("ep w4 moe", _job("adam", tier="ep", world_size=4, **moe, tier_options=ep.Options())),
        ("tp w2 charformer sp+lp", _job("adam", tier="tp", world_size=2, **char,
                                        tier_options=tp.Options(sequence_parallel=True, loss_parallel=True))),
        ("tp w2 charformer b16 12 steps", _job("adam", tier="tp", world_size=2, **{**char, "model_size": 64},
                                               steps=12)),
        ("pipeline gpipe w2 charformer", _job("adam", tier="pipeline", world_size=2, **char,
                                              tier_options=pipeline.Options(schedule="gpipe", microbatches=2))),
        ("nd dp2 tp2 1f1b charformer", _job("adam", tier="nd", world_size=4, **char,
                                            tier_options=nd.Options(pp=1, dp=2, tp=2, schedule="1f1b",
                                                                    microbatches=2))),
        ("cp w2 zigzag charformer", _job("adam", tier="cp", world_size=2, **char,
                                         tier_options=cp.Options(balance="zigzag"))),
        ("cp w2 ulysses charformer", _job("adam", tier="cp", world_size=2, **char,
                                          tier_options=cp.Options(method="ulysses"))),
        ("cp w4 zigzag charformer", _job("adam", tier="cp", world_size=4, **char,
                                         tier_options=cp.Options(balance="zigzag"))),
        ("cp w4 ulysses zigzag charformer 4 heads", _job("adam", tier="cp", world_size=4, **char, model_heads=4,
                                                         tier_options=cp.Options("ulysses", "zigzag"))),
        ("tp w2 mlp decomposed", _job("adam", tier="tp", world_size=2, tier_options=tp.Options(decomposed_mlp=True))),
        ("tp w2 charformer decomposed", _job("adam", tier="tp", world_size=2, **char,
                                             tier_options=tp.Options(decomposed_mlp=True))),
    ]
    # Muon at Adam's lr: whole matrices on every rank (ddp), on their owners (zero, fsdp)
    muon = [(f"{tier} w{n}", _job("adam", tier=tier, world_size=n).replace(optimizer="muon"))
            for tier, n in (("ddp", 2), ("zero", 4), ("fsdp", 2), ("fsdp", 4))]
    return out + [Case(f"{name} adam", cfg) for name, cfg in adam] + [Case(f"{name} muon", cfg) for name, cfg in muon]


CASES: tuple[Case, ...] = tuple(_cases())


def case(name: str) -> Case:
    """The case called ``name`` (KeyError naming the choices otherwise)."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no parity case {name!r}; choose from: {', '.join(c.name for c in CASES)}")


def diloco_reference(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """DiLoCo on one process: each replica group's inner steps on its share of every global batch, and every
    ``sync_every`` steps the outer Nesterov SGD step on the replicas' mean pseudo-gradient (torchft's order)."""
    o = cfg.tier_options
    if o.ranks_per_replica != 1 or o.fragments != 1 or o.faults:
        raise ValueError("diloco_reference computes one rank per replica group, one fragment, no faults")
    model, data = build_job(cfg, torch.device("cpu"))
    replicas = [copy.deepcopy(model) for _ in range(o.replicas)]
    inner = [make_optimizer(cfg, m) for m in replicas]
    outer = torch.optim.SGD(model.parameters(), lr=o.outer_lr, momentum=o.outer_momentum, nesterov=True)
    shares = [datasets.ShardedBatches(len(data), cfg.global_batch_size, r, o.replicas, cfg.seed)
              for r in range(o.replicas)]
    for step in range(cfg.steps):
        for m, opt, share in zip(replicas, inner, shares):
            idx = share.indices(step)
            models.training_loss(m, m(data.train_x[idx]), data.train_y[idx]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % o.sync_every == 0:
            with torch.no_grad():
                for p, *local in zip(model.parameters(), *(m.parameters() for m in replicas)):
                    p.grad = sum(p - q for q in local) / o.replicas  # the all-reduced pseudo-gradient
            outer.step()
            outer.zero_grad(set_to_none=True)
            for m in replicas:
                m.load_state_dict(model.state_dict())
    return model.state_dict()


def reference(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """What ``cfg`` must train to: ``single`` on the same job (``diloco``: ``diloco_reference``)."""
    if cfg.tier == "diloco":
        return diloco_reference(cfg)
    return run(cfg.replace(tier="single", world_size=1), progress=False).params()


def gap(cfg: RunConfig, dtype: str, references: dict[RunConfig, dict[str, torch.Tensor]] | None = None
        ) -> dict[str, Any]:
    """Run ``cfg`` in ``dtype`` and its reference (kept in ``references`` for the next case on the same job)."""
    cfg = cfg.replace(dtype=dtype)
    key = cfg.replace(tier="single", world_size=1) if cfg.tier != "diloco" else cfg
    t0 = time.perf_counter()
    cache = {} if references is None else references
    if key not in cache:
        cache[key] = reference(cfg)
    ref = cache[key]
    result = run(cfg, progress=False)
    diff = max_param_diff(result.params(), ref)
    largest = max(t.double().abs().max().item() for t in ref.values() if t.is_floating_point())
    dtypes = sorted({str(t.dtype) for t in result.params().values() if t.is_floating_point()})
    return {"tier": cfg.tier, "world_size": cfg.world_size, "optimizer": cfg.optimizer, "lr": cfg.lr,
            "steps": cfg.steps, "dtype": dtype, "gap": diff, "ulps": diff / (torch.finfo(getattr(torch, dtype)).eps
                                                                              * largest),
            "param_dtypes": ",".join(dtypes), "seconds": time.perf_counter() - t0}


def measure(cases: Iterable[Case] = CASES, dtypes: Sequence[str] = ("float32", "float64")) -> pd.DataFrame:
    """One row per case and dtype: ``gap``'s columns and the case's name."""
    references: dict[RunConfig, dict[str, torch.Tensor]] = {}
    return pd.DataFrame([{"case": c.name, **gap(c.config, d, references)} for c in cases for d in dtypes])


def wide(frame: pd.DataFrame) -> pd.DataFrame:
    """``measure``'s rows side by side: one row per case, gap and ulps per dtype."""
    table = frame.pivot(index="case", columns="dtype", values=["gap", "ulps"])
    table.columns = [f"{what}_{dtype}" for what, dtype in table.columns]
    return table.reindex(list(dict.fromkeys(frame["case"])))


def by_tier(frame: pd.DataFrame) -> pd.DataFrame:
    """``measure``'s rows per tier: how many cases, and the largest gap per dtype and optimizer."""
    table = frame.pivot_table(index="tier", columns=["dtype", "optimizer"], values="gap", aggfunc="max")
    table.columns = [f"{dtype} {opt}" for dtype, opt in table.columns]
    table.insert(0, "cases", frame.groupby("tier")["case"].nunique())
    return table.reindex(list(dict.fromkeys(frame["tier"])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.parity", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated case names (default: every case)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated: float32, float64")
    p.add_argument("--csv", default="", help="also write the long table (one row per case and dtype) here")
    p.add_argument("--by-tier", action="store_true", help="one row per tier (the largest gaps) after the cases")
    args = p.parse_args(argv)
    try:
        cases = [case(n.strip()) for n in args.only.split(",") if n.strip()] or list(CASES)
    except KeyError as exc:
        print(f"error: --only: {exc.args[0]}", file=sys.stderr)
        return 2
    frame = measure(cases, [d.strip() for d in args.dtypes.split(",") if d.strip()])
    if args.csv:
        frame.to_csv(args.csv, index=False)
    with pd.option_context("display.width", 200, "display.max_rows", None, "display.float_format", "{:.3g}".format):
        print(wide(frame).to_string())
        if args.by_tier:
            print(by_tier(frame).to_string())
    worst = frame[frame["dtype"] == "float64"]["gap"].max() if "float64" in set(frame["dtype"]) else 0.0
    return 0 if not worst > FLOAT64_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
