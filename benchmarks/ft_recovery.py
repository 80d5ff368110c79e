"""Time lost per fault: one SIGKILL at the same step under torchelastic (``elastic``) and under torchft (``ft``).

The same job -- two data-parallel ranks (elastic) or two replica groups of one
rank (ft), an MLP of width 64, 40 steps of Adam -- runs with and without
``kill`` of rank / replica group 1 at step 12, interleaved per round: elastic
clean, elastic killed, ft clean, ft killed (reversed every other round). The
time a fault costs is the killed run's training span (first to last finished
step, from the run's events) minus the clean run's of the same round; the
steps redone are read from the events too (elastic: since the last snapshot,
every 5 steps; ft: the steps the live group ran again). Target: ft loses at
most 1/5 of what elastic loses (median over rounds of the per-round ratio).

    .venv/bin/python benchmarks/ft_recovery.py [--quick] [--out results/bench] [--repeats ROUNDS]
"""

from __future__ import annotations

import _common as common

from dtlab.analysis import elastic as elastic_runs
from dtlab.analysis import ft as ft_runs
from dtlab.core.config import RunConfig
from dtlab.tiers import elastic, ft
from dtlab.train import run

NAME = "ft_recovery"
FAULT_STEP = 12


def _span(events: list[dict], kind: str) -> float:
    """Seconds from the first finished training step to the last, as the run's events tell."""
    done = [e["time"] for e in events if e["kind"] == kind and e.get("committed", True)]
    return max(done) - min(done)


def variants(steps: int) -> dict:
    job = dict(world_size=2, model_size=64, steps=steps, optimizer="adam", threads_per_rank=1)
    cfgs = {"elastic": RunConfig(tier="elastic", **job, tier_options=elastic.Options()),
            "elastic_killed": RunConfig(tier="elastic", **job,
                                        tier_options=elastic.Options(faults=(f"sigkill:{FAULT_STEP}:1",))),
            "ft": RunConfig(tier="ft", **job, tier_options=ft.Options()),
            "ft_killed": RunConfig(tier="ft", **job, tier_options=ft.Options(faults=(f"kill:{FAULT_STEP}:1",)))}

    def measure(name: str, cfg: RunConfig) -> dict:
        result = run(cfg, progress=False)
        if cfg.tier == "elastic":
            span = _span(result.run_events, "step")
            redone = elastic_runs.restart(result)["recomputed_steps"] if "killed" in name else 0
        else:
            span = _span(result.run_events, "ft_step")
            redone = ft_runs.recovery(result)[0]["redone_steps"] if "killed" in name else 0
            if result.ranks[0].strategy["replicas_max_param_diff"] != 0.0:
                raise RuntimeError(f"{name}: the replica groups ended with different parameters")
        return {"span_s": span, "wall_s": result.wall_s, "redone_steps": redone}

    return {name: (lambda _r, name=name, cfg=cfg: measure(name, cfg)) for name, cfg in cfgs.items()}


def main() -> None:
    args = common.parse(common.parser(__doc__))
    rows = common.interleave(variants(16 if args.quick else 40), common.repeats(args, full=5, quick=1),
                             warmup_rounds=0 if args.quick else 1, log=common.note)
    for row in rows:  # the time this round's fault cost: killed span minus the clean span of the same round
        clean = next(r for r in rows if r["round"] == row["round"] and r["variant"] == row["variant"].split("_")[0])
        row["lost_s"] = row["span_s"] - clean["span_s"] if row["variant"].endswith("_killed") else 0.0
    common.write_csv(args.out / f"{NAME}.csv", rows)
    ratios = common.ratios(rows, "ft_killed", "elastic_killed", "lost_s")
    ratio = common.median(ratios)
    lost = {v: common.median(r["lost_s"] for r in rows if r["variant"] == v and r["round"] >= 0)
            for v in ("elastic_killed", "ft_killed")}
    redone = {v: common.median(r["redone_steps"] for r in rows if r["variant"] == v and r["round"] >= 0)
              for v in ("elastic_killed", "ft_killed")}
    common.result_line(NAME, ratio, "<= 0.2", quick=args.quick, passed=ratio <= 0.2,
                       detail=f"ft / elastic time lost per SIGKILL at step {FAULT_STEP}: {common.ratio_text(ratios)}; "
                              f"medians: elastic {lost['elastic_killed']:.2f} s and {redone['elastic_killed']:g} "
                              f"steps redone, ft {lost['ft_killed']:.2f} s and {redone['ft_killed']:g} step(s) redone")


if __name__ == "__main__":
    main()
