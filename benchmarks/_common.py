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
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

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

    Each variant is called with the round number and returns a dict of
    measurements. The result is one row per (round, variant): ``round``
    (negative for warm-up rounds, which are kept in the rows but left out by
    ``per_round``), ``order`` (position within the round), ``variant`` and
    the measurements.
    """
    rows: list[dict[str, Any]] = []
    for r in range(-warmup_rounds, rounds):
        started = time.perf_counter()
        for order, (name, fn) in enumerate(variants.items()):
            rows.append({"round": r, "order": order, "variant": name, **fn(r)})
        if log is not None:
            what = "warm-up round" if r < 0 else f"round {r + 1}/{rounds}"
            log(f"{what} done in {time.perf_counter() - started:.1f} s")
    return rows


def per_round(rows: Iterable[Mapping[str, Any]], variant: str, key: str) -> dict[int, float]:
    """``{round: value}`` of one variant's measurement, measured rounds only."""
    return {int(r["round"]): float(r[key]) for r in rows if r["variant"] == variant and r["round"] >= 0}


def ratios(rows: Iterable[Mapping[str, Any]], numerator: str, denominator: str, key: str) -> list[float]:
    """Per-round ``numerator / denominator`` of ``key``: the two ran in the same round."""
    rows = list(rows)
    num, den = per_round(rows, numerator, key), per_round(rows, denominator, key)
    return [num[r] / den[r] for r in sorted(num.keys() & den.keys()) if den[r] > 0]


def median(values: Iterable[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


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
    ``costmodel.read_runs`` reads it back as a list of ints.
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
    print(line, flush=True)
    return line
