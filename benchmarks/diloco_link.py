"""DDP against DiLoCo over a slow link, like for like: the held-out loss of the model kept, the same samples.

Two simulated hosts (network namespaces, ``tc tbf`` caps of 200 Mbit/s and 10 Gbit/s), one rank each: DDP (the
``multinode`` tier) and DiLoCo (the ``diloco`` tier, two replica groups, each on half of every global batch) with
H = sync_every = 5, 20, 50, streaming (H = 20 in 2 fragments) and, at H = 20, pseudo-gradients sent as bf16, int8
and fp8 codes. The job: an MLP of width 512 and depth 2 (1.2 MB of parameters), global batch 64, Adam, N = 100
steps for every run: the same 6,400 samples (a DiLoCo step is both groups' halves of one global batch).

Every run is judged by the held-out loss of the model a user would keep: DiLoCo's model right after each
synchronisation (``evaluate_syncs``), DDP's after every 5 steps (``dtlab.read.diloco.ddp_curve``: the job
replayed here, checked against the run's own final evaluation). The target is DDP's held-out loss after its N
steps on the same link and seed; each run's time to quality is its training time to the first evaluation at or
below it (``first_reach``, not interpolated), "not reached" when none is. Seeds 0, 1, 2 run interleaved (one
round per seed, the variants' order reversed every other round); ``/proc/loadavg`` is recorded around each run.

Learning rates: ``--sweep`` runs seed 0 at 10 Gbit/s only (DDP's lr over ``DDP_LRS``; DiLoCo H = 20's inner lr
over ``INNER_LRS`` and outer lr over ``OUTER_LRS``; then H = 5's and H = 50's outer lr at that inner lr), keeps
each lowest final held-out loss and writes ``diloco_link_sweep.csv``; the main run reads it from ``--out`` (or
runs the defaults, and says so).

Target, at 200 Mbit/s: DiLoCo at its best H (lowest median time ratio over the seeds) reaches DDP's held-out
loss in at most 0.5 of the training time DDP takes to first reach it, on every seed (``diloco_link.time_to_quality``).
The bytes per step against DDP's are reported beside their arithmetic (``encoded_bytes`` / H), not as a target.
The run fails (exit 1) when its own checks fail: unequal sample budgets, or a DDP replay that ends away from its
run. Writes ``diloco_link.csv`` (one row per seed and run), ``diloco_link_curves.csv`` and ``diloco_link.png``.
Needs root; elsewhere it prints why and measures nothing.

    .venv/bin/python benchmarks/diloco_link.py [--quick] [--sweep] [--out results/bench] [--repeats SEEDS]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common
import pandas as pd

from dtlab import plots
from dtlab.core.config import RunConfig
from dtlab.core.quantise import encoded_bytes
from dtlab.launch import netns
from dtlab.read import diloco as judge
from dtlab.tiers import diloco, multinode
from dtlab.train import run

NAME = "diloco_link"
SLOW, FAST = 200.0, 10_000.0  # Mbit/s
EVAL_EVERY = 5  # DDP's evaluations, in steps: every DiLoCo synchronisation falls on one
DDP_LRS = (0.0003, 0.001, 0.003, 0.01)
INNER_LRS = (0.0003, 0.001, 0.003, 0.01)
OUTER_LRS = (0.05, 0.1, 0.2, 0.4, 0.7)
DEFAULT_LRS = {"ddp_lr": 0.003, "inner_lr": 0.003, "outer_lr": 0.7}
BOUND = judge.BOUND


@dataclass(frozen=True)
class Variant:
    """One run of the comparison: DDP (h = 0) or DiLoCo, on a link."""

    name: str
    mbit: float
    h: int = 0
    fragments: int = 1
    dtype: str = "fp32"

    @property
    def is_ddp(self) -> bool:
        return self.h == 0


def variants(quick: bool) -> list[Variant]:
    if quick:
        return [Variant("ddp@200", SLOW), Variant("diloco_h5@200", SLOW, 5), Variant("diloco_h5_int8@200", SLOW, 5,
                                                                                    dtype="int8")]
    slow = [Variant("ddp@200", SLOW)] + [Variant(f"diloco_h{h}@200", SLOW, h) for h in (5, 20, 50)]
    slow += [Variant("diloco_h20_stream2@200", SLOW, 20, fragments=2)]
    slow += [Variant(f"diloco_h20_{d}@200", SLOW, 20, dtype=d) for d in ("bf16", "int8", "fp8")]
    return slow + [Variant("ddp@10000", FAST), Variant("diloco_h20@10000", FAST, 20)]


def config(v: Variant, quick: bool, seed: int, lrs: Mapping[str, Any]) -> RunConfig:
    job = dict(world_size=2, model="mlp", model_size=256 if quick else 512, model_depth=2, dataset="synthetic",
               dataset_size=4096, global_batch_size=64, optimizer="adam", threads_per_rank=1, seed=seed,
               steps=20 if quick else 100)
    if v.is_ddp:
        return RunConfig(tier="multinode", **job, lr=lrs["ddp_lr"],
                         tier_options=multinode.Options(nnodes=2, network="netns", link_mbit=v.mbit))
    outer = lrs.get("outer_by_h", {}).get(v.h, lrs["outer_lr"])  # H = 20's for streaming and quantised runs
    return RunConfig(tier="diloco", **job, lr=lrs["inner_lr"], tier_options=diloco.Options(
        sync_every=v.h, fragments=v.fragments, outer_lr=outer, outer_comm_dtype=v.dtype, evaluate_syncs=True,
        network="netns", link_mbit=v.mbit))


def payload_per_step(result: Any) -> float:
    """Bytes one rank puts on the link per step: DDP's all-reduced gradients; DiLoCo's pseudo-gradients, its own
    codes once (a quantised average is an all-gather, recorded with every group's codes)."""
    ev = result.events_frame()
    ev = ev[(ev["rank"] == 0) & (ev["step"] >= 0) & ev["op"].isin(["all_reduce", "all_gather"])]
    if result.config.tier == "diloco":
        ev = ev[ev["tag"] == "ft_cross_replica"]
    own = ev["bytes"].where(ev["op"] == "all_reduce", ev["bytes"] / ev["group_size"])
    return float(own.sum()) / result.config.steps


def arithmetic_ratio(v: Variant, numel: int) -> float:
    """What the bytes ratio must be: one model's codes every H steps against one fp32 model every step."""
    return 1.0 if v.is_ddp else encoded_bytes(numel, v.dtype) / (4 * numel * v.h)


def measure(v: Variant, cfg: RunConfig, curves: dict) -> dict[str, Any]:
    before = common_load()
    result = run_once_more(cfg)
    if v.is_ddp:
        curve, gap = judge.ddp_curve(result, range(EVAL_EVERY, cfg.steps + 1, EVAL_EVERY))
    else:
        curve, gap = judge.diloco_curve(result), math.nan
    curves[(cfg.seed, v.name)] = curve
    numel = sum(t.numel() for t in result.params().values())
    return {"seed": cfg.seed, "link_mbit": v.mbit, "h": v.h, "fragments": v.fragments, "comm_dtype": v.dtype,
            "lr": cfg.lr, "outer_lr": cfg.tier_options.outer_lr if not v.is_ddp else "",
            "samples": int(curve["samples"].iloc[-1]), "train_s": float(curve["time_s"].iloc[-1]),
            "step_s": common.steady_step_s(result), "heldout_final": float(curve["heldout_loss"].iloc[-1]),
            "payload_bytes_per_step": payload_per_step(result), "bytes_ratio_arithmetic": arithmetic_ratio(v, numel),
            "replay_gap": gap, "loadavg_before": before, "loadavg_after": common_load()}


def run_once_more(cfg: RunConfig) -> Any:
    """The run; run again once if it failed (a run killed from outside on a shared machine), saying so."""
    try:
        return run(cfg, progress=False)
    except (RuntimeError, OSError) as exc:  # RankError is a RuntimeError
        common.note(f"{cfg.tier} seed {cfg.seed} failed ({str(exc).splitlines()[0]}): running it again")
        return run(cfg, progress=False)


def common_load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def judge_seed(rows: list[dict[str, Any]], curves: Mapping[tuple[int, str], pd.DataFrame]) -> list[str]:
    """Fill each row of one seed with its target, time to it and ratios; return the seed's consistency problems."""
    seed = rows[0]["seed"]
    by_name = {r["variant"]: r for r in rows}
    mine = {name: curves[(seed, name)] for name in by_name}
    problems = [f"seed {seed}: {p}" for p in judge.consistency_problems(
        mine, {n: r["replay_gap"] for n, r in by_name.items() if r["h"] == 0})]
    for row in rows:
        ddp = by_name.get(f"ddp@{row['link_mbit']:g}")
        if ddp is None:
            problems.append(f"seed {seed}: no DDP run at {row['link_mbit']:g} Mbit/s to compare {row['variant']}")
            continue
        target = ddp["heldout_final"]
        reached = judge.first_reach(mine[row["variant"]], target)
        ddp_time = judge.first_reach(mine[ddp["variant"]], target)
        row.update(target_heldout=target, time_to_target_s=reached, ddp_time_to_target_s=ddp_time,
                   time_ratio=reached / ddp_time, reached=judge.reached_text(reached),
                   bytes_ratio=row["payload_bytes_per_step"] / ddp["payload_bytes_per_step"])
    return problems


def read_lrs(out: Path) -> tuple[dict[str, Any], str]:
    """The sweep's choices: DDP's lr, DiLoCo's inner lr (at H = 20) and its outer lr per H (H = 20's for the
    streaming and quantised runs)."""
    path = out / f"{NAME}_sweep.csv"
    if not path.exists():
        return dict(DEFAULT_LRS), f"untuned defaults (no {path}: run --sweep first)"
    chosen = pd.read_csv(path).query("chosen")
    ddp, h20 = chosen[chosen["h"] == 0].iloc[0], chosen[chosen["h"] == 20].iloc[0]
    outer = {int(r["h"]): float(r["outer_lr"]) for _, r in chosen[chosen["h"] > 0].iterrows()}
    return ({"ddp_lr": float(ddp["lr"]), "inner_lr": float(h20["lr"]), "outer_lr": float(h20["outer_lr"]),
             "outer_by_h": outer}, f"tuned at 10 Gbit/s, seed 0 ({path})")


def _sweep_runs(args: Any, v: Variant, grid: list[dict[str, float]]) -> list[dict[str, Any]]:
    rows = [{"variant": v.name, **measure(v, config(v, args.quick, 0, {**DEFAULT_LRS, **lrs}), {})} for lrs in grid]
    best = min(rows, key=lambda r: r["heldout_final"])
    for r in rows:
        r["chosen"] = r is best
    common.note(f"chosen: {v.name} lr={best['lr']} outer_lr={best['outer_lr']} held-out {best['heldout_final']:.4f}")
    return rows


def sweep(args: Any) -> None:
    """Seed 0 at 10 Gbit/s, the lowest final held-out loss: DDP's lr; DiLoCo H = 20's inner and outer lr; then
    the outer lr of H = 5 and H = 50 at H = 20's inner lr."""
    rows = _sweep_runs(args, Variant("ddp@10000", FAST), [{"ddp_lr": lr} for lr in DDP_LRS])
    h20 = _sweep_runs(args, Variant("diloco_h20@10000", FAST, 20),
                      [{"inner_lr": lr, "outer_lr": outer} for lr in INNER_LRS for outer in OUTER_LRS])
    inner = next(r["lr"] for r in h20 if r["chosen"])
    rows += h20
    for h in (5, 50):
        rows += _sweep_runs(args, Variant(f"diloco_h{h}@10000", FAST, h),
                            [{"inner_lr": inner, "outer_lr": outer} for outer in OUTER_LRS])
    common.write_csv(args.out / f"{NAME}_sweep.csv", rows)


def figure(curves: Mapping[tuple[int, str], pd.DataFrame], out: Path) -> None:
    shown = {name: c.assign(loss=c["heldout_loss"]) for (seed, name), c in curves.items()
             if seed == min(s for s, _ in curves) and name.endswith("@200")}
    fig = plots.loss_vs_time(shown)
    target = float(shown["ddp@200"]["heldout_loss"].iloc[-1])  # what DDP holds after its N steps: the target
    for ax in fig.axes[:2]:
        ax.set_title(ax.get_title().replace("loss", "held-out loss"))
        ax.axhline(target, color="0.4", lw=0.8, ls=":")
    fig.axes[0].set(ylabel="held-out loss (model kept)", xlabel="step (64 samples each, every run)")
    plots.save(fig, out / f"{NAME}.png")


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--sweep", action="store_true", help="tune the learning rates at 10 Gbit/s on seed 0")
    args = common.parse(p)
    ok, reason = netns.available()
    if not ok:
        common.note(f"not measured: {reason}")
        common.result_line(f"{NAME}.time_to_quality", float("nan"), "none: needs root", quick=args.quick,
                           detail=reason)
        return
    if args.sweep:
        return sweep(args)
    lrs, tuned = (dict(DEFAULT_LRS), "untuned defaults (quick)") if args.quick else read_lrs(args.out)
    common.note(f"learning rates: {lrs}, {tuned}")
    curves: dict = {}
    runs = {v.name: (lambda seed, v=v: measure(v, config(v, args.quick, seed, lrs), curves))
            for v in variants(args.quick)}
    rows = common.interleave(runs, common.repeats(args, full=3, quick=1), warmup_rounds=0, log=common.note)
    problems = [p for s in sorted({r["seed"] for r in rows}) for p in judge_seed([r for r in rows if r["seed"] == s],
                                                                                  curves)]
    common.write_csv(args.out / f"{NAME}.csv", rows)
    common.write_csv(args.out / f"{NAME}_curves.csv", [{"seed": s, "variant": n, **row} for (s, n), c in
                                                       curves.items() for row in c.to_dict("records")])
    figure(curves, args.out)
    report(rows, tuned, args.quick)
    if problems:
        sys.exit(f"{NAME}: the comparison is not like for like: " + "; ".join(problems))


def report(rows: list[dict[str, Any]], tuned: str, quick: bool) -> None:
    h = judge.best_h(rows, SLOW)
    ratios = [r["time_ratio"] for r in rows if r["variant"] == h]
    verdict = judge.verdict(ratios, BOUND)
    per_seed = ", ".join(f"seed {r['seed']}: {r['reached']} / DDP {judge.reached_text(r['ddp_time_to_target_s'])}"
                         for r in rows if r["variant"] == h)
    common.result_line(f"{NAME}.time_to_quality", max(ratios), f"<= {BOUND} on every seed", quick=quick,
                       passed=verdict["met"], detail=f"{h}: time to DDP's final held-out loss / DDP's time to it, "
                       f"worst seed ({per_seed}); lrs {tuned}")
    dl = next(r for r in rows if r["variant"] == h)
    common.result_line(f"{NAME}.bytes", dl["bytes_ratio"], f"none: the arithmetic gives "
                       f"{dl['bytes_ratio_arithmetic']:.4f}", quick=quick,
                       detail=f"{h} / DDP payload bytes per step (recorded)")


if __name__ == "__main__":
    main()
