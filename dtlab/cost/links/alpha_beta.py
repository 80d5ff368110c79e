"""The link: alpha-beta coefficients per collective and backend, and fitting them on a sweep.

The formulas and why gloo's differ from the textbook ring are in the
package's docstring (``dtlab.cost.links``). Everything here is
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

from dtlab.cost.links.sweep import OUTLIER_MADS, POINT, mark_outliers, size_medians

__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "BACKENDS", "BOOTSTRAP_DRAWS", "Coefficients", "INTERVAL", "LinkModel",
           "OPS", "SWEEP_COLUMNS", "bootstrap", "calibrate", "capped", "check_backend", "check_bytes", "check_op",
           "check_world_size", "coefficients", "fit_alpha_beta", "fit_frame"]

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
NAN_RANGE = (float("nan"), float("nan"))


@dataclass(frozen=True)
class LinkModel:
    """An alpha-beta description of one backend on one link.

    ``alpha_s``: seconds per message step; ``beta_s_per_byte``: seconds per byte (1 / bandwidth).
    ``backend`` chooses the algorithms (``ALGORITHMS``); ``world_size`` is where it was calibrated;
    ``ops`` the collectives it was fitted on; ``points`` and ``fit_rel_rms`` how many sweep points
    (message sizes) it was fitted on and their RMS relative residual; ``repeats`` and ``dropped`` how
    many repeats were measured at those points and how many the outlier rule left out;
    ``alpha_range_s`` and ``beta_range_s_per_byte`` the fit's spread (``calibrate``'s bootstrap
    interval, ``spread_method`` says which); ``busy_s`` and ``busy_short_s``: ``costmodel.busy``.
    A link built by hand has NaN for the fit's numbers, 0 for the counts.
    """

    alpha_s: float
    beta_s_per_byte: float
    backend: str = "gloo"
    world_size: int = 2
    label: str = ""
    ops: tuple[str, ...] = ("all_reduce",)
    points: int = 0
    fit_rel_rms: float = float("nan")
    repeats: int = 0
    dropped: int = 0
    alpha_range_s: tuple[float, float] = NAN_RANGE
    beta_range_s_per_byte: tuple[float, float] = NAN_RANGE
    spread_method: str = ""
    busy_s: float = 0.0  # a collective's extra cost inside a busy step (``costmodel.busy``); 0: not measured
    busy_short_s: float = float("nan")  # the same after 0.5 ms of compute (``busy_at``); NaN: not measured

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
        for name in ("alpha_range_s", "beta_range_s_per_byte"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 2:
                raise ValueError(f"LinkModel.{name}={value!r} is invalid: give (low, high)")
            object.__setattr__(self, name, value)
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

    @property
    def bandwidth_range_gbps(self) -> tuple[float, float]:
        """``beta_range_s_per_byte`` as a bandwidth interval in GB/s (low, high); NaN when not estimated."""
        lo, hi = (1 / b / 1e9 if b > 0 else (math.inf if b == b else b) for b in self.beta_range_s_per_byte)
        return hi, lo

    def predict(self, op: str, nbytes: Any, world_size: int | None = None) -> Any:
        """Seconds for ``op`` on ``nbytes`` (a number or an array) at ``world_size`` (default: calibrated)."""
        n = self.world_size if world_size is None else world_size
        a, b = coefficients(op, n, self.backend)
        sizes = check_bytes(nbytes)
        seconds = a * self.alpha_s + b * sizes * self.beta_s_per_byte
        return float(seconds) if seconds.ndim == 0 else seconds

    def spread_text(self) -> str:
        """The fit's spread in a few words: ``alpha 210-241 us, 0.43-0.45 GB/s (90% bootstrap ...)``; "" if none."""
        (a_lo, a_hi), (b_lo, b_hi) = self.alpha_range_s, self.bandwidth_range_gbps
        if not (math.isfinite(a_lo) and math.isfinite(b_lo)):
            return ""
        return f"alpha {a_lo * 1e6:.3g}-{a_hi * 1e6:.3g} us, {b_lo:.3g}-{b_hi:.3g} GB/s ({self.spread_method})"

    def describe(self) -> str:
        """One line: the two numbers, their spread and where they come from."""
        fit = ""
        if self.points:
            counts = f", {self.repeats} repeats, {self.dropped} dropped as outliers" if self.repeats else ""
            fit = f", fitted on {self.points} points (RMS error {self.fit_rel_rms:.1%}{counts})"
        spread = f"; spread: {self.spread_text()}" if self.spread_text() else ""
        return (f"{self.label}: alpha = {self.alpha_s * 1e6:.1f} us, beta = {self.beta_s_per_byte * 1e9:.3f} ns/B "
                f"({self.bandwidth_gbps:.3g} GB/s), {self.backend} algorithms{fit}{spread}")


def capped(link: LinkModel, mbit_per_s: float) -> LinkModel:
    """``link`` behind a ``tc tbf`` cap of ``mbit_per_s``: the slower of the two sets the bandwidth.

    tbf limits the rate, not the latency, so alpha (and its spread) is kept; a link delay (multinode's
    ``link_delay_ms``) is not modelled here. On a 2-node ring each node's link carries its 2(n-1)/n S
    bytes in each direction, which is what beta already counts. Where the cap binds, beta is the cap's,
    with no spread.
    """
    cap = LinkModel.from_bandwidth(mbit_per_s, link.alpha_s, backend=link.backend, world_size=link.world_size)
    binds = cap.beta_s_per_byte > link.beta_s_per_byte
    return dataclasses.replace(link, beta_s_per_byte=max(link.beta_s_per_byte, cap.beta_s_per_byte),
                               label=f"{link.label} capped at {mbit_per_s:g} Mbit/s", points=0,
                               fit_rel_rms=float("nan"),
                               beta_range_s_per_byte=NAN_RANGE if binds else link.beta_range_s_per_byte)


# -- calibration ------------------------------------------------------------------------------------
SWEEP_COLUMNS = ("op", "bytes", "group_size", "seconds")
BOOTSTRAP_DRAWS, INTERVAL = 200, 0.90  # the fit's spread: 200 bootstrap refits, their 5th to 95th percentile


def _sweep_rows(sweep_df: pd.DataFrame, ops: tuple[str, ...], min_bytes: float) -> pd.DataFrame:
    if not isinstance(sweep_df, pd.DataFrame) or sweep_df.empty:
        raise ValueError("calibrate: the sweep frame is empty: run dtlab.cost.links.sweep.sweep(...) first")
    missing = [c for c in SWEEP_COLUMNS if c not in sweep_df.columns]
    if missing:
        raise ValueError(f"calibrate: the sweep frame lacks column(s) {missing}; got {list(sweep_df.columns)}")
    rows = sweep_df[sweep_df["op"].isin(ops) & (sweep_df["bytes"] >= min_bytes)]
    rows = rows[(rows["seconds"] > 0) & (rows["group_size"] >= 2)]
    if rows.empty:
        raise ValueError(f"calibrate: no usable rows for op(s) {list(ops)} (>= {min_bytes:g} bytes, group size "
                         f">= 2, positive time); the sweep has op(s) {sorted(set(sweep_df['op']))}")
    return rows


def _points(rows: pd.DataFrame, robust: bool, k: float) -> tuple[pd.DataFrame, list[np.ndarray]]:
    """The points to fit (op, bytes, group_size, seconds, repeats, dropped) and each point's kept repeat times."""
    if "repeat" not in rows.columns:  # already one time per point (sweep's default frame): each row is a point
        pts = rows.reset_index(drop=True)
        for col in ("repeats", "dropped"):
            pts[col] = pts[col].fillna(0).astype(int) if col in pts.columns else 0
        return pts, [np.array([s]) for s in pts["seconds"].to_numpy(float)]
    marked = mark_outliers(rows, k if robust else math.inf)
    kept = marked[~marked["outlier"]].groupby(POINT, sort=True)["seconds"]
    pts = kept.agg("median" if robust else "mean").reset_index()
    pts["repeats"] = marked.groupby(POINT, sort=True).size().to_numpy()
    pts["dropped"] = marked.groupby(POINT, sort=True)["outlier"].sum().to_numpy().astype(int)
    return pts, [group.to_numpy(float) for _, group in kept]


def _design(rows: pd.DataFrame, backend: str) -> np.ndarray:
    coef = np.array([coefficients(op, int(n), backend) for op, n in zip(rows["op"], rows["group_size"])])
    return np.column_stack([coef[:, 0], coef[:, 1] * rows["bytes"].to_numpy(float)])


def _lstsq2(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``lstsq`` for two columns, solved directly on normalised columns (a bootstrap runs it thousands of times)."""
    norms = np.sqrt((a * a).sum(axis=0))
    u, v = a[:, 0] / norms[0], a[:, 1] / norms[1]
    uv, det = float(u @ v), 1.0 - float(u @ v) ** 2
    if not (norms > 0).all() or det < 1e-9:  # one message size only: no unique line, take lstsq's least norm
        return np.linalg.lstsq(a, y, rcond=None)[0]
    uy, vy = float(u @ y), float(v @ y)
    return np.array([(uy - uv * vy) / det / norms[0], (vy - uv * uy) / det / norms[1]])


def _weighted_fit(design: np.ndarray, seconds: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Least squares of relative residuals, weighted; alpha is held at 0 if it would go negative."""
    scale = weights / seconds  # relative residuals: a 1 KiB point counts as much as a 16 MiB one
    x = _lstsq2(design * scale[:, None], seconds * scale)
    if x[0] < 0:  # a negative latency has no meaning: fit bandwidth alone
        b, y = design[:, 1] * scale, seconds * scale
        x = np.array([0.0, float(b @ y) / float(b @ b)])
    return x


def _median(x: np.ndarray) -> float:  # np.median's own overhead dominates on a dozen points, 2000 times a fit
    s = np.sort(x)
    return 0.5 * float(s[(len(s) - 1) // 2] + s[len(s) // 2])


def _huber_weights(residuals: np.ndarray, k: float = 1.345) -> np.ndarray:
    mad = 1.4826 * _median(np.abs(residuals - _median(residuals)))
    if mad <= 0:
        return np.ones_like(residuals)
    u = np.abs(residuals) / (k * mad)
    return np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-12))


def fit_alpha_beta(design: np.ndarray, seconds: np.ndarray, robust: bool = True,
                   iterations: int = 10) -> tuple[float, float, float]:
    """``(alpha, beta, rms relative residual)`` of ``seconds ~ design @ [alpha, beta]``.

    Robust: iteratively reweighted least squares with Huber weights, so one
    point (message size) still off after its repeats' median does not drag the
    line. Plain (``robust=False``): ordinary least squares of relative residuals.
    """
    weights = np.ones_like(seconds)
    x = _weighted_fit(design, seconds, weights)
    for _ in range(iterations if robust else 0):
        residuals = (design @ x - seconds) / seconds
        new = _huber_weights(residuals)
        if float(np.max(np.abs(new - weights))) < 1e-6:
            break
        weights = new
        x = _weighted_fit(design, seconds, weights)
    residuals = (design @ x - seconds) / seconds
    return float(x[0]), float(x[1]), float(np.sqrt(np.mean(residuals**2)))


def bootstrap(design: np.ndarray, samples: Sequence[np.ndarray], robust: bool = True, draws: int = BOOTSTRAP_DRAWS,
              seed: int = 0) -> np.ndarray:
    """``draws`` refits ``(alpha, beta)`` on resampled sweeps: the fit's spread (an array of shape (draws, 2)).

    Two levels: the points (message sizes) are drawn with replacement, and
    within each drawn point its kept repeats, whose median (mean if not
    ``robust``) is the point's time. The first level carries how well the
    line fits the sizes, the second the timing noise; a per-size frame has
    one time per point, so only the first applies. Seeded: the same sweep
    gives the same interval.
    """
    rng = np.random.default_rng(seed)
    stat = np.median if robust else np.mean
    # each point's time in each draw, from its repeats drawn with replacement: (points, draws)
    times = np.array([stat(s[rng.integers(0, len(s), (draws, len(s)))], axis=1) for s in samples])
    picks = rng.integers(0, len(samples), (draws, len(samples)))
    return np.array([fit_alpha_beta(design[pick], times[pick, d], robust)[:2] for d, pick in enumerate(picks)])


def calibrate(sweep_df: pd.DataFrame, op: str | Sequence[str] = "all_reduce", *, backend: str = "gloo",
              label: str = "", min_bytes: float = 0, robust: bool = True, outlier_mads: float = OUTLIER_MADS,
              draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> LinkModel:
    """Fit a LinkModel on a message-size sweep (``dtlab.cost.links.sweep.sweep``'s frame).

    ``op``: the collective(s) to fit on -- calibrate on the one you will
    predict: on loopback the ops' per-byte costs differ (reduction arithmetic,
    extra copies), so one alpha-beta pair does not describe them all.

    The sweep is per repeat (``sweep(..., per_repeat=True)``) or per point
    (``sweep``'s default, already reduced so). Robustly (the default): the
    slowest rank of each repeat counts; repeats more than ``outlier_mads``
    scaled MADs slower than their point's median are dropped
    (``collectives.outliers``); a point's time is the median of the rest; the
    line is a Huber-weighted least-squares fit of relative residuals
    (``fit_alpha_beta``). ``robust=False``, the plain fit for comparison:
    every repeat kept, the mean per point, ordinary least squares. Spread:
    ``draws`` bootstrap refits (``bootstrap``) give a 90 % interval for alpha
    and for beta (``alpha_range_s``, ``beta_range_s_per_byte``; none if
    ``draws=0``), beside ``fit_rel_rms``. Small sizes set alpha, large ones
    beta: sweep both sides of ``a * alpha = b * S * beta`` (at least 3 sizes).
    """
    check_backend(backend)
    ops = (op,) if isinstance(op, str) else tuple(op)
    if not ops:
        raise ValueError("calibrate: op is empty: name at least one of " + ", ".join(OPS))
    for name in ops:
        check_op(name)
    pts, samples = _points(_sweep_rows(sweep_df, ops, min_bytes), robust, outlier_mads)
    if len(pts) < 3:
        raise ValueError(f"calibrate: {len(pts)} point(s) cannot determine alpha and beta: sweep at least 3 "
                         "message sizes, small ones for alpha and large ones for beta")
    design = _design(pts, backend)
    alpha, beta, rms = fit_alpha_beta(design, pts["seconds"].to_numpy(float), robust)
    if not beta > 0:
        raise ValueError(f"calibrate: the sweep gives no positive per-byte cost (beta={beta!r}): "
                         f"use messages large enough to be bandwidth-bound")
    spread: dict[str, Any] = {}
    if draws > 0:
        tails = [50 - INTERVAL * 50, 50 + INTERVAL * 50]
        lo, hi = np.percentile(bootstrap(design, samples, robust, draws, seed), tails, axis=0)
        level = "repeats and sizes" if any(len(s) > 1 for s in samples) else "sizes"
        spread = {"alpha_range_s": (lo[0], hi[0]), "beta_range_s_per_byte": (lo[1], hi[1]),
                  "spread_method": f"{INTERVAL:.0%} bootstrap interval, {draws} draws over {level}"}
    sizes = sorted(int(n) for n in set(pts["group_size"]))
    return LinkModel(alpha_s=alpha, beta_s_per_byte=beta, backend=backend, world_size=max(sizes),
                     label=label or f"{backend} {'+'.join(ops)} at n={'/'.join(map(str, sizes))}", ops=ops,
                     points=len(pts), fit_rel_rms=rms, repeats=int(pts["repeats"].sum()),
                     dropped=int(pts["dropped"].sum()), **spread)


def fit_frame(sweep_df: pd.DataFrame, link: LinkModel) -> pd.DataFrame:
    """The sweep's points next to what ``link`` predicts for them (columns op, bytes, seconds, predicted_s, error).

    A per-repeat sweep is first reduced to one time per point (``collectives.size_medians``: outliers dropped,
    the median of the rest), with its columns repeats and dropped.
    """
    rows = _sweep_rows(sweep_df, OPS, 0)
    rows = size_medians(rows) if "repeat" in rows.columns else rows.copy()
    rows["predicted_s"] = [link.predict(op, b, int(n)) for op, b, n in rows[["op", "bytes", "group_size"]].values]
    rows["error"] = rows["predicted_s"] / rows["seconds"] - 1
    rows["fitted_on"] = rows["op"].isin(link.ops)
    extra = [c for c in ("repeats", "dropped") if c in rows.columns]
    return rows.reset_index(drop=True)[["op", "bytes", "group_size", "seconds", "predicted_s", "error", "fitted_on",
                                        *extra]]
