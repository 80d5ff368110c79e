"""``make figures`` (``python -m dtlab.app.figures``): regenerate the figures the README and docs/ show.

``FIGURES`` is the one table of them: each file under ``docs/figures/`` with the
command that makes it (as the pages give it) and the file that command writes.
The runner runs each command once, in the checkout's root with this
interpreter, and copies what it wrote over the docs' copy. A command that wrote
nothing (``benchmarks/link_sweep.py`` without root measures nothing) leaves the
old copy, and says so. ``tests/test_docs.py`` checks that every image a page
shows is in the table and that each command is given on a page.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["FIGURES", "Figure", "commands", "main", "regenerate"]


@dataclass(frozen=True)
class Figure:
    command: str  # as docs/measurement.md gives it; "python" is run as this interpreter
    writes: str  # the file the command writes, relative to the checkout's root


DEMO_COMPARE = ("python -m dtlab compare --tiers single,dp,ddp-naive,ddp,zero --world-sizes 2 --steps 60 "
                "--out results/demo")
WIDTH_SWEEPS = "python -m dtlab.experiments.speedup --runs 3 --out results/speedup"  # the figure is run 3's
OVERHEAD = "python benchmarks/instrument_overhead.py"
COSTMODEL = "python benchmarks/costmodel_error.py"  # writes into results/bench, the benchmarks' default
LINK_SWEEP = "python benchmarks/link_sweep.py"
PIPELINE_BUBBLE = "python -m dtlab.experiments.schedules --rounds 3 --csv results/pipeline/pipeline_bubble.csv"
DILOCO_LINK = "python benchmarks/diloco_link.py"  # reads the learning rates DILOCO_SWEEP chose (run it first)
DILOCO_SWEEP = "python benchmarks/diloco_link.py --sweep"
FT_RECOVERY = "python benchmarks/ft_recovery.py"
ROOFLINE = "python -m dtlab.cost.roofline"
GOODPUT = "python -m dtlab.experiments.goodput"  # writes into results/goodput
PLANNER = "python -m dtlab.cost.planner.validate --out results/planner"
FRONT_DOOR = "python benchmarks/front_door.py"
BUSY = "python -m dtlab.app.busy --hogs 4 --out results/busy"
RECORDER_COST = "python -m dtlab.experiments.recorder_cost --out results/recorder_cost --docs"

FIGURES: dict[str, Figure] = {
    "docs/figures/demo_compare.csv": Figure(DEMO_COMPARE, "results/demo/compare.csv"),
    "docs/figures/front_door.csv": Figure(FRONT_DOOR, "results/bench/front_door.csv"),
    "docs/figures/busy_notebooks.png": Figure(BUSY, "results/busy/busy_notebooks.png"),
    "docs/figures/busy_notebooks.csv": Figure(BUSY, "results/busy/busy_notebooks.csv"),
    "docs/figures/recorder_cost.csv": Figure(RECORDER_COST, "results/recorder_cost/recorder_cost.csv"),
    "docs/figures/demo_speedup.png": Figure(DEMO_COMPARE, "results/demo/speedup.png"),
    "docs/figures/demo_breakdown.png": Figure(DEMO_COMPARE, "results/demo/breakdown.png"),
    "docs/figures/demo_memory.png": Figure(DEMO_COMPARE, "results/demo/memory.png"),
    "docs/figures/demo_loss.png": Figure(DEMO_COMPARE, "results/demo/loss.png"),
    "docs/figures/demo_speedup.csv": Figure(DEMO_COMPARE, "results/demo/speedup.csv"),
    "docs/figures/demo_breakdown.csv": Figure(DEMO_COMPARE, "results/demo/breakdown.csv"),
    "docs/figures/demo_memory.csv": Figure(DEMO_COMPARE, "results/demo/memory.csv"),
    "docs/figures/demo_loss.csv": Figure(DEMO_COMPARE, "results/demo/loss.csv"),
    "docs/figures/demo_crossover.png": Figure(WIDTH_SWEEPS, "results/speedup/crossover.png"),
    "docs/figures/demo_crossover.csv": Figure(WIDTH_SWEEPS, "results/speedup/crossover.csv"),
    "docs/figures/width_sweep_runs.csv": Figure(WIDTH_SWEEPS, "results/speedup/crossover_runs.csv"),
    "docs/figures/instrument_overhead_training.csv": Figure(OVERHEAD, "results/bench/instrument_overhead_training.csv"),
    "docs/figures/roofline.png": Figure(ROOFLINE, "results/roofline/roofline.png"),
    "docs/figures/roofline.csv": Figure(ROOFLINE, "results/roofline/roofline.csv"),
    "docs/figures/costmodel_error.png": Figure(COSTMODEL, "results/bench/costmodel_error.png"),
    "docs/figures/costmodel_error.csv": Figure(COSTMODEL, "results/bench/costmodel_error.csv"),
    "docs/figures/link_sweep.png": Figure(LINK_SWEEP, "results/bench/link_sweep.png"),
    "docs/figures/link_sweep.csv": Figure(LINK_SWEEP, "results/bench/link_sweep.csv"),
    "docs/figures/link_sweep_runs.csv": Figure(LINK_SWEEP, "results/bench/link_sweep_runs.csv"),
    "docs/figures/pipeline_bubble.csv": Figure(PIPELINE_BUBBLE, "results/pipeline/pipeline_bubble.csv"),
    "docs/figures/diloco_link_sweep.csv": Figure(DILOCO_SWEEP, "results/bench/diloco_link_sweep.csv"),
    "docs/figures/diloco_link.png": Figure(DILOCO_LINK, "results/bench/diloco_link.png"),
    "docs/figures/diloco_link.csv": Figure(DILOCO_LINK, "results/bench/diloco_link.csv"),
    "docs/figures/diloco_link_curves.csv": Figure(DILOCO_LINK, "results/bench/diloco_link_curves.csv"),
    "docs/figures/ft_recovery.csv": Figure(FT_RECOVERY, "results/bench/ft_recovery.csv"),
    "docs/figures/ft_recovery.png": Figure(FT_RECOVERY, "results/bench/ft_recovery.png"),
    "docs/figures/ft_recovery_parts.csv": Figure(FT_RECOVERY, "results/bench/ft_recovery_parts.csv"),
    "docs/figures/goodput.png": Figure(GOODPUT, "results/goodput/goodput.png"),
    "docs/figures/goodput.csv": Figure(GOODPUT, "results/goodput/goodput.csv"),
    "docs/figures/planner_validation.png": Figure(PLANNER, "results/planner/planner_validation.png"),
    "docs/figures/planner_validation.csv": Figure(PLANNER, "results/planner/planner_validation.csv"),
}


def commands(only: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Each command, once, in the table's order, with the docs' files it makes; ``only``: file names
    (``demo_crossover.png``, or stems: ``demo_crossover``) whose commands to run (each with all its files:
    they come from one run)."""
    chosen = {path for path in FIGURES
              if not only or Path(path).name in only or Path(path).stem in only}
    unknown = sorted(set(only or ()) - {Path(p).name for p in FIGURES} - {Path(p).stem for p in FIGURES})
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}: choose from {sorted({Path(p).stem for p in FIGURES})}")
    out: dict[str, list[str]] = {}
    for path, fig in FIGURES.items():
        if fig.command in {FIGURES[c].command for c in chosen}:
            out.setdefault(fig.command, []).append(path)
    return out


def _run(command: str) -> int:
    argv = shlex.split(command)
    argv[0] = sys.executable  # "python" as the pages write it: the interpreter that runs this
    print(f"$ {command}", flush=True)
    return subprocess.run(argv, cwd=ROOT, check=False).returncode


def regenerate(only: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """Run the commands and copy their files over the docs' copies: (updated, not updated with why)."""
    if not (ROOT / "docs" / "figures").is_dir():
        raise ValueError(f"no docs/figures under {ROOT}: run from a dtlab checkout")
    updated, kept = [], []
    for command, paths in commands(only).items():
        started = time.time()
        rc = _run(command)
        for path in paths:
            source = ROOT / FIGURES[path].writes
            if rc != 0:
                kept.append(f"{path} (its command exited with {rc})")
            elif not source.exists() or source.stat().st_mtime < started:
                kept.append(f"{path} (the command wrote no {FIGURES[path].writes})")
            else:
                shutil.copyfile(source, ROOT / path)
                updated.append(path)
    return updated, kept


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.app.figures", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated figures to make (e.g. demo_crossover); "
                        "default: all of them")
    parser.add_argument("--list", action="store_true", help="print each figure and its command, run nothing")
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()] or None
    try:
        todo = commands(only)
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        for command, paths in todo.items():
            print(f"{command}\n    " + "\n    ".join(paths))
        return 0
    updated, kept = regenerate(only)
    print(f"updated {len(updated)}: {', '.join(updated) or 'none'}")
    for line in kept:
        print(f"kept the old copy of {line}")
    return 1 if any("exited with" in line for line in kept) else 0


if __name__ == "__main__":
    sys.exit(main())
