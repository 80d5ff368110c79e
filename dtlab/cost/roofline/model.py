"""The roofline a step's compute is timed on: its operations (FLOPs and bytes each) and a device to run them.

An ``Op`` is one kind of operation of a training step — a GEMM of a known shape,
a fused (flash) attention, or a memory-bound pass (a norm, an activation, the
optimizer) — with its FLOPs and the bytes it moves, and how many times a step
runs it. A ``Device`` gives the peak FLOP/s per dtype, the memory bandwidth and
how close a GEMM of a given shape comes to the peak (an efficiency curve measured
on that device: published measurements for a GPU, this machine's own for the
CPU), and optionally the same for fused attention.
``op_seconds`` is the roofline: the slower of computing at the attainable rate
and moving the bytes at the bandwidth. No utilisation is assumed anywhere: it is
what comes out (``ComputeTime.mfu``).

Model FLOPs count the forward and backward a step needs; hardware FLOPs add what
recomputation runs again (``Op.recomputed``). The two are reported apart, never mixed.
``Op.flops`` is what those counts take (the usual convention: a causal attention counted
as if unmasked); ``Op.executed`` is the fraction of it the kernel really runs (a causal
flash attention skips the masked blocks, its backward recomputes the scores), which only
the time uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

GEMM, ATTENTION, MEMORY = "gemm", "attention", "memory"
KINDS = (GEMM, ATTENTION, MEMORY)


@dataclass(frozen=True)
class Op:
    """One operation of a step, run ``count`` times per step (layers x passes x micro-batches).

    ``shape`` is a GEMM's (m, n, k): an (m x k) by (k x n) product, 2mnk FLOPs; an attention's
    (query length, key length, head dimension). ``recomputed`` marks the extra forward that
    activation recomputation runs: hardware FLOPs, not model FLOPs. ``executed``: the fraction
    of ``flops`` the kernel runs (the time's, not the counts').
    """

    name: str
    kind: str
    flops: float
    bytes: float
    count: float = 1.0
    shape: tuple[int, int, int] | None = None
    dtype: str = "bf16"
    recomputed: bool = False
    executed: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Op {self.name!r}: kind={self.kind!r} is invalid: choose one of {', '.join(KINDS)}")
        if self.kind != MEMORY and self.shape is None:
            raise ValueError(f"Op {self.name!r}: a {self.kind} op needs its shape")
        if min(self.flops, self.bytes, self.count, self.executed) < 0:
            raise ValueError(f"Op {self.name!r}: flops, bytes, count and executed must be >= 0")

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else float("inf")


def gemm(name: str, m: int, n: int, k: int, *, dtype: str = "bf16", itemsize: int = 2, count: float = 1.0,
         recomputed: bool = False) -> Op:
    """An (m x k) @ (k x n) product: 2mnk FLOPs, reading both operands and writing the result once."""
    return Op(name, GEMM, 2.0 * m * n * k, float(itemsize * (m * k + k * n + m * n)), count, (m, n, k), dtype,
              recomputed)


@dataclass(frozen=True)
class Device:
    """What an op's time depends on. ``gemm_efficiency(m, n, k, dtype)`` is the fraction of the dtype's
    peak a GEMM of that shape reaches on its own (the device's measured curve); ``attention_efficiency
    (s_q, s_kv, head_dim, dtype)`` the same for a fused attention's executed FLOPs (None: timed as a GEMM
    of its shape); ``sources`` cite them."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    gemm_efficiency: Callable[[int, int, int, str], float]
    sources: tuple[str, ...] = ()
    attention_efficiency: Callable[[int, int, int, str], float] | None = None

    def peak(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(f"device {self.name!r} has no peak for dtype {dtype!r} "
                             f"(it knows {', '.join(self.peak_flops)})") from None


def op_seconds(op: Op, device: Device) -> float:
    """One execution of ``op``: the slower of its FLOPs at the attainable rate and its bytes at the bandwidth."""
    if op.kind == MEMORY:
        rate = device.peak(op.dtype)
    else:
        a, b, c = op.shape  # type: ignore[misc]
        curve = device.attention_efficiency if op.kind == ATTENTION else None
        rate = device.peak(op.dtype) * (curve or device.gemm_efficiency)(a, b, c, op.dtype)
    compute = op.flops * op.executed / rate if op.flops else 0.0
    return max(compute, op.bytes / device.memory_bandwidth)


@dataclass(frozen=True)
class ComputeTime:
    """A step's compute on a device: seconds, model and hardware FLOPs, and seconds per op name."""

    seconds: float
    model_flops: float
    hardware_flops: float
    by_op: Mapping[str, float] = field(default_factory=dict)

    def mfu(self, step_seconds: float, peak: float) -> float:
        """Model FLOPs utilisation of a step that took ``step_seconds`` on a device of ``peak`` FLOP/s."""
        return self.model_flops / (step_seconds * peak)

    def hfu(self, step_seconds: float, peak: float) -> float:
        """Hardware FLOPs utilisation: recomputation counted."""
        return self.hardware_flops / (step_seconds * peak)


def compute_time(ops: Iterable[Op], device: Device) -> ComputeTime:
    """The ops of a step, one after another on ``device`` (overlap with communication is the caller's)."""
    seconds = model = hardware = 0.0
    by_op: dict[str, float] = {}
    for op in ops:
        t = op_seconds(op, device) * op.count
        seconds += t
        by_op[op.name] = by_op.get(op.name, 0.0) + t
        hardware += op.flops * op.count
        if not op.recomputed:
            model += op.flops * op.count
    return ComputeTime(seconds, model, hardware, by_op)
