"""Communication cost model: alpha-beta links, a DDP step predictor and what-if projections.

A link is described by two numbers, fitted on a message-size sweep of the
instrumented collectives (``dtlab.collectives.sweep``): a latency ``alpha``
(seconds per message step) and an inverse bandwidth ``beta`` (seconds per
byte). A collective of ``S`` bytes on ``n`` ranks then costs
``a(n) * alpha + b(n) * S * beta``, where ``a`` and ``b`` depend on the
algorithm. ``S`` follows the nccl-tests convention, as the sweep does:
all_gather counts the gathered output, reduce_scatter the full input.

Which algorithm runs, by backend (``ALGORITHMS``):

``"ring"`` -- the textbook ring algorithms (NCCL's ring, large messages):

* all_reduce: reduce-scatter then all-gather, ``2(n-1) alpha + 2(n-1)/n S beta``
* all_gather, reduce_scatter: ``(n-1) alpha + (n-1)/n S beta``
* broadcast: a pipelined chain, ``(n-1) alpha + S beta``
* send_recv (every rank sends S to its neighbour at once): ``alpha + S beta``

``"gloo"`` -- what torch 2.13's ProcessGroupGloo runs on CPU tensors, read
from its sources (``ProcessGroupGlooDetail.hpp``, ``ProcessGroupGloo.cpp``)
and gloo's (``gloo/allreduce.cc``, ``allgather.cc``, ``broadcast.cc``):

* all_reduce: ``AsyncAllreduceWork`` calls ``gloo::allreduce`` without
  choosing an algorithm, which selects the **ring** (reduce-scatter, then
  all-gather) at every message size: gloo's halving-doubling and bcube
  exist but ProcessGroupGloo never selects them, and there is no small-message
  tree as in NCCL. What differs from the textbook ring is segmentation: each
  rank's chunk is cut into at least 2 segments of at most 1 MiB, two in
  flight, so even a small all-reduce makes 2(n-1) ring steps of two segment
  messages each, and a large one pays a little per-segment cost that the
  fit folds into ``beta``. Formula: ``2(n-1) alpha + 2(n-1)/n S beta``.
* all_gather: ``gloo::allgather``, a ring passing each chunk in two halves:
  ``(n-1) alpha + (n-1)/n S beta``.
* reduce_scatter: gloo has no reduce-scatter; ProcessGroupGloo clones the
  input, **all-reduces it whole** and copies out its chunk, so it costs an
  all-reduce, ``2(n-1) alpha + 2(n-1)/n S beta``, twice the textbook bytes.
* broadcast: ``gloo::broadcast`` is a **binomial tree** sending the whole
  message at each level: ``ceil(log2 n) (alpha + S beta)``.
* send_recv: ``alpha + S beta``.

At ``n = 1`` every collective costs 0. At ``n = 2`` the ring and the tree
coincide, so a calibration at world size 2 cannot tell them apart: the
formulas above are what carries it to other ``n``.

``predict_ddp_step`` turns a single-rank compute timeline and DDP's bucket
sizes into a step time; ``measure`` and ``validate`` check it against real
DDP runs; ``project`` extrapolates to world sizes and links this machine
does not have (a simulation, with its ``assumptions``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
BACKENDS = ("gloo", "ring")
COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")
MEDIAN_TARGET, MAX_TARGET = 0.15, 0.30  # validation targets: median and worst relative error
MIB = 2**20

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


# -- checks -------------------------------------------------------------------------------------
def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")


def _check_world_size(world_size: Any, what: str = "world_size") -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"{what}={world_size!r} is invalid: must be an integer >= 1")


def _check_bytes(nbytes: Any, what: str = "nbytes") -> np.ndarray:
    arr = np.asarray(nbytes, dtype=float)
    if arr.size and (np.isnan(arr).any() or (arr < 0).any()):
        raise ValueError(f"{what}={nbytes!r} is invalid: bytes must be >= 0")
    return arr


def coefficients(op: str, world_size: int, backend: str = "gloo") -> tuple[float, float]:
    """``(a, b)`` such that ``op`` on ``world_size`` ranks costs ``a * alpha + b * bytes * beta``."""
    _check_op(op)
    _check_backend(backend)
    _check_world_size(world_size)
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
        _check_backend(self.backend)
        _check_world_size(self.world_size)
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"LinkModel.alpha_s={self.alpha_s!r} is invalid: must be >= 0 seconds")
        if not (math.isfinite(self.beta_s_per_byte) and self.beta_s_per_byte > 0):
            raise ValueError(f"LinkModel.beta_s_per_byte={self.beta_s_per_byte!r} is invalid: must be > 0 s/byte")
        object.__setattr__(self, "ops", (self.ops,) if isinstance(self.ops, str) else tuple(self.ops))
        for op in self.ops:
            _check_op(op)
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
        sizes = _check_bytes(nbytes)
        seconds = a * self.alpha_s + b * sizes * self.beta_s_per_byte
        return float(seconds) if seconds.ndim == 0 else seconds

    def describe(self) -> str:
        """One line: the two numbers and where they come from."""
        fit = f", fitted on {self.points} points (RMS error {self.fit_rel_rms:.1%})" if self.points else ""
        return (f"{self.label}: alpha = {self.alpha_s * 1e6:.1f} us, beta = {self.beta_s_per_byte * 1e9:.3f} ns/B "
                f"({self.bandwidth_gbps:.3g} GB/s), {self.backend} algorithms{fit}")


# -- calibration ------------------------------------------------------------------------------------
SWEEP_COLUMNS = ("op", "bytes", "group_size", "seconds")


def _sweep_rows(sweep_df: pd.DataFrame, ops: tuple[str, ...], min_bytes: float) -> pd.DataFrame:
    if not isinstance(sweep_df, pd.DataFrame) or sweep_df.empty:
        raise ValueError("calibrate: the sweep frame is empty: run dtlab.collectives.sweep(...) first")
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
    """Fit a LinkModel on a message-size sweep (``dtlab.collectives.sweep``'s frame).

    ``op``: the collective(s) to fit on -- calibrate on the one you will
    predict: on loopback the ops' per-byte costs differ (reduction arithmetic,
    extra copies), so one alpha-beta pair does not describe them all. The
    sweep's times are already medians over repeats of the slowest rank; the
    fit minimises relative residuals, robustly (``fit_alpha_beta``).
    """
    _check_backend(backend)
    ops = (op,) if isinstance(op, str) else tuple(op)
    if not ops:
        raise ValueError("calibrate: op is empty: name at least one of " + ", ".join(OPS))
    for name in ops:
        _check_op(name)
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


# -- one DDP step ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketTiming:
    """One bucket in a predicted step, in seconds from the start of backward."""

    index: int
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepPrediction:
    """A predicted DDP step: its parts in seconds and the bucket timeline."""

    step_s: float
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    overhead_s: float
    comm_s: float  # all the buckets' all-reduce time, hidden or not
    exposed_comm_s: float  # the part after backward's compute ended: it adds to the step
    world_size: int
    buckets: tuple[BucketTiming, ...] = ()

    @property
    def compute_s(self) -> float:
        return self.data_s + self.forward_s + self.backward_s + self.optimizer_s

    @property
    def hidden_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "buckets"}
        return {**out, "compute_s": self.compute_s, "hidden_comm_s": self.hidden_comm_s,
                "buckets": len(self.buckets)}


def _check_phases(phases: Mapping[str, float]) -> dict[str, float]:
    missing = [p for p in COMPUTE_PHASES if p not in phases]
    if missing:
        raise ValueError(f"phases lack {missing}: need seconds for {', '.join(COMPUTE_PHASES)}")
    out = {p: float(phases[p]) for p in COMPUTE_PHASES}
    bad = {p: v for p, v in out.items() if not (math.isfinite(v) and v >= 0)}
    if bad:
        raise ValueError(f"phases {bad} are invalid: seconds must be >= 0")
    return out


def bucket_schedule(bucket_bytes: Sequence[int], backward_s: float, link: LinkModel, world_size: int,
                    op: str = "all_reduce") -> tuple[BucketTiming, ...]:
    """When each bucket is ready, starts and ends, in seconds from the start of backward.

    Buckets come in gradient-ready order (DDP's, after its rebuild at step 0).
    Bucket i is ready when its share of the gradient bytes has been produced,
    gradients being produced uniformly through backward; the all-reduces run
    one after another on the link, each starting when its bucket is ready and
    the previous one has finished.
    """
    sizes = _check_bytes(list(bucket_bytes), "bucket_bytes")
    total = float(sizes.sum())
    timings, free_at, produced = [], 0.0, 0.0
    for i, size in enumerate(sizes.tolist()):
        produced += size
        ready = backward_s * (produced / total if total > 0 else 1.0)
        start = max(ready, free_at)
        free_at = start + link.predict(op, size, world_size)
        timings.append(BucketTiming(i, int(size), ready, start, free_at))
    return tuple(timings)


def predict_ddp_step(phases: Mapping[str, float], bucket_bytes: Sequence[int], link: LinkModel, world_size: int,
                     *, overhead_s: float = 0.0, op: str = "all_reduce") -> StepPrediction:
    """A DDP step from one rank's compute phases (seconds) and DDP's bucket sizes (bytes).

    ``phases``: data, forward, backward and optimizer seconds of one rank
    computing its own (per-rank) batch without DDP. ``overhead_s``: DDP's own
    per-step work (copying gradients into buckets and back, dividing by n,
    hooks), measured elsewhere (``ddp_overhead``). The step is
    data + forward + max(backward, end of the last all-reduce) + optimizer + overhead.
    Nothing here knows how the ranks were launched: the numbers may come from
    loopback, simulated hosts or anywhere else.
    """
    _check_world_size(world_size)
    p = _check_phases(phases)
    if not (math.isfinite(overhead_s) and overhead_s >= 0):
        raise ValueError(f"overhead_s={overhead_s!r} is invalid: must be >= 0 seconds")
    buckets = bucket_schedule(bucket_bytes, p["backward"], link, world_size, op) if world_size > 1 else ()
    comm_end = buckets[-1].end_s if buckets else 0.0
    exposed = max(0.0, comm_end - p["backward"])
    comm = sum(b.end_s - b.start_s for b in buckets)
    step = p["data"] + p["forward"] + max(p["backward"], comm_end) + p["optimizer"] + overhead_s
    return StepPrediction(step_s=step, data_s=p["data"], forward_s=p["forward"], backward_s=p["backward"],
                          optimizer_s=p["optimizer"], overhead_s=overhead_s, comm_s=comm, exposed_comm_s=exposed,
                          world_size=int(world_size), buckets=buckets)


def bucket_frame(prediction: StepPrediction) -> pd.DataFrame:
    """The predicted bucket timeline: one row per bucket (seconds from the start of backward)."""
    return pd.DataFrame([dataclasses.asdict(b) for b in prediction.buckets],
                        columns=["index", "nbytes", "ready_s", "start_s", "end_s"])


# -- measured runs as plain numbers -----------------------------------------------------------------------
WARMUP_STEPS = 3  # steps left out of a run's medians (step 0 builds DDP's buckets; caches warm up)


def _steady(frame: pd.DataFrame, warmup_steps: int) -> pd.DataFrame:
    skip = min(warmup_steps, max(0, int(frame["step"].nunique()) - 1))  # keep at least one step
    first = sorted(frame["step"].unique())[skip]
    return frame[frame["step"] >= first]


def run_numbers(result: Any, warmup_steps: int = WARMUP_STEPS) -> dict[str, Any]:
    """What the cost model needs from one RunResult: step and phase medians, gradient bytes, buckets.

    A step's time is its slowest rank's; phases are the slowest rank's per step.
    """
    steps = _steady(result.steps_frame(), warmup_steps)
    per_step = steps.groupby("step")[["total", *COMPUTE_PHASES]].max()
    cfg = result.config
    sizes = list(result.ranks[0].strategy.get("bucket_sizes_bytes", []))
    return {"tier": cfg.tier, "world_size": cfg.world_size, "per_rank_batch": cfg.per_rank_batch,
            "global_batch": cfg.global_batch_size, "threads_per_rank": cfg.resolved_threads,
            "bucket_cap_mb": float(getattr(cfg.tier_options, "bucket_cap_mb", float("nan"))),
            "step_s": float(per_step["total"].median()),
            **{p: float(per_step[p].median()) for p in COMPUTE_PHASES},
            "gradient_bytes": int(result.ranks[0].memory.get("gradients", 0)),
            "buckets": len(sizes), "bucket_sizes_bytes": " ".join(map(str, sizes)),
            "steps_measured": int(len(per_step))}


def ddp_overhead(single: Mapping[str, Any], ddp_world1: Mapping[str, Any]) -> float:
    """DDP's own per-step cost per gradient byte (s/byte), from two world-size-1 runs of the same job.

    ``single`` and ``ddp_world1`` are ``run_numbers`` of a ``single`` run and a
    ``ddp`` run at world size 1 (no communication), same model and batch: the
    difference is what DDP adds locally. Clipped at 0: noise may make it negative.
    """
    if int(ddp_world1["world_size"]) != 1 or int(single["world_size"]) != 1:
        raise ValueError("ddp_overhead needs two world-size-1 runs: the single run and a ddp run without peers")
    grad = sum(int(s) for s in str(ddp_world1["bucket_sizes_bytes"]).split()) or int(single["gradient_bytes"])
    if grad <= 0:
        raise ValueError("ddp_overhead: the runs report no gradient bytes")
    return max(0.0, float(ddp_world1["step_s"]) - float(single["step_s"])) / grad


def _bucket_list(value: Any) -> list[int]:
    if isinstance(value, str):
        return [int(s) for s in value.split()]
    return [int(v) for v in value]


# -- measuring the validation points ------------------------------------------------------------------------
def measure(cfg: Any, world_sizes: Sequence[int] = (1, 2, 4), rounds: int = 3, *,
            bucket_caps_mb: Sequence[float] | None = None, warmup_steps: int = WARMUP_STEPS,
            log: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Run everything ``validate`` needs, interleaved round after round, and return it as plain numbers.

    ``cfg``: a ``ddp`` RunConfig at the global batch every validation point
    keeps (its world_size is ignored). ``bucket_caps_mb``: the DDP bucket caps
    to validate (default: ``cfg``'s). Per round: for each world size n, a
    ``single`` run at the per-rank batch global/n (the compute that n ranks each
    do) and, per cap, the ``ddp`` run at n; and the overhead calibration -- a
    ``single`` and, per cap, a ``ddp`` run at world size 1 with a batch no
    validation point uses. Rows: round, role (compute, ddp, overhead_single,
    overhead_ddp), bucket_cap_mb and ``run_numbers``.
    """
    if cfg.tier != "ddp":
        raise ValueError(f"measure needs a ddp RunConfig, got tier {cfg.tier!r}")
    for n in world_sizes:
        _check_world_size(n, "world_sizes entry")
        if cfg.global_batch_size % n:
            raise ValueError(f"global_batch_size={cfg.global_batch_size} is not divisible by world size {n}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    caps = tuple(bucket_caps_mb) if bucket_caps_mb is not None else (cfg.tier_options.bucket_cap_mb,)
    if not caps or any(not c > 0 for c in caps):
        raise ValueError(f"bucket_caps_mb={bucket_caps_mb!r} is invalid: give one or more caps > 0 MB")
    plan = _measure_plan(cfg, tuple(world_sizes), caps)
    rows = []
    for r in range(rounds):
        for role, run_cfg in plan:
            rows.append({"round": r, "role": role, **_run(run_cfg, warmup_steps)})
        if log is not None:
            log(f"round {r + 1}/{rounds} done ({len(plan)} runs)")
    return pd.DataFrame(rows)


def overhead_batch(cfg: Any, world_sizes: Sequence[int]) -> int:
    """The batch of the overhead calibration: half the smallest per-rank batch, so no validation point uses it."""
    return max(1, cfg.global_batch_size // (2 * max(world_sizes)))


def _measure_plan(cfg: Any, world_sizes: tuple[int, ...], caps: tuple[float, ...]) -> list[tuple[str, Any]]:
    single = {"tier": "single", "world_size": 1}
    with_cap = {c: cfg.replace(tier_options=dataclasses.replace(cfg.tier_options, bucket_cap_mb=c)) for c in caps}
    batch = overhead_batch(cfg, world_sizes)
    plan = [("compute", cfg.replace(**single, global_batch_size=cfg.global_batch_size // n)) for n in world_sizes]
    plan += [("ddp", with_cap[c].replace(world_size=n)) for c in caps for n in world_sizes]
    plan.append(("overhead_single", cfg.replace(**single, global_batch_size=batch)))
    plan += [("overhead_ddp", with_cap[c].replace(world_size=1, global_batch_size=batch)) for c in caps]
    return plan


def _run(cfg: Any, warmup_steps: int) -> dict[str, Any]:
    from dtlab.train import run

    return run_numbers(run(cfg, progress=False), warmup_steps)


# -- validation ----------------------------------------------------------------------------------------------
def _medians(frame: pd.DataFrame) -> dict[str, float]:
    return {c: float(frame[c].median()) for c in ("step_s", *COMPUTE_PHASES)}


def _same_cap(runs: pd.DataFrame, cap: float | None) -> pd.Series:
    if cap is None or "bucket_cap_mb" not in runs.columns:
        return pd.Series(True, index=runs.index)
    return runs["bucket_cap_mb"] == cap


def overhead_from(runs: pd.DataFrame, bucket_cap_mb: float | None = None) -> float:
    """DDP's per-gradient-byte overhead from ``measure``'s overhead rows (median over rounds) at one cap."""
    single = runs[runs["role"] == "overhead_single"]
    ddp = runs[(runs["role"] == "overhead_ddp") & _same_cap(runs, bucket_cap_mb)]
    if single.empty or ddp.empty:
        raise ValueError(f"the runs have no overhead_single/overhead_ddp rows (bucket_cap_mb={bucket_cap_mb!r}): "
                         "make them with costmodel.measure")
    return ddp_overhead({**single.iloc[0].to_dict(), **_medians(single)}, {**ddp.iloc[0].to_dict(), **_medians(ddp)})


def validate(link: LinkModel, runs: pd.DataFrame, *, cores: int | None = None,
             overhead_s_per_byte: float | None = None) -> pd.DataFrame:
    """Predicted against measured DDP step time, one row per (world size, bucket cap) in ``measure``'s frame.

    Each prediction uses only the ``single`` run at that point's per-rank batch
    (its compute), the ddp run's bucket sizes (a layout, not a time), the link
    and DDP's overhead measured at world size 1 on another batch (or
    ``overhead_s_per_byte``); the measured DDP times are never used to predict.
    A point with more threads than ``cores`` (default: this machine's) is
    marked oversubscribed: the model assumes each rank has its own cores, so it
    is reported but not counted. Columns: label, world_size, bucket_cap_mb,
    predicted_s, measured_s, error (|relative|), signed_error, oversubscribed,
    counted and the predicted parts.
    """
    if not isinstance(runs, pd.DataFrame) or runs.empty:
        raise ValueError("validate: the runs frame is empty: make it with costmodel.measure(...)")
    cores = cores or os.cpu_count() or 1
    ddp = runs[runs["role"] == "ddp"]
    if ddp.empty:
        raise ValueError("validate: the runs frame has no ddp rows: make it with costmodel.measure(...)")
    caps = ddp["bucket_cap_mb"] if "bucket_cap_mb" in ddp.columns else pd.Series(np.nan, index=ddp.index)
    rows = []
    for cap in pd.unique(caps):
        cap = None if pd.isna(cap) else float(cap)
        gamma = overhead_from(runs, cap) if overhead_s_per_byte is None else float(overhead_s_per_byte)
        for n in sorted(set(ddp.loc[_same_cap(ddp, cap), "world_size"])):
            rows.append(_validation_row(link, runs, int(n), cap, gamma, cores))
    return pd.DataFrame(rows)


def _label(n: int, buckets: int, over: bool) -> str:
    return f"n={n}, {buckets} bucket{'s' if buckets != 1 else ''}" + (" (oversubscribed)" if over else "")


def _validation_row(link: LinkModel, runs: pd.DataFrame, n: int, cap: float | None, gamma: float,
                    cores: int) -> dict[str, Any]:
    ddp = runs[(runs["role"] == "ddp") & (runs["world_size"] == n) & _same_cap(runs, cap)]
    batch = int(ddp["per_rank_batch"].iloc[0])
    compute = runs[(runs["role"] == "compute") & (runs["per_rank_batch"] == batch)]
    if compute.empty:
        raise ValueError(f"validate: no single run at the per-rank batch {batch} of world size {n}")
    sizes = _bucket_list(ddp["bucket_sizes_bytes"].iloc[0])
    pred = predict_ddp_step(_medians(compute), sizes, link, n, overhead_s=gamma * sum(sizes))
    measured = float(ddp["step_s"].median())
    threads = int(ddp["threads_per_rank"].iloc[0])
    over = n * threads > cores
    return {"label": _label(n, len(sizes), over), "world_size": n,
            "bucket_cap_mb": float("nan") if cap is None else cap,
            "predicted_s": pred.step_s, "measured_s": measured, "error": abs(pred.step_s / measured - 1),
            "signed_error": pred.step_s / measured - 1, "oversubscribed": over, "counted": not over,
            "compute_s": pred.compute_s, "comm_s": pred.comm_s, "exposed_comm_s": pred.exposed_comm_s,
            "overhead_s": pred.overhead_s, "buckets": len(sizes), "gradient_bytes": sum(sizes),
            "per_rank_batch": batch, "threads_per_rank": threads, "rounds": int(ddp["round"].nunique()),
            "measured_spread_s": float(ddp["step_s"].max() - ddp["step_s"].min())}


# -- validation on simulated hosts with capped links ------------------------------------------------------
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


def measure_links(cfg: Any, caps_mbit: Sequence[float], rounds: int = 3, *, nnodes: int = 2,
                  warmup_steps: int = WARMUP_STEPS, log: Callable[[str], None] | None = None) -> pd.DataFrame:
    """``measure`` for DDP across simulated hosts: one multinode run per link cap, interleaved per round.

    ``cfg``: a ``ddp`` RunConfig (its world_size is ignored; one rank per node).
    Besides the multinode runs (role ddp, column link_mbit), each round runs
    the same compute and overhead calibration as ``measure``, all on this
    machine without a network. Needs root (see ``dtlab.linksweep``).
    """
    from dtlab import linksweep

    if cfg.tier != "ddp":
        raise ValueError(f"measure_links needs a ddp RunConfig, got tier {cfg.tier!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: must be an integer >= 1")
    multinode = linksweep.link_configs(cfg.replace(world_size=nnodes), caps_mbit, ("allreduce",), nnodes=nnodes)
    plan = [(role, c) for role, c in _measure_plan(cfg, (nnodes,), (cfg.tier_options.bucket_cap_mb,))
            if role != "ddp"]
    plan += [("ddp", c) for c in multinode]
    rows = []
    for r in range(rounds):
        for role, run_cfg in plan:
            mbit = float(getattr(run_cfg.tier_options, "link_mbit", float("nan")))
            rows.append({"round": r, "role": role, "link_mbit": mbit if role == "ddp" else float("nan"),
                         **_run(run_cfg, warmup_steps)})
        if log is not None:
            log(f"round {r + 1}/{rounds} done ({len(plan)} runs)")
    return pd.DataFrame(rows)


def validate_links(link: LinkModel, runs: pd.DataFrame, *, cores: int | None = None) -> pd.DataFrame:
    """``validate`` for ``measure_links``' frame: each cap predicted with ``capped(link, cap)``.

    The link is the loopback calibration; the cap enters only through ``capped``
    -- nothing is fitted on the multinode runs.
    """
    from dtlab import linksweep

    if "link_mbit" not in runs.columns:
        raise ValueError("validate_links: the runs have no link_mbit column: make them with measure_links")
    ddp = runs[runs["role"] == "ddp"]
    if ddp.empty:
        raise ValueError("validate_links: the runs frame has no multinode (ddp) rows")
    cores = cores or os.cpu_count() or 1
    cap_mb = float(ddp["bucket_cap_mb"].iloc[0])
    gamma = overhead_from(runs, cap_mb)
    rows = []
    for mbit in sorted(ddp["link_mbit"].unique(), reverse=True):
        keep = (runs["role"] != "ddp") | (runs["link_mbit"] == mbit)
        n = int(ddp.loc[ddp["link_mbit"] == mbit, "world_size"].iloc[0])
        row = _validation_row(capped(link, float(mbit)), runs[keep], n, cap_mb, gamma, cores)
        label = f"n={n}, {linksweep.mbit_label(mbit)} simulated hosts" + (" (oversubscribed)" if row["oversubscribed"]
                                                                           else "")
        rows.append({**row, "label": label, "link_mbit": float(mbit)})
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame, median_target: float = MEDIAN_TARGET, max_target: float = MAX_TARGET) -> dict[str, Any]:
    """Median and worst error over the counted points, and whether they meet the targets."""
    for col in ("error", "counted"):
        if col not in df.columns:
            raise ValueError(f"summary: missing column {col!r}: pass validate()'s frame")
    counted = df[df["counted"].astype(bool)]
    if counted.empty:
        raise ValueError("summary: no counted points (every point is oversubscribed)")
    med, worst = float(counted["error"].median()), float(counted["error"].max())
    return {"median_error": med, "max_error": worst, "counted": len(counted), "reported": len(df),
            "median_target": median_target, "max_target": max_target,
            "median_ok": med <= median_target, "max_ok": worst <= max_target,
            "passed": med <= median_target and worst <= max_target}


def summary_line(df: pd.DataFrame) -> str:
    """The summary in one sentence, with the numbers of this run."""
    s = summary(df)
    verdict = "meets" if s["passed"] else "misses"
    return (f"median error {s['median_error']:.1%} (target <= {s['median_target']:.0%}), worst "
            f"{s['max_error']:.1%} (target <= {s['max_target']:.0%}) over {s['counted']} counted of "
            f"{s['reported']} points: {verdict} the targets")


# -- what-if projection -------------------------------------------------------------------------------------------
DEFAULT_WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BUCKET_BYTES = 25 * MIB  # DDP's default bucket_cap_mb


def split_buckets(model_bytes: int, bucket_bytes: int) -> list[int]:
    """``model_bytes`` of gradients in buckets of ``bucket_bytes`` (the last one takes the rest)."""
    _check_bytes(model_bytes, "model_bytes")
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} is invalid: must be > 0")
    full, rest = divmod(int(model_bytes), int(bucket_bytes))
    return [int(bucket_bytes)] * full + ([rest] if rest else [])


def project(per_rank_compute_s: float, model_bytes: int, links: Iterable[LinkModel],
            world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            overlap: float = 2 / 3, overhead_s_per_byte: float = 0.0) -> pd.DataFrame:
    """Predicted DDP step, speedup and efficiency per world size and link: a simulation, not a measurement.

    Weak scaling: every rank keeps its batch, so its compute stays
    ``per_rank_compute_s``. ``overlap``: the fraction of that compute which is
    backward, during which buckets can already be reduced (0: every all-reduce
    waits for the end of compute). Speedup is samples/s over one rank without
    DDP (n * t1 / t_n); efficiency is speedup / n.
    """
    if not (math.isfinite(per_rank_compute_s) and per_rank_compute_s > 0):
        raise ValueError(f"per_rank_compute_s={per_rank_compute_s!r} is invalid: must be > 0 seconds")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap={overlap!r} is invalid: must be between 0 and 1")
    links = list(links)
    if not links:
        raise ValueError("project: links is empty: pass at least one LinkModel")
    for n in world_sizes:
        _check_world_size(n, "world_sizes entry")
    sizes = split_buckets(model_bytes, bucket_bytes)
    phases = {"data": 0.0, "forward": per_rank_compute_s * (1 - overlap), "backward": per_rank_compute_s * overlap,
              "optimizer": 0.0}
    overhead = overhead_s_per_byte * sum(sizes)
    rows = []
    for link in links:
        for n in world_sizes:
            pred = predict_ddp_step(phases, sizes, link, int(n), overhead_s=overhead)
            speedup = n * per_rank_compute_s / pred.step_s
            rows.append({"link": link.label, "world_size": int(n), "step_s": pred.step_s,
                         "compute_s": per_rank_compute_s, "comm_s": pred.comm_s,
                         "exposed_comm_s": pred.exposed_comm_s, "overhead_s": overhead, "speedup": speedup,
                         "efficiency": speedup / n, "buckets": len(sizes)})
    return pd.DataFrame(rows)


def assumptions(links: Iterable[LinkModel], per_rank_compute_s: float, model_bytes: int, *,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: float = 2 / 3,
                overhead_s_per_byte: float = 0.0) -> list[str]:
    """What ``project`` assumes, one sentence each, with the numbers it was given."""
    lines = [
        "SIMULATION: the alpha-beta model extrapolated, not a measurement.",
        f"Weak scaling: each rank computes {per_rank_compute_s * 1e3:.3g} ms per step on its own batch, "
        "identically on every rank (no stragglers, no contention for cores or memory).",
        f"{model_bytes / MIB:.3g} MiB of gradients in {len(split_buckets(model_bytes, bucket_bytes))} bucket(s) of "
        f"at most {bucket_bytes / MIB:.3g} MiB, produced uniformly through backward, which is {overlap:.0%} of "
        "the compute; the buckets' all-reduces run one at a time.",
        f"DDP's local overhead: {overhead_s_per_byte * 1e9:.3g} ns per gradient byte per step.",
    ]
    for link in links:
        lines.append(f"Link {link.label!r}: alpha {link.alpha_s * 1e6:.3g} us, {link.bandwidth_gbps:.3g} GB/s, "
                     f"all-reduce by {ALGORITHM_NAMES[link.backend]['all_reduce']}: 2(n-1) alpha + 2(n-1)/n S beta, "
                     "the same bandwidth between every pair of ranks (a flat network, no oversubscribed switches).")
    lines.append("A ring's latency term grows with n: past a few hundred ranks NCCL would switch to trees, "
                 "which this model does not.")
    return lines


def timeline_frame(prediction: StepPrediction) -> pd.DataFrame:
    """The predicted step as Gantt rows (lane, phase, start, end in seconds): for ``plots.gantt``.

    Lane "compute" holds the phases, with "idle" where backward's compute has
    ended but the last all-reduce has not; lane "comm" holds the buckets.
    """
    p = prediction
    t_bwd = p.data_s + p.forward_s
    wait = max(p.backward_s, p.buckets[-1].end_s if p.buckets else 0.0) - p.backward_s
    parts = [("data", p.data_s), ("forward", p.forward_s), ("backward", p.backward_s), ("idle", wait),
             ("ddp overhead", p.overhead_s), ("optimizer", p.optimizer_s)]
    rows, t = [], 0.0
    for name, seconds in parts:
        if seconds > 0:
            rows.append({"lane": "compute", "phase": name, "start": t, "end": t + seconds})
        t += seconds
    rows += [{"lane": "comm", "phase": "all_reduce", "start": t_bwd + b.start_s, "end": t_bwd + b.end_s}
             for b in p.buckets]
    return pd.DataFrame(rows, columns=["lane", "phase", "start", "end"])
