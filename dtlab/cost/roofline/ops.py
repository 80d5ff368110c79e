"""A training step's operations as ``Op``s, counted from the model itself rather than from formulas.

``job_ops(cfg)`` builds the job's model on fake tensors (``FakeTensorMode``: shapes and
dtypes, no storage) and runs two steps of it -- the batch gathered from the data set, the
forward with the loss, backward, the optimizer step and ``zero_grad``, as dtlab's loop runs
them -- under a ``TorchDispatchMode`` that sees every aten op the step dispatches: the
forward's, the ones autograd runs for backward, the optimizer's. The second step is the
one kept (the first creates the optimizer's state). ``count_ops`` does the same for any
module and batch. Per op:

* FLOPs from torch's own formulas (``torch.utils.flop_counter``'s registry, the one
  ``FlopCounterMode`` uses), with CPU's fused attention kernel (not in that registry) counted
  by torch's attention formulas; every other op counts no FLOPs;
* bytes: every tensor it reads and every tensor it writes, at their sizes (an op that reads
  a tensor the previous op wrote is charged again: no cache reuse is assumed);
* a GEMM's shape (m, n, k): ``mm``, ``addmm``; ``bmm``/``baddbmm`` and attention per batch
  entry; a convolution as its implicit GEMM (m = output positions, n = output channels,
  k = input channels x kernel size).

Views and metadata queries (``view``, ``t``, ``detach``, ...) move nothing and launch no
kernel: they are left out. Identical ops (same phase, op, shape, FLOPs and bytes) are one
``Op`` with a count. An op's name is ``phase:aten_op`` (phases ``data``, ``forward``,
``backward``, ``optimizer``). Under activation checkpointing the forward that backward runs
again is marked ``recomputed``: the ops backward runs beyond those of the same job without
checkpointing.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.job import load_data, optimizer_factory, optimizer_params, routing, torch_dtype
from dtlab.core.moe import even_assign, routing_of
from dtlab.cost.roofline.model import GEMM, MEMORY, Op

__all__ = ["PHASES", "by_phase", "count_ops", "dtype_name", "job_ops"]

PHASES = ("data", "forward", "backward", "optimizer")
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
aten = torch.ops.aten
_CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_NO_KERNEL = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.detach,
              aten.alias, aten.as_strided, aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.split,
              aten.split_with_sizes, aten.lift_fresh, aten.unbind, aten._reshape_alias, aten.chunk}
# a gather reads the rows it picks, not its whole source
_GATHERS = {aten.index, aten.embedding, aten.index_select, aten.gather}


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as a ``Device`` names it: ``fp32``, ``bf16``, ``fp16``, ``fp64``."""
    return DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _gemm_shape(func: Any, args: tuple, out: Any) -> tuple[int, int, int] | None:
    """(m, n, k) of one GEMM the op runs (per batch entry for batched ones), or None if it is no GEMM."""
    packet = func._overloadpacket
    if packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
        a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
        return int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1])
    if func in (_CPU_ATTENTION, _CPU_ATTENTION_BACKWARD):  # scores: (s_q x d) @ (d x s_k) per batch and head
        q, k = (args[0], args[1]) if func is _CPU_ATTENTION else (args[1], args[2])
        return int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1])
    if packet in (aten.convolution, aten.convolution_backward):
        x, w = (args[0], args[1]) if packet is aten.convolution else (args[1], args[2])
        y = out if packet is aten.convolution else args[0]
        return int(y.numel() // y.shape[1]), int(w.shape[0]), int(math.prod(w.shape[1:]))
    return None


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    if func is _CPU_ATTENTION:
        return float(flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    if func is _CPU_ATTENTION_BACKWARD:
        return float(flop_counter.sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape,
                                                           args[3].shape))
    formula = flop_counter.flop_registry.get(func._overloadpacket)
    return float(formula(*args, **kwargs, out_val=out)) if formula else 0.0


class _Counter(TorchDispatchMode):
    """Every aten op dispatched while active, as (phase, op, shape, FLOPs, bytes, dtype, recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "data"
        self.keep = False
        self.rows: Counter[tuple] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)  # None: a higher-order op, whose own ops come through
        if not self.keep or packet is None or packet in _NO_KERNEL or func.namespace != "aten":
            return out
        read, written = _tensors((args, kwargs)), _tensors(out)
        if not read and not written:  # a metadata query (sizes, strides)
            return out
        if packet in _GATHERS:
            read = _tensors(args[1:]) + written  # the indices, and the rows picked (as many as it writes)
        dtype = next((t.dtype for t in read + written if t.is_floating_point()), torch.float32)
        shape = _gemm_shape(func, args, out)
        flops = _flops(func, args, kwargs, out)
        name = f"{self.phase}:{packet.__name__}"
        self.rows[(name, shape if flops else None, flops, float(_nbytes(read) + _nbytes(written)),
                   dtype_name(dtype))] += 1
        return out


def _as_ops(rows: Counter[tuple], recomputed: Counter[tuple] | None = None) -> list[Op]:
    ops = []
    for (name, shape, flops, nbytes, dtype), count in rows.items():
        again = min(count, (recomputed or Counter())[(name, shape, flops, nbytes, dtype)])
        for n, is_again in ((count - again, False), (again, True)):
            if n:
                ops.append(Op(name, GEMM if shape else MEMORY, flops, nbytes, float(n), shape, dtype, is_again))
    return ops


def count_ops(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
              make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
              precision: str = "fp32", data: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[Op]:
    """The ops of one steady training step of ``model`` on the batch (``x``, ``y``): forward and the loss
    (``models.training_loss``), backward, ``make_optimizer``'s step and ``zero_grad``; with ``data`` (the
    data set's inputs and targets), also the batch's gathering from it by index, as dtlab's loop does.
    Real or fake tensors alike (nothing is timed). ``precision`` ``bf16``: forward and loss under CPU autocast."""
    optimizer = make_optimizer(optimizer_params(model, make_optimizer))
    counter = _Counter()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    idx = torch.arange(len(x))
    with counter:
        for step in range(2):  # the first creates the optimizer's state: the second is every later step
            counter.keep = step == 1
            counter.phase = "data"
            if data is not None:
                x, y = data[0][idx], data[1][idx]
            counter.phase = "forward"
            with cast:
                loss = models.training_loss(model, model(x), y)
            counter.phase = "backward"
            loss.backward()
            counter.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _as_ops(counter.rows)


def _rows(cfg: RunConfig, batch: int) -> Counter[tuple]:
    data = load_data(cfg)
    mode = FakeTensorMode()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(cfg))  # made in the job's dtype: converting fake parameters fails
    try:
        with mode:
            model = models.build(cfg.model, data.input_shape, data.num_classes, cfg.model_size, cfg.model_depth,
                                 routing(cfg))
            if cfg.activation_checkpointing:
                models.checkpoint_blocks(model)
    finally:
        torch.set_default_dtype(previous)
    for layer in routing_of(model):
        layer.assign = functools.partial(even_assign, layer.routing)
    x, y = (mode.from_tensor(t) for t in (data.train_x[:batch], data.train_y[:batch]))
    whole = (mode.from_tensor(data.train_x), mode.from_tensor(data.train_y))
    with mode:
        ops = count_ops(model, x, y, optimizer_factory(cfg), cfg.precision, data=whole)
    return Counter({(op.name, op.shape, op.flops, op.bytes, op.dtype): int(op.count) for op in ops})


def job_ops(cfg: RunConfig, batch: int | None = None) -> list[Op]:
    """The ops of one steady step of ``cfg``'s model in one process at ``batch`` samples (default: the
    global batch), on fake tensors: nothing is allocated or timed, so any size costs the same."""
    batch = int(batch or cfg.global_batch_size)
    if batch < 1:
        raise ValueError(f"job_ops: batch={batch} is invalid: need at least one sample")
    rows = _rows(cfg, batch)
    if not cfg.activation_checkpointing:
        return _as_ops(rows)
    plain = _rows(cfg.replace(activation_checkpointing=False), batch)
    again = Counter({k: v for k, v in (rows - plain).items() if k[0].startswith("backward:")})
    return _as_ops(rows, again)


def by_phase(ops: Iterable[Op]) -> dict[str, list[Op]]:
    """The ops grouped by the phase their name starts with (``PHASES``, in that order)."""
    out: dict[str, list[Op]] = {p: [] for p in PHASES}
    for op in ops:
        out.setdefault(op.name.split(":", 1)[0], []).append(op)
    return out
