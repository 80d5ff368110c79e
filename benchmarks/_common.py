"""What the benchmark scripts share: arguments, interleaving, medians, CSV files and the result line.

Timings on a shared CPU drift by 10-25 % from one run to the next, so a
benchmark never compares two numbers taken minutes apart. It runs its variants
*interleaved* -- A, B, A, B, ... -- in one process, takes the ratio within each
round (A and B ran seconds apart, under the same load) and reports the median
of those per-round ratios.

Every script prints one line ``NAME: measured RATIO (target ...)`` and writes
its raw measurements as CSV into ``--out``. ``--quick`` runs a tiny version
that only checks that the script works; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.app.bench import RESULT
from dtlab.core.config import RunConfig
from dtlab.read.rounds import BOOTSTRAP_MIN_ROUNDS, Interval, median, median_interval, per_round, ratios  # noqa: F401
from dtlab.train import run

DEFAULT_OUT = Path("results/bench")
# Training steps left out of a run's steady state: more than RunResult.steady's default (1), on purpose. A
# benchmark compares two medians within a few percent (ddp_vs_script: >= 0.98), so it waits until caches and the
# allocator have settled; plain_ddp_script.py gets the same count (--warmup), so both sides skip alike.
WARMUP_STEPS = 5


# -- arguments --------------------------------------------------------------------------
def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every benchmark takes; a script may add its own before ``parse``."""
    p = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke mode (< ~20 s): checks that the script works; its numbers mean nothing")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the CSV files (default {DEFAULT_OUT}/)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds to measure (default: the script's own, fewer with --quick)")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats={args.repeats} is invalid: must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def repeats(args: argparse.Namespace, full: int, quick: int = 1) -> int:
    """How many measured rounds: ``--repeats`` if given, else ``quick`` or ``full``."""
    if args.repeats is not None:
        return args.repeats
    return quick if args.quick else full


# -- interleaving ---------------------------------------------------------------------------
def interleave(variants: Mapping[str, Callable[[int], Mapping[str, Any]]], rounds: int, *, warmup_rounds: int = 1,
               log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every variant once per round, round after round: A, B, A, B, ...

    Even rounds run the variants in the given order, odd rounds in reverse
    (A, B, B, A, ...). Each variant is called with the round number and
    returns a dict of measurements. The result is one row per (round, variant): ``round``
    (negative for warm-up rounds, which are kept in the rows but left out by
    ``per_round``), ``order`` (position within the round), ``variant`` and
    the measurements.
    """
    rows: list[dict[str, Any]] = []
    items = list(variants.items())
    for r in range(-warmup_rounds, rounds):
        started = time.perf_counter()
        # A B, then B A: a slowdown or warm-up that follows a variant's place in the round falls on each alike
        for order, (name, fn) in enumerate(items if r % 2 == 0 else items[::-1]):
            rows.append({"round": r, "order": order, "variant": name, **fn(r)})
        if log is not None:
            what = "warm-up round" if r < 0 else f"round {r + 1}/{rounds}"
            log(f"{what} done in {time.perf_counter() - started:.1f} s")
    return rows


def spread(values: Iterable[float]) -> str:
    """``min-max over N`` of per-round values, for the log."""
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return "no values"
    return f"{values[0]:.3f}-{values[-1]:.3f} over {len(values)} rounds"


# -- training runs -------------------------------------------------------------------------
def steady_step_s(result: Any, warmup_steps: int = WARMUP_STEPS) -> float:
    """Median step time of a dtlab RunResult over its steps after ``warmup_steps``.

    ``RunResult.median_step_s`` over ``RunResult.steady(warmup_steps)``: a
    step's time is its slowest rank's, and a short (quick) run keeps at least
    its last step.
    """
    return result.median_step_s(warmup_steps)


def steps_rows(result: Any, **labels: Any) -> list[dict[str, Any]]:
    """The run's per-rank, per-step timings (s) as rows, with ``labels`` on each."""
    return [{**labels, **row} for row in result.steps_frame().to_dict("records")]


# -- output ---------------------------------------------------------------------------------
def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (dicts; the columns are the union of their keys, in first-seen order).

    A list or tuple (bucket sizes) is written as JSON, ``[4000, 4000, 2000]``:
    ``ddp_steps.read_runs`` reads it back as a list of ints.
    """
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), restval="")
        writer.writeheader()
        writer.writerows({k: _cell(v) for k, v in row.items()} for row in rows)
    note(f"wrote {path}")
    return path


def _cell(value: Any) -> Any:
    """A list or tuple as JSON text (not Python's repr); anything else as it is."""
    return json.dumps(list(value), default=str) if isinstance(value, (list, tuple)) else value


def note(message: str) -> None:
    """Progress and details go to stderr; stdout holds only the result lines."""
    print(message, file=sys.stderr, flush=True)


def result_line(name: str, measured: float, target: str, *, quick: bool, detail: str = "",
                passed: bool | None = None) -> str:
    """``NAME: measured RATIO (target ...)``, printed to stdout, and returned.

    ``passed`` (None: the target is informational) adds ``pass`` or ``MISS``;
    in quick mode the line says that the number is not a measurement instead.
    """
    line = f"{name}: measured {measured:.3f} (target {target})"
    if quick:
        line += " [quick smoke run: not a measurement]"
    elif passed is not None:
        line += " pass" if passed else " MISS"
    if detail:
        line += f" -- {detail}"
    if not RESULT.match(line):  # a line the runner cannot read would drop the result and fail the run
        raise ValueError(f"result name {name!r} does not parse: use letters, digits, dots and one [qualifier]")
    print(line, flush=True)
    return line


# -- model sizes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """One size of the MLP a training benchmark measures: width, global batch, steps per run, data set size."""

    name: str
    model_size: int
    global_batch: int
    steps: int
    dataset_size: int = 4096
    quick_steps: int = 8

    def steps_for(self, quick: bool) -> int:
        return self.quick_steps if quick else self.steps

    def label(self, world_size: int) -> str:
        return f"MLP {self.model_size}, batch {self.global_batch} = {world_size} x {self.global_batch // world_size}"


# Small: communication and per-step overhead dominate (steps of a few ms), where a per-call cost shows most.
SMALL = Size("small", model_size=256, global_batch=128, steps=100, quick_steps=10)
# Large: compute-bound steps, as real training has: one thread computes a 512-sample step in 60-80 ms (measured
# on a loaded 2-core machine, where two ranks' steps took 150-450 ms). Fewer steps per run: each costs ten small ones.
LARGE = Size("large", model_size=1024, global_batch=1024, steps=30, dataset_size=16384, quick_steps=6)


# -- per-round ratios -------------------------------------------------------------------------
# Below this many rounds a bootstrap of the median cannot mean its level: from 3 rounds the 5th and 95th
# percentiles of the resampled medians are the smallest and largest round (each is the median of a resample
# with probability 7/27), so a "90 %" interval would be the range of three values, covering the median about
# 75 % of the time. With fewer rounds the interval is called what it is: the rounds' min-max.
def resolution(values: Iterable[float], target: float) -> str:
    """Whether a run's rounds can tell its median from ``target``: a phrase for the detail."""
    interval = median_interval(values)
    if math.isnan(interval.lo):
        return "one round: no interval"
    if interval.lo <= target <= interval.hi:
        return f"the target {target:g} lies inside the {interval.label}: not resolved by this run"
    return f"the {interval.label} excludes the target {target:g}"


def ratio_text(values: Iterable[float]) -> str:
    """``MEDIAN [INTERVAL]`` of per-round ratios, for a result line's detail.

    The interval is ``median_interval``'s under its own label; a bootstrap one
    is followed by the rounds' range, which the min-max label already is.
    """
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return "nan (no rounds)"
    interval = median_interval(values)
    text = f"{median(values):.3f}"
    if not math.isnan(interval.lo):
        text += f" [{interval.text()}]"
    if len(values) >= BOOTSTRAP_MIN_ROUNDS:
        text += f" (rounds {values[0]:.3f}..{values[-1]:.3f}, {len(values)} rounds)"
    return text


# -- dtlab against a plain torchrun script ---------------------------------------------------
def dtlab_variant(cfg: RunConfig, variant: str, steps_out: list, *, record: bool = True) -> Callable[[int], dict]:
    """A variant that runs ``dtlab.train.run(cfg)`` and measures its steady throughput.

    Appends the run's per-step times (its slowest rank's) to ``steps_out``.
    """
    def go(round_: int) -> dict:
        result = run(cfg, progress=False, record=record)
        threads = {r.provenance["threads_per_rank"] for r in result.ranks}
        if threads != {cfg.threads_per_rank} or len(result.ranks) != cfg.world_size:
            raise RuntimeError(f"dtlab ran {len(result.ranks)} ranks with {threads} threads")
        steps_out.extend({"round": round_, "variant": variant, "step": step, "step_s": s}
                         for step, s in result.step_times().items())
        step_s = steady_step_s(result)
        return {"samples_per_s": cfg.global_batch_size / step_s, "median_step_s": step_s, "wall_s": result.wall_s}
    return go


def script_variant(script: Path, cfg: RunConfig, variant: str, steps_out: list, *,
                   timeout_s: float = 300.0) -> Callable[[int], dict]:
    """A variant that runs ``script`` (plain_ddp_script.py's arguments and JSON line) under torchrun.

    The same model width, global batch, steps, warm-up, data, learning rate, seed
    and threads per rank as ``cfg``, with ``cfg.world_size`` processes.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.world_size),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(script),
               "--model-size", str(cfg.model_size), "--batch", str(cfg.global_batch_size), "--steps", str(cfg.steps),
               "--warmup", str(WARMUP_STEPS), "--dataset-size", str(cfg.dataset_size), "--lr", str(cfg.lr),
               "--seed", str(cfg.seed), "--threads", str(cfg.threads_per_rank)]
    # As dtlab's ranks: gloo on loopback; OMP_NUM_THREADS also keeps torchrun from warning about it.
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads_per_rank), "GLOO_SOCKET_IFNAME": "lo"}

    def go(round_: int) -> dict:
        t0 = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        wall_s = time.perf_counter() - t0
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"{script.name} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-4000:]}")
        out = json.loads(lines[-1])
        if out["threads"] != cfg.threads_per_rank or out["world_size"] != cfg.world_size:
            raise RuntimeError(f"{script.name} ran with {out['threads']} threads, world {out['world_size']}")
        steps_out.extend({"round": round_, "variant": variant, "step": step, "step_s": s}
                         for step, s in enumerate(out["step_s"]))
        return {"samples_per_s": out["samples_per_s"], "median_step_s": out["median_step_s"], "wall_s": wall_s}
    return go


def vs_script(name: str, tier: str, script: Path, doc: str, *, target: float, world_size: int = 2,
              threads: int = 1, rounds: int = 8, argv: Sequence[str] | None = None) -> str:
    """A ``*_vs_script`` benchmark: dtlab's ``tier`` against ``script``, at ``SMALL`` and ``LARGE`` sizes.

    Per round, interleaved: dtlab small, script small, dtlab large, script
    large (reversed every other round). Reports the median over rounds of
    dtlab/script samples/s for each size with its interval (``median_interval``:
    a 90 % bootstrap from 10 rounds, the min-max below); the headline is the
    lower of the two, and the target holds only if both meet it.
    """
    p = parser(doc)
    p.add_argument("--model-size", type=int, default=SMALL.model_size, help=f"small MLP width ({SMALL.model_size})")
    p.add_argument("--batch", type=int, default=SMALL.global_batch, help=f"small global batch ({SMALL.global_batch})")
    p.add_argument("--steps", type=int, default=None, help=f"small steps per run ({SMALL.steps}, quick "
                                                           f"{SMALL.quick_steps})")
    p.add_argument("--large-model-size", type=int, default=LARGE.model_size,
                   help=f"large MLP width ({LARGE.model_size})")
    p.add_argument("--large-batch", type=int, default=LARGE.global_batch,
                   help=f"large global batch ({LARGE.global_batch})")
    p.add_argument("--large-steps", type=int, default=None,
                   help=f"large steps per run ({LARGE.steps}, quick {LARGE.quick_steps})")
    args = parse(p, argv)
    sizes = [Size("small", args.model_size, args.batch, args.steps or SMALL.steps_for(args.quick), SMALL.dataset_size),
             Size("large", args.large_model_size, args.large_batch, args.large_steps or LARGE.steps_for(args.quick),
                  LARGE.dataset_size)]
    cfgs = {s.name: RunConfig(tier=tier, world_size=world_size, model="mlp", model_size=s.model_size,
                              dataset="synthetic", dataset_size=s.dataset_size, global_batch_size=s.global_batch,
                              steps=s.steps, optimizer="sgd", lr=0.05, threads_per_rank=threads) for s in sizes}
    steps_rows: list = []  # per step, its slowest rank's time (s)
    variants: dict[str, Callable[[int], Mapping[str, Any]]] = {}
    for size, cfg in cfgs.items():
        variants[f"dtlab:{size}"] = dtlab_variant(cfg, f"dtlab:{size}", steps_rows)
        variants[f"script:{size}"] = script_variant(script, cfg, f"script:{size}", steps_rows)
    rows = interleave(variants, repeats(args, full=rounds, quick=1), warmup_rounds=0 if args.quick else 1, log=note)
    size_of = {s.name: s for s in sizes}
    rows = [{"tier": tier, "size": row["variant"].split(":")[1], "threads_per_rank": threads,
             "world_size": world_size, **row} for row in rows]
    for row in rows:
        s = size_of[row["size"]]
        row.update(model_size=s.model_size, global_batch=s.global_batch, steps=s.steps)
    write_csv(args.out / f"{name}.csv", rows)
    write_csv(args.out / f"{name}_steps.csv", steps_rows)
    medians, parts, speeds = {}, [], []
    for s in sizes:
        r = ratios(rows, f"dtlab:{s.name}", f"script:{s.name}", "samples_per_s")
        medians[s.name] = median(r)
        step_ms = {v: 1e3 * median(per_round(rows, f"{v}:{s.name}", "median_step_s").values())
                   for v in ("dtlab", "script")}
        sps = {v: median(per_round(rows, f"{v}:{s.name}", "samples_per_s").values()) for v in ("dtlab", "script")}
        note(f"{s.name} [{s.label(world_size)}]: dtlab/script samples/s per round {spread(r)}; median step "
             f"dtlab {step_ms['dtlab']:.1f} ms, script {step_ms['script']:.1f} ms")
        parts.append(f"{s.name} [{s.label(world_size)}] {ratio_text(r)}, {resolution(r, target)}")
        speeds.append(f"{s.name} dtlab {sps['dtlab']:.0f}, script {sps['script']:.0f}")
    worst = min(medians.values())
    detail = (f"lower of: {', '.join(parts)}; median samples/s {', '.join(speeds)} "
              f"(world {world_size}, {threads} thread/rank)")
    return result_line(name, worst, f">= {target}", quick=args.quick, passed=worst >= target, detail=detail)
