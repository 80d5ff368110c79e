"""``python -m dtlab.cost.roofline``: measure this machine's roofline, fit it, save it and draw it.

Writes into ``--out`` (default ``results/roofline``): ``roofline.csv`` (every measurement: GEMMs,
triads and copies, dispatch, the loop's phases on tiny MLPs, per placement), ``roofline.json``
(the fitted ``cpu.Roofline``: what ``dtlab.estimate(..., compute="predicted")`` and the speedup
sweep predict on) and ``roofline.png`` (attainable GFLOP/s against FLOPs per byte: measured
points and each placement's roofs). Full mode takes about a minute on 2 cores; ``--quick`` a
few seconds (fewer shapes, one pass: a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from dtlab.cost.roofline.cpu import Roofline, fit, machine_info
from dtlab.cost.roofline.measure import default_placements, measure
from dtlab.cost.roofline.model import gemm, op_seconds
from dtlab.plots import save
from dtlab.plots.roofline import roofline as roofline_figure

__all__ = ["gemm_errors", "main", "parse_placements", "summary"]


def parse_placements(text: str) -> list[tuple[int, int]]:
    """``"1x1,2x1,1x2"`` as [(threads, copies), ...]; ValueError naming ``--placements`` otherwise."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            threads, copies = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--placements {text!r} is invalid: give THREADSxCOPIES pairs, e.g. 1x1,2x1,1x2") \
                from None
        if threads < 1 or copies < 1:
            raise ValueError(f"--placements {part!r} is invalid: threads and copies must be >= 1")
        out.append((threads, copies))
    return out


def _label(threads: int, copies: int) -> str:
    return f"{threads} thread{'s' if threads > 1 else ''} × {copies} cop{'y' if copies == 1 else 'ies'}"


def gemm_errors(frame: pd.DataFrame, roof: Roofline) -> pd.DataFrame:
    """Each measured GEMM against the roofline's time for it (its dispatch added): the model's own error."""
    rows = frame[frame["kind"] == "gemm"]
    out = []
    for (threads, copies), part in rows.groupby(["threads", "copies"]):
        place = roof.placements[(int(threads), int(copies))]
        for r in part.itertuples(index=False):
            op = gemm("gemm", int(r.m), int(r.n), int(r.k), dtype="fp32", itemsize=4)
            predicted = place.dispatch_s + op_seconds(op, place.device)
            out.append({"threads": threads, "copies": copies, "m": r.m, "n": r.n, "k": r.k,
                        "measured_s": r.seconds, "predicted_s": predicted, "error": predicted / r.seconds - 1})
    return pd.DataFrame(out)


def summary(frame: pd.DataFrame, roof: Roofline) -> str:
    """Per placement: the peak, the bandwidth, the roofline's error on the measured GEMMs, the overhead."""
    errors = gemm_errors(frame, roof)
    lines = []
    for (threads, copies), place in roof.placements.items():
        err = errors[(errors["threads"] == threads) & (errors["copies"] == copies)]["error"].abs()
        over = place.overhead
        lines.append(f"{_label(threads, copies)}: peak {place.device.peak('fp32') / 1e9:.0f} GFLOP/s fp32, "
                     f"triad {place.device.memory_bandwidth / 1e9:.1f} GB/s; roofline vs measured GEMMs: median "
                     f"|error| {err.median():.1%}, 90th percentile {err.quantile(0.9):.1%} ({len(err)} shapes); "
                     f"per op {over.per_op_s['forward'] * 1e6:.1f}/{over.per_op_s['backward'] * 1e6:.1f}/"
                     f"{over.per_op_s['optimizer'] * 1e6:.1f} µs (forward/backward/optimizer), per step "
                     f"{sum(over.fixed_s.values()) * 1e6:.0f} µs")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.cost.roofline", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/roofline"),
                        help="folder for roofline.csv, roofline.json and roofline.png")
    parser.add_argument("--placements", default="", help="THREADSxCOPIES pairs to measure (default: "
                        f"{','.join(f'{t}x{c}' for t, c in default_placements())} on this machine)")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("DTLAB_QUICK") == "1",
                        help="fewer shapes, sizes and steps, one pass (also DTLAB_QUICK=1)")
    args = parser.parse_args(argv)
    try:
        placements = parse_placements(args.placements) or default_placements()
    except ValueError as exc:
        parser.error(str(exc))
    t0 = time.perf_counter()
    before = machine_info()
    frame = measure(placements, quick=args.quick, log=lambda line: print(line, flush=True))
    machine = {**before, "load_1min_after": machine_info()["load_1min"], "quick": args.quick}
    roof = fit(frame, machine)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "roofline.csv", index=False)
    roof.save(args.out / "roofline.json")
    points = frame.assign(placement=[_label(t, c) for t, c in zip(frame["threads"], frame["copies"])])
    roofs = pd.DataFrame([{"placement": _label(t, c), "peak_flops": p.device.peak("fp32"),
                           "bandwidth": p.device.memory_bandwidth} for (t, c), p in roof.placements.items()])
    png = save(roofline_figure(points, roofs, title=f"{machine['cpu']}, {machine['cores']} cores, torch "
                                                    f"{machine['torch']}, fp32"), args.out / "roofline.png")
    print(summary(frame, roof))
    print(f"load average (1 min) {machine['load_1min']} before, {machine['load_1min_after']} after; wrote "
          f"{args.out / 'roofline.csv'}, {args.out / 'roofline.json'} and {png} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
