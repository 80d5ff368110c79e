"""A job's compute predicted on this machine's measured roofline: its ops (``ops.job_ops``) timed, not run.

Per phase of dtlab's loop (data, forward, backward, optimizer), the phase's ops on the placement's
``Device`` (``model.op_seconds``: a GEMM at the rate its shape reaches, every other op at the memory
bandwidth), plus eager PyTorch's cost of running them from dtlab's loop (``cpu.Overhead``: a fixed
cost per step and a cost per op, per phase). The placement is the job's: ``threads`` torch threads
per rank, as many copies at once as the job has ranks (they share the cores).
"""

from __future__ import annotations

from collections.abc import Iterable

from dtlab.core.config import RunConfig
from dtlab.cost.roofline.cpu import Placement, Roofline
from dtlab.cost.roofline.model import Op, op_seconds
from dtlab.cost.roofline.ops import PHASES, by_phase, job_ops

__all__ = ["op_phase_seconds", "predicted_phases"]


def op_phase_seconds(ops: Iterable[Op], placement: Placement) -> dict[str, float]:
    """Seconds per phase of ``ops`` on ``placement``: the roofline's time of each op plus the overhead."""
    out = {}
    for phase, phase_ops in by_phase(ops).items():
        count = sum(op.count for op in phase_ops)
        roof = sum(op_seconds(op, placement.device) * op.count for op in phase_ops)
        out[phase] = placement.overhead.seconds(phase, count) + roof
    return out


def predicted_phases(cfg: RunConfig, roofline: Roofline, batch: int | None = None,
                     copies: int | None = None) -> dict[str, float]:
    """One rank's phases (``PHASES``, seconds) for ``cfg``'s model at ``batch`` samples (default: a rank's
    batch), with ``cfg.resolved_threads`` threads, ``copies`` processes at once (default: the job's ranks)."""
    if cfg.precision != "fp32" or cfg.dtype != "float32":
        raise ValueError(f"the roofline is measured for float32 (fp32 GEMMs): precision={cfg.precision!r}, "
                         f"dtype={cfg.dtype!r} cannot be predicted on it")
    placement, scale = roofline.placement(cfg.resolved_threads, int(copies or cfg.world_size))
    seconds = op_phase_seconds(job_ops(cfg, batch or cfg.per_rank_batch), placement)
    return {p: seconds.get(p, 0.0) * scale for p in PHASES}
