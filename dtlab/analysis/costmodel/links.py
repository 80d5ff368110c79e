"""The link: alpha-beta coefficients per collective and backend, and fitting them on a sweep.

The formulas and why gloo's differ from the textbook ring are in the
package's docstring (``dtlab.analysis.costmodel``). Everything here is
arithmetic on numbers and frames: nothing starts a process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "BACKENDS", "Coefficients", "LinkModel", "OPS", "SWEEP_COLUMNS",
           "calibrate", "capped", "check_backend", "check_bytes", "check_op", "check_world_size", "coefficients",
           "fit_alpha_beta", "fit_frame"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
BACKENDS = ("gloo", "ring")

Coefficients = Callable[[int], tuple[float, float]]  # n -> (a, b): time = a * alpha + b * S * beta


def _ring_all_reduce(n: int) -> tuple[float, float]:
    return 2.0 * (n - 1), 2.0 * (n - 1) / n


def _ring_half(n: int) -> tuple[float, float]:  # all_gather, reduce_scatter: one half of the all-reduce
    return float(n - 1), (n - 1) / n


def _chain_broadcast(n: int) -> tuple[float, float]:
    return float(n - 1), 1.0


def _tree_broadcast(n: int) -> tuple[float, float]:
    levels = float(math.ceil(math.log2(n)))
    return levels, levels


def _exchange(n: int) -> tuple[float, float]:
    return 1.0, 1.0


ALGORITHMS: dict[str, dict[str, Coefficients]] = {
    "ring": {"all_reduce": _ring_all_reduce, "all_gather": _ring_half, "reduce_scatter": _ring_half,
             "broadcast": _chain_broadcast, "send_recv": _exchange},
    "gloo": {"all_reduce": _ring_all_reduce, "all_gather": _ring_half, "reduce_scatter": _ring_all_reduce,
             "broadcast": _tree_broadcast, "send_recv": _exchange},
}
ALGORITHM_NAMES = {
    "ring": {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring", "broadcast": "pipelined chain",
             "send_recv": "neighbour exchange"},
    "gloo": {"all_reduce": "ring (segmented)", "all_gather": "ring", "reduce_scatter": "all-reduce, then a copy",
             "broadcast": "binomial tree", "send_recv": "neighbour exchange"},
}


# -- checks (shared by the package's modules) ----------------------------------------------------
def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")


def check_world_size(world_size: Any, what: str = "world_size") -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"{what}={world_size!r} is invalid: must be an integer >= 1")


def check_bytes(nbytes: Any, what: str = "nbytes") -> np.ndarray:
    arr = np.asarray(nbytes, dtype=float)
    if arr.size and (np.isnan(arr).any() or (arr < 0).any()):
        raise ValueError(f"{what}={nbytes!r} is invalid: bytes must be >= 0")
    return arr


def coefficients(op: str, world_size: int, backend: str = "gloo") -> tuple[float, float]:
    """``(a, b)`` such that ``op`` on ``world_size`` ranks costs ``a * alpha + b * bytes * beta``."""
    check_op(op)
    check_backend(backend)
    check_world_size(world_size)
    if world_size == 1:  # nothing leaves the process
        return 0.0, 0.0
    return ALGORITHMS[backend][op](int(world_size))


# -- the link ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkModel:
    """An alpha-beta description of one backend on one link.

    ``alpha_s``: seconds per message step; ``beta_s_per_byte``: seconds per byte
    (1 / bandwidth). ``backend`` chooses the algorithms (``ALGORITHMS``);
    ``world_size`` is where it was calibrated; ``ops`` the collectives it was
    fitted on; ``points`` and ``fit_rel_rms`` how many sweep points it was fitted
    on and their RMS relative residual (NaN for a link built by hand).
    """

    alpha_s: float
    beta_s_per_byte: float
    backend: str = "gloo"
    world_size: int = 2
    label: str = ""
    ops: tuple[str, ...] = ("all_reduce",)
    points: int = 0
    fit_rel_rms: float = float("nan")

    def __post_init__(self) -> None:
        check_backend(self.backend)
        check_world_size(self.world_size)
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"LinkModel.alpha_s={self.alpha_s!r} is invalid: must be >= 0 seconds")
        if not (math.isfinite(self.beta_s_per_byte) and self.beta_s_per_byte > 0):
            raise ValueError(f"LinkModel.beta_s_per_byte={self.beta_s_per_byte!r} is invalid: must be > 0 s/byte")
        object.__setattr__(self, "ops", (self.ops,) if isinstance(self.ops, str) else tuple(self.ops))
        for op in self.ops:
            check_op(op)
        if not self.label:
            object.__setattr__(self, "label", f"{self.backend}, {self.bandwidth_gbps:.2g} GB/s, "
                                              f"alpha {self.alpha_s * 1e6:.3g} us")

    @classmethod
    def from_bandwidth(cls, mbit_per_s: float, alpha_s: float, *, backend: str = "gloo", world_size: int = 2,
                       label: str = "") -> LinkModel:
        """A link of a given bandwidth (Mbit/s, 10^6 bits) and latency, for what-if questions."""
        if not (math.isfinite(mbit_per_s) and mbit_per_s > 0):
            raise ValueError(f"mbit_per_s={mbit_per_s!r} is invalid: must be > 0 Mbit/s")
        return cls(alpha_s=alpha_s, beta_s_per_byte=8.0 / (mbit_per_s * 1e6), backend=backend,
                   world_size=world_size, label=label or f"{mbit_per_s:g} Mbit/s, alpha {alpha_s * 1e6:.3g} us")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte

    @property
    def bandwidth_gbps(self) -> float:
        """Bandwidth in GB/s (10^9 bytes/s), the unit of ``plots.bandwidth``'s ``limit_gbps``."""
        return self.bandwidth_bytes_per_s / 1e9

    @property
    def bandwidth_mbit_per_s(self) -> float:
        """Bandwidth in Mbit/s, the unit of ``from_bandwidth``."""
        return self.bandwidth_bytes_per_s * 8 / 1e6

    def predict(self, op: str, nbytes: Any, world_size: int | None = None) -> Any:
        """Seconds for ``op`` on ``nbytes`` (a number or an array) at ``world_size`` (default: calibrated)."""
        n = self.world_size if world_size is None else world_size
        a, b = coefficients(op, n, self.backend)
        sizes = check_bytes(nbytes)
        seconds = a * self.alpha_s + b * sizes * self.beta_s_per_byte
        return float(seconds) if seconds.ndim == 0 else seconds

    def describe(self) -> str:
        """One line: the two numbers and where they come from."""
        fit = f", fitted on {self.points} points (RMS error {self.fit_rel_rms:.1%})" if self.points else ""
        return (f"{self.label}: alpha = {self.alpha_s * 1e6:.1f} us, beta = {self.beta_s_per_byte * 1e9:.3f} ns/B "
                f"({self.bandwidth_gbps:.3g} GB/s), {self.backend} algorithms{fit}")


def capped(link: LinkModel, mbit_per_s: float) -> LinkModel:
    """``link`` behind a ``tc tbf`` cap of ``mbit_per_s``: the slower of the two sets the bandwidth.

    tbf limits the rate, not the latency (no netem here), so alpha is kept. On
    a 2-node ring each node's link carries its 2(n-1)/n S bytes in each
    direction, which is what beta already counts.
    """
    cap = LinkModel.from_bandwidth(mbit_per_s, link.alpha_s, backend=link.backend, world_size=link.world_size)
    return dataclasses.replace(link, beta_s_per_byte=max(link.beta_s_per_byte, cap.beta_s_per_byte),
                               label=f"{link.label} capped at {mbit_per_s:g} Mbit/s", points=0,
                               fit_rel_rms=float("nan"))


# -- calibration ------------------------------------------------------------------------------------
SWEEP_COLUMNS = ("op", "bytes", "group_size", "seconds")


def _sweep_rows(sweep_df: pd.DataFrame, ops: tuple[str, ...], min_bytes: float) -> pd.DataFrame:
    if not isinstance(sweep_df, pd.DataFrame) or sweep_df.empty:
        raise ValueError("calibrate: the sweep frame is empty: run dtlab.analysis.collectives.sweep(...) first")
    missing = [c for c in SWEEP_COLUMNS if c not in sweep_df.columns]
    if missing:
        raise ValueError(f"calibrate: the sweep frame lacks column(s) {missing}; got {list(sweep_df.columns)}")
    rows = sweep_df[sweep_df["op"].isin(ops) & (sweep_df["bytes"] >= min_bytes)]
    rows = rows[(rows["seconds"] > 0) & (rows["group_size"] >= 2)]
    if rows.empty:
        raise ValueError(f"calibrate: no usable rows for op(s) {list(ops)} (>= {min_bytes:g} bytes, group size "
                         f">= 2, positive time); the sweep has op(s) {sorted(set(sweep_df['op']))}")
    return rows


def _design(rows: pd.DataFrame, backend: str) -> np.ndarray:
    coef = np.array([coefficients(op, int(n), backend) for op, n in zip(rows["op"], rows["group_size"])])
    return np.column_stack([coef[:, 0], coef[:, 1] * rows["bytes"].to_numpy(float)])


def _weighted_fit(design: np.ndarray, seconds: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Least squares of relative residuals, weighted; alpha is held at 0 if it would go negative."""
    scale = weights / seconds  # relative residuals: a 1 KiB point counts as much as a 16 MiB one
    x, *_ = np.linalg.lstsq(design * scale[:, None], seconds * scale, rcond=None)
    if x[0] < 0:  # a negative latency has no meaning: fit bandwidth alone
        beta, *_ = np.linalg.lstsq(design[:, 1:] * scale[:, None], seconds * scale, rcond=None)
        x = np.array([0.0, beta[0]])
    return x


def _huber_weights(residuals: np.ndarray, k: float = 1.345) -> np.ndarray:
    mad = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    if mad <= 0:
        return np.ones_like(residuals)
    u = np.abs(residuals) / (k * mad)
    return np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-12))


def fit_alpha_beta(design: np.ndarray, seconds: np.ndarray, robust: bool = True,
                   iterations: int = 10) -> tuple[float, float, float]:
    """``(alpha, beta, rms relative residual)`` of ``seconds ~ design @ [alpha, beta]``.

    Robust: iteratively reweighted least squares with Huber weights, so one
    timing hit by a scheduler hiccup does not drag the line.
    """
    weights = np.ones_like(seconds)
    x = _weighted_fit(design, seconds, weights)
    for _ in range(iterations if robust else 0):
        residuals = (design @ x - seconds) / seconds
        new = _huber_weights(residuals)
        if np.allclose(new, weights):
            break
        weights = new
        x = _weighted_fit(design, seconds, weights)
    residuals = (design @ x - seconds) / seconds
    return float(x[0]), float(x[1]), float(np.sqrt(np.mean(residuals**2)))


def calibrate(sweep_df: pd.DataFrame, op: str | Sequence[str] = "all_reduce", *, backend: str = "gloo",
              label: str = "", min_bytes: float = 0, robust: bool = True) -> LinkModel:
    """Fit a LinkModel on a message-size sweep (``dtlab.analysis.collectives.sweep``'s frame).

    ``op``: the collective(s) to fit on -- calibrate on the one you will
    predict: on loopback the ops' per-byte costs differ (reduction arithmetic,
    extra copies), so one alpha-beta pair does not describe them all. The
    sweep's times are already medians over repeats of the slowest rank; the
    fit minimises relative residuals, robustly (``fit_alpha_beta``).
    """
    check_backend(backend)
    ops = (op,) if isinstance(op, str) else tuple(op)
    if not ops:
        raise ValueError("calibrate: op is empty: name at least one of " + ", ".join(OPS))
    for name in ops:
        check_op(name)
    rows = _sweep_rows(sweep_df, ops, min_bytes)
    alpha, beta, rms = fit_alpha_beta(_design(rows, backend), rows["seconds"].to_numpy(float), robust)
    if not beta > 0:
        raise ValueError(f"calibrate: the sweep gives no positive per-byte cost (beta={beta!r}): "
                         f"use messages large enough to be bandwidth-bound")
    sizes = sorted(int(n) for n in set(rows["group_size"]))
    return LinkModel(alpha_s=alpha, beta_s_per_byte=beta, backend=backend, world_size=max(sizes),
                     label=label or f"{backend} {'+'.join(ops)} at n={'/'.join(map(str, sizes))}", ops=ops,
                     points=len(rows), fit_rel_rms=rms)


def fit_frame(sweep_df: pd.DataFrame, link: LinkModel) -> pd.DataFrame:
    """The sweep's rows next to what ``link`` predicts for them (columns op, bytes, seconds, predicted_s, error)."""
    rows = _sweep_rows(sweep_df, OPS, 0).copy()
    rows["predicted_s"] = [link.predict(op, b, int(n)) for op, b, n in zip(rows["op"], rows["bytes"],
                                                                          rows["group_size"])]
    rows["error"] = rows["predicted_s"] / rows["seconds"] - 1
    rows["fitted_on"] = rows["op"].isin(link.ops)
    return rows.reset_index(drop=True)[["op", "bytes", "group_size", "seconds", "predicted_s", "error", "fitted_on"]]
