"""Run several tiers on one job and compare them with ``single``.

    python -m dtlab.experiments.compare [--tiers single,ddp,...] [--world-sizes 2] [--steps 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dtlab import plots, tiers
from dtlab.core.config import RunConfig
from dtlab.core.results import RunResult
from dtlab.read.frames import breakdown_frame, memory_frame
from dtlab.train import run


def compare(base: RunConfig, tier_names: list[str], world_sizes: list[int], *, out_dir: Path | None = None,
            progress: bool = True, results: list[RunResult] | None = None) -> Any:
    """One row per (tier, world size); ``single`` runs once, at world size 1, as the baseline.

    Every configuration is validated before the first run starts, so a bad
    tier or world size fails at once rather than after minutes of training.
    Pass a list as ``results`` to get the RunResults too. With ``out_dir`` the
    table, each run's files and the figures (``figures``) are written there.
    """
    import pandas as pd

    for name in tier_names:
        tiers.get(name)
    jobs = [base.replace(tier="single", world_size=1)]
    for name in tier_names:
        if name != "single":
            jobs += [base.replace(tier=name, world_size=w) for w in world_sizes]
    baseline: RunResult | None = None
    rows = []
    done: list[RunResult] = [] if results is None else results
    for cfg in jobs:
        result = run(cfg, progress=progress)
        done.append(result)
        baseline = baseline or result
        s = result.summary()
        comm = s["comm"]
        rows.append({
            "tier": cfg.tier, "world_size": cfg.world_size, "median_step_ms": s["median_step_s"] * 1e3,
            "samples_per_s": s["samples_per_s"], "speedup": baseline.median_step_s() / s["median_step_s"],
            "final_loss": s["final_loss"], "test_accuracy": s.get("test_accuracy"),
            "max_param_diff_vs_single": result.max_param_diff(baseline),
            "collectives_per_step": sum(v["calls_per_step"] for v in comm.values()),
            "comm_bytes_rank0": sum(v["bytes"] for v in comm.values()),
            "optimizer_state_bytes_max": s["memory_max_over_ranks"].get("optimizer_state", 0),
        })
    table = pd.DataFrame(rows)
    if out_dir is not None:
        save_comparison(out_dir, table, done)
    return table


def figure_data(table: Any, results: list[RunResult]) -> dict[str, Any]:
    """The frame each figure of a comparison draws, by figure name (saved as NAME.csv beside NAME.png)."""
    import pandas as pd

    losses = pd.DataFrame([{"run": r.label, "step": int(step), "loss": float(loss)}
                           for r in results for step, loss in r.loss_curve().items()])
    return {"speedup": table[["tier", "world_size", "samples_per_s"]],
            "breakdown": breakdown_frame(results),
            "memory": memory_frame(results, ranks=2),
            "loss": losses}


def figures(table: Any, results: list[RunResult]) -> dict[str, Any]:
    """Speedup, step-time breakdown, memory and loss curves of a comparison."""
    return draw(figure_data(table, results))


def draw(data: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``figure_data``'s frames, by the same names."""
    curves = {run: part.set_index("step")["loss"] for run, part in data["loss"].groupby("run", sort=False)}
    return {
        "speedup": plots.speedup(data["speedup"]),
        "breakdown": plots.step_breakdown(data["breakdown"]),
        "memory": plots.memory_breakdown(data["memory"]),
        "loss": plots.loss_curves(curves),
    }


def save_comparison(folder: Path, table: Any, results: list[RunResult]) -> None:
    """One folder per run, ``compare.csv``, and each figure as NAME.png with the data it draws as NAME.csv."""
    folder.mkdir(parents=True, exist_ok=True)
    for result in results:
        result.save(folder / f"{result.config.tier}-w{result.config.world_size}")
    table.to_csv(folder / "compare.csv", index=False)
    data = figure_data(table, results)
    for name, fig in draw(data).items():
        data[name].to_csv(folder / f"{name}.csv", index=False)
        plots.save(fig, folder / f"{name}.png")


def format_table(table: Any) -> str:
    fmt = {"median_step_ms": "{:.2f}".format, "samples_per_s": "{:.0f}".format, "speedup": "{:.2f}".format,
           "final_loss": "{:.4f}".format, "test_accuracy": "{:.3f}".format,
           "max_param_diff_vs_single": "{:.1e}".format, "collectives_per_step": "{:.1f}".format}
    return table.to_string(index=False, formatters=fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.compare", description=__doc__.split("\n")[0])
    p.add_argument("--tiers", default="single,dp,ddp-naive,ddp,zero", help="comma-separated tier names")
    p.add_argument("--world-sizes", default="2", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=None, help="folder for compare.csv, each run and the figures")
    args = p.parse_args(argv)
    names = [t for t in args.tiers.split(",") if t.strip()]
    sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    table = compare(RunConfig(steps=args.steps), names, sizes, out_dir=args.out)
    print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
