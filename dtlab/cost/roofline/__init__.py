"""Rooflines: a step's compute from its operations' FLOPs and bytes on a device's measured curves."""

from dtlab.cost.roofline.model import (
    ATTENTION,
    GEMM,
    KINDS,
    MEMORY,
    ComputeTime,
    Device,
    Op,
    compute_time,
    gemm,
    op_seconds,
)

__all__ = ["ATTENTION", "GEMM", "KINDS", "MEMORY", "ComputeTime", "Device", "Op", "compute_time", "gemm", "op_seconds"]
