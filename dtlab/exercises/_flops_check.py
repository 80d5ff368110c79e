"""The layer_flops exercise's judge: the learner's count held against the planner's own, narrowed to a term.

The shapes are drawn for each check from the operating system's randomness (four kinds: multi-head,
grouped-query and multi-query attention, plain and gated MLPs, bf16 and fp32), so no answer can be
written down before the check runs. The learner's function may not ask the planner: a call into
``dtlab.cost.planner`` while it runs (noted by ``sys.setprofile``, whatever name the planner was
reached through) is refused. A wrong count is narrowed down to its term by asking the function about
shapes that change one thing at a time -- the batch, the MLP's width, the number of key/value heads,
the sequence length at a fixed number of tokens, the dtype -- and comparing how its answer moves with
how the planner's does.
"""

from __future__ import annotations

import math
import numbers
import os
import random
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.ops import stage_ops
from dtlab.cost.planner.transformer import TransformerSpec
from dtlab.cost.roofline.model import MEMORY

__all__ = ["Shape", "draw_shapes", "judge", "planner_count"]

PRECISION = {2: "bf16", 4: "fp32"}  # dtype_bytes -> the planner's precision
_PLANNER = os.path.dirname(stage_ops.__code__.co_filename)  # dtlab/cost/planner: the count the learner's is held to


@dataclass(frozen=True)
class Shape:
    """One test case: the arguments of the learner's function, and what the shape is."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int
    dtype_bytes: int
    gated: bool

    def args(self) -> tuple[int, int, int, int, int, int, int, bool]:
        return (self.hidden, self.heads, self.kv_heads, self.ffn, self.seq, self.batch, self.dtype_bytes, self.gated)

    def text(self) -> str:
        return (f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}, ffn={self.ffn}, seq={self.seq}, "
                f"batch={self.batch}, dtype_bytes={self.dtype_bytes}, gated={self.gated}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def draw_shapes(rng: random.Random) -> tuple[Shape, ...]:
    """Four layers, one of each kind, their sizes drawn by ``rng``. Every head count is even (so that kv_heads can
    halve), every seq even (so that the same tokens fit in sequences half as long), and the kinds with a batch of at
    least 2 come first and third (so that a count for one sequence shows)."""
    h1, d1 = rng.choice((8, 12, 16, 20, 24, 32)), rng.choice((64, 80, 96, 128))
    h2, d2 = rng.choice((16, 24, 32, 40, 48, 64)), 128
    kv2 = rng.choice([k for k in (2, 4, 8) if h2 % k == 0])
    h3, d3 = rng.choice((4, 6, 8, 12)), rng.choice((32, 48, 64))
    h4, d4 = rng.choice((8, 12, 16, 32)), rng.choice((64, 128))
    w2, w3 = h2 * d2, h3 * d3
    return (
        Shape(f"multi-head attention ({h1} heads) and a 4h MLP, bf16", h1 * d1, h1, h1, 4 * h1 * d1,
              64 * rng.randint(2, 32), rng.randint(2, 8), 2, False),
        Shape(f"grouped-query attention ({kv2} key/value heads of {h2}) and a gated MLP, bf16", w2, h2, kv2,
              256 * round(rng.uniform(2.5, 3.5) * w2 / 256), 256 * rng.randint(2, 16), rng.randint(1, 4), 2, True),
        Shape(f"grouped-query attention ({h3 // 2} key/value heads of {h3}) and a gated MLP, fp32", w3, h3, h3 // 2,
              16 * round(rng.uniform(2.0, 3.0) * w3 / 16), 32 * rng.randint(2, 16), rng.randint(2, 8), 4, True),
        Shape(f"multi-query attention (1 key/value head of {h4}) and a 4h MLP, fp32", h4 * d4, h4, 1, 4 * h4 * d4,
              128 * rng.randint(2, 16), rng.randint(1, 4), 4, False),
    )


def planner_count(shape: Shape) -> tuple[float, float]:
    """The planner's count for ``shape``: the forward ops of one layer (``planner.ops.stage_ops``) at tp = 1,
    their GEMM and attention FLOPs and every op's bytes."""
    spec = TransformerSpec("layer", layers=1, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                           ffn=shape.ffn, seq=shape.seq, vocab=1, gated_mlp=shape.gated)
    layout = Layout(dp=1, tp=1, pp=1, zero=0, checkpointing="none", micro_batch=shape.batch,
                    precision=PRECISION[shape.dtype_bytes])
    ops = stage_ops(spec, layout, first=False, last=False).forward
    return (sum(op.flops * op.count for op in ops if op.kind != MEMORY), sum(op.bytes * op.count for op in ops))


class _PlannerWatch:
    """Notes the first call into the planner's code while the learner's function runs: ``sys.setprofile`` sees
    every Python function called, by its code's file, under whatever name or path it was reached."""

    def __init__(self) -> None:
        self.first: str | None = None
        self._previous: Any = None

    def __enter__(self) -> _PlannerWatch:
        self._previous = sys.getprofile()
        sys.setprofile(self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._previous)

    def _on_event(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and self.first is None and frame.f_code.co_filename.startswith(_PLANNER):
            module = str(frame.f_globals.get("__name__", "dtlab.cost.planner"))
            self.first = f"{module}.{frame.f_code.co_name}"


# -- judging -----------------------------------------------------------------------------------------------------
class Answer(Exception):
    """What the learner's function did wrong on a shape, as feedback."""


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.5)


def _ask(fn: Callable[..., Any], shape: Shape) -> tuple[float, float]:
    """The learner's (flops, bytes) for ``shape``; Answer if it raised, returned something else or asked the
    planner."""
    try:
        with _PlannerWatch() as watch:
            got = fn(*shape.args())
    except Exception as exc:  # noqa: BLE001 - any error of the learner's is feedback
        raise Answer(f"your function raised {type(exc).__name__} with {shape.text()}: "
                     f"{(str(exc).splitlines() or [''])[0]}") from None
    if watch.first is not None:
        raise Answer(f"your function called the planner ({watch.first}) with {shape.text()}: the check holds your "
                     "count against the planner's, so the planner's own count is no answer. Count the ops yourself")
    if (not isinstance(got, tuple | list) or len(got) != 2
            or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in got)
            or not all(math.isfinite(float(v)) and float(v) >= 0 for v in got)):
        raise Answer(f"return two numbers >= 0, (flops, bytes); with {shape.text()} your function returned {got!r}")
    return float(got[0]), float(got[1])


def _moves(fn: Callable[..., Any], shape: Shape, changed: Shape, which: int) -> tuple[float, float]:
    """How the learner's and the planner's ``which`` (0 FLOPs, 1 bytes) change from ``shape`` to ``changed``."""
    return (_ask(fn, changed)[which] - _ask(fn, shape)[which],
            planner_count(changed)[which] - planner_count(shape)[which])


def _same_tokens_longer(shape: Shape) -> Shape:
    """The same tokens in sequences twice as long (or half as long, where the batch cannot halve)."""
    if shape.batch % 2 == 0:
        return replace(shape, seq=shape.seq * 2, batch=shape.batch // 2)
    return replace(shape, seq=shape.seq // 2, batch=shape.batch * 2)


def _other_kv(shape: Shape) -> Shape:
    return replace(shape, kv_heads=shape.heads if shape.kv_heads != shape.heads else shape.heads // 2)


def _ratio(mine: float, planner: float) -> float:
    return mine / planner if planner else math.inf


def _near(ratio: float, value: float) -> bool:
    return math.isclose(ratio, value, rel_tol=1e-6)


def _attention_flops(mine: float, planner: float, shape: Shape) -> str:
    r = _ratio(mine, planner)
    if _near(r, 0.5):  # a multiply-add counted as 1 FLOP, or a causal halving: the same number whatever the shape
        why = ("Q K^T and P V are T seq hidden multiply-adds each over all the heads, and a multiply-add is 2 FLOPs: "
               "4 T seq hidden in all. Halved for the causal mask? The convention counts a causal attention as if "
               "unmasked (the planner knows a causal kernel runs about half of them, and uses that for the time, not "
               "the count)")
    elif _near(r, 2):
        why = "Q K^T is 2 T seq hidden FLOPs over all the heads and P V another 2 T seq hidden: count each once"
    elif _near(r * shape.heads, 1):
        why = "one head's: add up the heads (heads x head_dim = hidden)"
    elif mine == 0:
        why = "you count none: the scores and the weighted sum grow with T x seq"
    else:
        why = "Q K^T and P V are 2 T seq hidden FLOPs each, all the heads together"
    return (f"your attention FLOPs (what changes when the same tokens come in longer sequences) are {r:.3g}x the "
            f"planner's: {why}")


def _mlp_flops(mine: float, planner: float, shape: Shape) -> str:
    r = _ratio(mine, planner)
    if shape.gated and _near(r, 2 / 3):
        why = ("the MLP has three matrices when gated: the gate and the up projection (hidden -> ffn each, one GEMM "
               "2 ffn wide) and the down projection")
    elif not shape.gated and _near(r, 1.5):
        why = "a plain MLP has two matrices (hidden -> ffn and ffn -> hidden); only a gated one has a third"
    elif _near(r, 0.5):
        why = ("half: a multiply-add is 2 FLOPs, 2 m n k for an (m x k) @ (k x n) GEMM (and both the GEMM into the "
               "MLP and the one out of it grow with ffn)")
    else:
        why = "into the MLP 2 T hidden x (2 ffn if gated, else ffn) FLOPs, out of it 2 T ffn hidden"
    return f"your MLP FLOPs (what changes with ffn) are {r:.3g}x the planner's: {why}"


def _kv_text(mine: float, planner: float, what: str) -> str:
    if mine == 0:
        return (f"your {what} do not change with kv_heads: with grouped-query attention K and V have kv_heads x "
                "head_dim columns each (head_dim = hidden / heads), not hidden")
    where = "the QKV GEMM" if what == "FLOPs" else "the QKV GEMM's weight and result, and the flash attention's inputs"
    return (f"your {what} change with kv_heads {_ratio(mine, planner):.3g}x as much as the planner's: K and V have "
            f"kv_heads x head_dim columns each, in {where}")


def _batch_flops(fn: Callable[..., Any], shape: Shape, got: float) -> str | None:
    """Every FLOP is per token, so the count doubles with the batch (the planner's does)."""
    doubled = _ask(fn, replace(shape, batch=2 * shape.batch))[0]
    if _close(doubled, 2 * got):
        return None
    if _close(doubled, got):
        return ("your FLOPs do not change with batch: the layer runs on T = batch x seq tokens (batch sequences of "
                "seq each), and every term grows with T")
    return (f"your FLOPs grow {_ratio(doubled, got):.3g}x when the batch doubles, not 2x: every term is per token, "
            "T = batch x seq, and attention compares each query with the keys of its own sequence (seq of them), "
            "not with all T tokens")


def _flops_problem(fn: Callable[..., Any], shape: Shape, got: float, want: float) -> str:
    batch = _batch_flops(fn, shape, got)
    if batch:
        return batch
    if not _close(_ask(fn, replace(shape, dtype_bytes=6 - shape.dtype_bytes))[0], got):
        return "your FLOPs change with dtype_bytes: the arithmetic is the same whatever the size of a value"
    if _near(_ratio(got, want), 0.5):
        return "every term is half the planner's: a multiply-add is 2 FLOPs, so an (m x k) @ (k x n) GEMM is 2 m n k"
    if _near(_ratio(got, want), 2):
        return ("every term is twice the planner's: a multiply-add is 2 FLOPs in all (an (m x k) @ (k x n) GEMM is "
                "2 m n k, not 4 m n k), and the layer's forward is counted once")
    if _near(_ratio(got, want), 3):
        return ("three times the planner's: that is forward and backward (backward runs two GEMMs per forward one); "
                "count the forward")
    for changed, explain in ((_same_tokens_longer(shape), _attention_flops),
                             (replace(shape, ffn=2 * shape.ffn), _mlp_flops)):
        mine, planner = _moves(fn, shape, changed, 0)
        if not _close(mine, planner):
            return explain(mine, planner, shape)
    mine, planner = _moves(fn, shape, _other_kv(shape), 0)
    if not _close(mine, planner):
        return _kv_text(mine, planner, "FLOPs")
    extra = (got - want) / (shape.tokens * shape.hidden ** 2)
    return (f"your attention, MLP and key/value terms move as the planner's do, but the rest is off by {extra:+.3g} x "
            "T hidden^2 FLOPs (T = batch x seq): the Q and the output projections are (T x hidden) @ (hidden x "
            "hidden) GEMMs, 2 T hidden^2 FLOPs each")


def _mlp_bytes(fn: Callable[..., Any], shape: Shape, mine: float, planner: float) -> str:
    r = _ratio(mine, planner)
    plain = [planner_count(replace(s, gated=False))[1] for s in (shape, replace(shape, ffn=2 * shape.ffn))]
    if shape.gated and _close(mine, plain[1] - plain[0]):
        why = ("you counted a plain MLP: when gated, the GEMM into the MLP is 2 ffn wide (gate and up side by side) "
               "and the activation reads both halves")
    else:
        why = ("the GEMMs into and out of the MLP (their operands and results: the ffn-wide ones grow with ffn) and "
               "the activation (its input, two when gated, and its output)")
    return f"your MLP bytes (what changes with ffn) are {r:.3g}x the planner's: {why}"


REST = {-10: "the two norms (each reads T x hidden and writes T x hidden) and the two residual adds (each reads two "
             "T x hidden tensors and writes one) are missing",
        -4: "the two norms are missing: each reads T x hidden values and writes T x hidden",
        -6: "the two residual adds are missing: each reads two T x hidden tensors and writes one",
        2: "Q, K and V read the layer's input three times: the planner runs them as one GEMM, which reads it once"}


def _bytes_problem(fn: Callable[..., Any], shape: Shape, got: float, want: float) -> str:
    if _near(_ratio(got * shape.dtype_bytes, want), 1):
        return "your count is the planner's divided by dtype_bytes: you counted values; a value is dtype_bytes bytes"
    mine, planner = _moves(fn, shape, replace(shape, batch=2 * shape.batch), 1)
    if mine == 0 and planner:
        return ("your bytes do not change with batch: every tensor but the weights holds T = batch x seq tokens' "
                "values (batch sequences of seq each)")
    other = replace(shape, dtype_bytes=6 - shape.dtype_bytes)
    if not _close(_ask(fn, other)[1] * shape.dtype_bytes, got * other.dtype_bytes):
        return ("part of your bytes do not scale with dtype_bytes: every tensor here, weights and activations, holds "
                "dtype_bytes per value")
    longer = _same_tokens_longer(shape)
    mine, planner = _moves(fn, shape, longer, 1)
    if not _close(mine, planner):
        return (f"your bytes change by {mine:+.4g} when the same tokens come in sequences of {longer.seq} "
                "(the planner's do not): something seq x seq in size, the attention scores? A flash attention never "
                "writes them: it reads Q, K and V and writes its output, each tokens x width")
    mine, planner = _moves(fn, shape, replace(shape, ffn=2 * shape.ffn), 1)
    if not _close(mine, planner):
        return _mlp_bytes(fn, shape, mine, planner)
    mine, planner = _moves(fn, shape, _other_kv(shape), 1)
    if not _close(mine, planner):
        return _kv_text(mine, planner, "bytes")
    units = (got - want) / (shape.dtype_bytes * shape.tokens * shape.hidden)
    named = next((text for k, text in REST.items() if _near(units, k)), None)
    return named or (f"your attention, MLP and key/value terms move as the planner's do, but the rest (the Q and "
                     f"output projections' GEMMs, the norms, the residual adds) is off by {units:+.3g} x dtype_bytes "
                     "x T x hidden bytes (T = batch x seq)")


def judge(fn: Callable[..., Any], shapes: tuple[Shape, ...] | None = None) -> str | None:
    """What is wrong with ``fn``'s count on the first shape it gets wrong, narrowed to a term; None if nothing.
    ``shapes``: four drawn for this check from the operating system's randomness unless given."""
    try:
        for shape in draw_shapes(random.SystemRandom()) if shapes is None else shapes:
            got, want = _ask(fn, shape), planner_count(shape)
            for which, what, problem in ((0, "FLOPs", _flops_problem), (1, "bytes", _bytes_problem)):
                if not _close(got[which], want[which]):
                    raise Answer(f"With {shape.name} ({shape.text()}): your {what} {got[which]:,.0f}, the planner's "
                                 f"{want[which]:,.0f} ({_ratio(got[which], want[which]):.4g}x): "
                                 f"{problem(fn, shape, got[which], want[which])}.")
    except Answer as answer:
        return str(answer)
    return None
