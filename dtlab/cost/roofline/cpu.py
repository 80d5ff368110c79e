"""This machine as a ``Device`` per placement, fitted to what ``measure`` timed, saved as JSON and loaded again.

**The GEMM curve.** The peak is the highest rate any measured shape reached. A shape's
efficiency is its measured rate over that peak, its Python dispatch (the ``dispatch`` row: a
1 x 1 product) taken off its time first, since ``Overhead`` charges every op its dispatch with
the rest of eager PyTorch's cost per op. Between the measured shapes (a grid: every (m, n, k) of
``measure.DIMS``) the efficiency is interpolated linearly in log m, log n, log k (its log, so
a factor between neighbours stays a factor); beyond the grid it is held at the edge. A shape
that is memory-bound here (a thin m against a wide k x n, say) keeps its measured efficiency,
the memory traffic included; ``op_seconds`` then takes the slower of that and the memory roof.

**The memory roof** is the triad's bandwidth at ``BANDWIDTH_MIB`` MiB per array.

**Eager PyTorch's fixed costs** (``Overhead``): for each phase of dtlab's loop, its median on the
tiny MLPs against the ops it ran, a straight line fitted by non-negative least squares: a fixed
cost per step and a cost per op. The loop's own work between phases goes to ``data``, as
``estimate.probe.loop_phases`` counts it.

A ``Roofline`` holds a ``Placement`` (device, curve, overhead) per (threads, copies) and what was
measured where and when (``machine``); ``save``/``load`` write and read it as JSON, so every
prediction reuses one measurement.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy.interpolate import RegularGridInterpolator
from scipy.optimize import nnls

from dtlab.cost.roofline.model import Device
from dtlab.cost.roofline.ops import PHASES

__all__ = ["BANDWIDTH_MIB", "DEFAULT_PATH", "GemmCurve", "Overhead", "Placement", "Roofline", "fit", "machine_info"]

DEFAULT_PATH = Path("results/roofline/roofline.json")
BANDWIDTH_MIB = 16  # the array size whose triad is the memory roof: beyond L2, like a wide layer's weights
SOURCE = "measured on this machine: python -m dtlab.cost.roofline"


@dataclass(frozen=True)
class GemmCurve:
    """Measured GEMM efficiency on a grid of shapes, interpolated (see the module's docstring); callable as a
    ``Device.gemm_efficiency``."""

    dims: tuple[int, ...]  # the grid's values of m, n and k
    efficiency: tuple  # efficiency[i][j][l] at (dims[i], dims[j], dims[l])

    def __call__(self, m: int, n: int, k: int, dtype: str = "fp32") -> float:
        return float(np.exp(self._interpolate()([[np.log(max(m, 1)), np.log(max(n, 1)), np.log(max(k, 1))]])[0]))

    @functools.cache  # noqa: B019 - a frozen dataclass: one interpolator per curve, for its lifetime
    def _interpolate(self) -> RegularGridInterpolator:
        axis = np.log(np.asarray(self.dims, dtype=float))
        # beyond the grid: held at the edge (the query is clipped onto it)
        grid = RegularGridInterpolator((axis, axis, axis), np.log(np.asarray(self.efficiency, dtype=float)))
        lo, hi = axis[0], axis[-1]
        return lambda points: grid(np.clip(np.asarray(points, dtype=float), lo, hi))


@dataclass(frozen=True)
class Overhead:
    """Eager PyTorch's cost in dtlab's loop here: per phase, seconds per step and seconds per op."""

    fixed_s: dict[str, float]
    per_op_s: dict[str, float]

    def seconds(self, phase: str, ops: float) -> float:
        return self.fixed_s.get(phase, 0.0) + self.per_op_s.get(phase, 0.0) * ops


@dataclass(frozen=True)
class Placement:
    threads: int
    copies: int
    device: Device
    curve: GemmCurve
    overhead: Overhead
    dispatch_s: float

    @property
    def label(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''} x {self.copies} " \
               f"cop{'y' if self.copies == 1 else 'ies'}"


def _device(threads: int, copies: int, peak: float, curve: GemmCurve, bandwidth: float) -> Device:
    return Device(f"this CPU, {threads} thread(s) x {copies} copies", {"fp32": peak}, bandwidth, curve, (SOURCE,))


@dataclass(frozen=True)
class Roofline:
    placements: dict[tuple[int, int], Placement]
    machine: dict[str, Any] = field(default_factory=dict)

    def placement(self, threads: int, copies: int) -> tuple[Placement, float]:
        """The placement ``threads`` x ``copies`` and a factor on its times: 1 where it was measured; where the
        copies need more threads than the cores (oversubscribed), the measured placement that fills the
        cores at ``threads``, its times scaled by threads x copies / cores (the cores are time-shared)."""
        if (threads, copies) in self.placements:
            return self.placements[(threads, copies)], 1.0
        cores = int(self.machine.get("cores") or os.cpu_count() or 1)
        full = (threads, cores // threads) if threads <= cores else None
        if full in self.placements and threads * copies > cores:
            return self.placements[full], threads * copies / cores
        raise ValueError(f"the roofline has no placement of {threads} thread(s) x {copies} copies (measured: "
                         f"{', '.join(p.label for p in self.placements.values())}): measure it with "
                         f"python -m dtlab.cost.roofline --placements {threads}x{copies}")

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "placements": [
            {"threads": p.threads, "copies": p.copies, "peak_flops": p.device.peak("fp32"),
             "memory_bandwidth": p.device.memory_bandwidth, "dispatch_s": p.dispatch_s, "gemm": asdict(p.curve),
             "overhead": asdict(p.overhead)}
            for p in self.placements.values()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Roofline:
        out = {}
        for p in data["placements"]:
            curve = GemmCurve(tuple(p["gemm"]["dims"]), _tuples(p["gemm"]["efficiency"]))
            device = _device(p["threads"], p["copies"], p["peak_flops"], curve, p["memory_bandwidth"])
            out[(p["threads"], p["copies"])] = Placement(p["threads"], p["copies"], device, curve,
                                                         Overhead(**p["overhead"]), p["dispatch_s"])
        return cls(out, data.get("machine", {}))

    def save(self, path: str | Path = DEFAULT_PATH) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> Roofline:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no roofline at {path}: measure one with python -m dtlab.cost.roofline")
        return cls.from_dict(json.loads(path.read_text()))

    def matches_this_machine(self) -> bool:
        """Whether it was measured on this CPU, core count and torch version."""
        here = machine_info()
        return all(self.machine.get(k) == here[k] for k in ("cpu", "cores", "torch"))


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What a measurement depends on: the CPU, its cores, torch, and the load when it was taken."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "host": platform.node(),
            "measured": datetime.datetime.now().isoformat(timespec="seconds"), "load_1min": round(load[0], 2)}


def _nnls(columns: list[np.ndarray], target: np.ndarray, weight: np.ndarray) -> np.ndarray:
    a = np.stack(columns, axis=1) * weight[:, None]
    return nnls(a, target * weight)[0]


def fit_gemm(rows: pd.DataFrame, dispatch_s: float) -> tuple[float, GemmCurve]:
    """The peak (FLOP/s) and the efficiency grid of one placement's ``gemm`` rows (a full grid of shapes)."""
    dims = tuple(sorted({int(v) for v in rows["m"]}))
    if not ({int(v) for v in rows["n"]} == {int(v) for v in rows["k"]} == set(dims)) or len(rows) != len(dims) ** 3:
        raise ValueError(f"fit: the gemm rows must cover every (m, n, k) of one grid; got {len(rows)} rows")
    # dispatch off, but never more than half a call's time (a tiny product's time is mostly dispatch)
    busy = np.maximum(rows["seconds"].to_numpy(float) - dispatch_s, rows["seconds"].to_numpy(float) / 2)
    rate = pd.Series(rows["flops"].to_numpy(float) / busy, index=pd.MultiIndex.from_frame(rows[["m", "n", "k"]]
                                                                                          .astype(int)))
    peak = float(rate.max())
    grid = [[[float(rate[(m, n, k)] / peak) for k in dims] for n in dims] for m in dims]
    return peak, GemmCurve(dims, tuple(tuple(tuple(row) for row in plane) for plane in grid))


def fit_overhead(rows: pd.DataFrame) -> Overhead:
    """Per phase, a fixed cost and a cost per op through the ``loop`` rows; the loop's work between phases
    (a step's total less its phases, the median over jobs) goes to ``data``."""
    fixed, per_op = {}, {}
    for phase in PHASES:
        sub = rows[rows["phase"] == phase]
        ops, t = sub["ops"].to_numpy(float), sub["seconds"].to_numpy(float)
        if np.ptp(ops) == 0:  # the same ops in every job: only the sum can be known
            fixed[phase], per_op[phase] = float(np.median(t)), 0.0
        else:
            fixed[phase], per_op[phase] = (float(v) for v in _nnls([np.ones_like(ops), ops], t, 1 / t))
    jobs = rows.pivot_table(index=["optimizer", "depth"], columns="phase", values="seconds")
    between = (jobs["total"] - jobs[list(PHASES)].sum(axis=1)).median()
    fixed["data"] += max(0.0, float(between))
    return Overhead(fixed, per_op)


def fit(frame: pd.DataFrame, machine: dict[str, Any] | None = None) -> Roofline:
    """A ``Roofline`` from ``measure``'s frame: per placement, the GEMM curve, the triad bandwidth at
    ``BANDWIDTH_MIB`` MiB (the largest size measured if that one was not) and the loop's overhead."""
    out = {}
    for (threads, copies), rows in frame.groupby(["threads", "copies"]):
        dispatch = float(rows.loc[rows["kind"] == "dispatch", "seconds"].median())
        triads = rows[rows["kind"] == "triad"]
        at = triads[triads["array_mib"] == BANDWIDTH_MIB]
        row = (at if len(at) else triads.sort_values("array_mib")).iloc[-1]
        bandwidth = float(row["bytes"] / row["seconds"])
        peak, curve = fit_gemm(rows[rows["kind"] == "gemm"], dispatch)
        t, c = int(threads), int(copies)
        out[(t, c)] = Placement(t, c, _device(t, c, peak, curve, bandwidth), curve,
                                fit_overhead(rows[rows["kind"] == "loop"]), dispatch)
    if not out:
        raise ValueError("fit: the frame has no measurements")
    return Roofline(out, machine if machine is not None else machine_info())
