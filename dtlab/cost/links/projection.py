"""What-if projection: the step model extrapolated to world sizes and links this machine does not have.

A simulation, not a measurement: ``assumptions`` says what it takes for granted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pandas as pd

from dtlab.cost.links.alpha_beta import ALGORITHM_NAMES, LinkModel, check_bytes, check_world_size
from dtlab.cost.links.buckets import predict_ddp_step

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_WORLD_SIZES", "MIB", "assumptions", "project", "split_buckets"]

MIB = 2**20
DEFAULT_WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BUCKET_BYTES = 25 * MIB  # DDP's default bucket_cap_mb


def split_buckets(model_bytes: int, bucket_bytes: int) -> list[int]:
    """``model_bytes`` of gradients in buckets of ``bucket_bytes`` (the last one takes the rest)."""
    check_bytes(model_bytes, "model_bytes")
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
        check_world_size(n, "world_sizes entry")
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
