"""Exercise ``layer_flops``: one transformer layer's forward FLOPs and bytes moved, as a roofline needs them.

The checker is the model itself: the learner's count is held against the planner's own
(``dtlab.cost.planner.ops.stage_ops``, the ops a step's time is predicted from) on shapes with
multi-head, grouped-query and multi-query attention, plain and gated MLPs, bf16 and fp32. It runs
in this process (arithmetic needs no ranks). A wrong count is narrowed down to its term by asking
the learner's function about shapes that change one thing at a time — the MLP's width, the number
of key/value heads, the sequence length at a fixed number of tokens, the dtype — and comparing how
its answer moves with how the planner's does.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.ops import stage_ops
from dtlab.cost.planner.transformer import TransformerSpec
from dtlab.cost.roofline.model import MEMORY
from dtlab.exercises._local import LocalExercise

__all__ = ["EXERCISE", "SHAPES", "Shape", "layer_flops", "planner_count", "stub"]

PRECISION = {2: "bf16", 4: "fp32"}  # dtype_bytes -> the planner's precision


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


SHAPES = (
    Shape("multi-head attention and a 4h MLP (GPT-3's block), bf16", 1024, 16, 16, 4096, 512, 4, 2, False),
    Shape("grouped-query attention (8 key/value heads of 32) and a gated MLP (Llama 3 8B's block), bf16",
          4096, 32, 8, 14336, 2048, 1, 2, True),
    Shape("grouped-query attention (2 of 4) and a gated MLP, fp32", 256, 4, 2, 688, 128, 8, 4, True),
    Shape("multi-query attention (1 key/value head of 16) and a 4h MLP, fp32", 2048, 16, 1, 8192, 1024, 2, 4, False),
)

DESCRIPTION = (
    "Write fn(hidden, heads, kv_heads, ffn, seq, batch, dtype_bytes, gated) -> (flops, bytes): the forward pass of "
    "one transformer layer on batch sequences of seq tokens, as a roofline counts it (called with the arguments in "
    "this order). The layer: a norm; Q, K and V as one GEMM (their weights side by side; K and V have kv_heads x "
    "head_dim columns each, head_dim = hidden / heads); a causal flash attention; the output projection; a "
    "residual add; a norm; the MLP (gated: its first GEMM is the gate and the up projection side by side, then "
    "SwiGLU; not gated: one GEMM, then GELU; then the down projection back to hidden); a residual add. flops: the "
    "matmul FLOPs of the GEMMs and of attention's two products, causal attention counted as if unmasked (the "
    "convention MFU is reported in); not the norms', the activation's or the adds'. bytes: what every op reads and "
    "writes, each tensor once per op, in the layer's dtype (dtype_bytes per value): a GEMM its two operands and "
    "its result; the flash attention Q, K and V in and its output out; a norm, the activation and an add their "
    "inputs and their output. Checked in this process against the planner's own count "
    "(dtlab.cost.planner.ops) on four shapes: multi-head, grouped-query and multi-query attention, plain and "
    "gated MLPs, bf16 and fp32; a wrong count is narrowed down to its term."
)

HINTS = (
    "Count op by op. With T = batch x seq tokens in the layer, every GEMM is a (T x k) activation times a (k x n) "
    "weight: its FLOPs are a multiply and an add for each of T x n x k products, its bytes the two operands and the "
    "result. Attention's two products compare every query with every key of its sequence; the convention counts "
    "them whole even though a causal mask skips half. The memory-bound ops move a T x width tensor per input and "
    "per output.",
    "The GEMMs (m, n, k) = (T, hidden + 2 kv, hidden) for QKV with kv = kv_heads x hidden / heads, (T, hidden, "
    "hidden) for the output projection, (T, 2 ffn or ffn, hidden) into the MLP, (T, hidden, ffn) out of it: 2 m n k "
    "FLOPs and dtype_bytes x (m k + k n + m n) bytes each. Attention: Q K^T and P V are 2 T seq hidden FLOPs each "
    "over all heads; its bytes Q and O (T x hidden each) and K and V (T x kv each). Norms read and write T x hidden "
    "(two norms); adds read two and write one (two adds); the activation reads one (GELU) or two (SwiGLU) T x ffn "
    "tensors and writes one.",
    "tokens = batch * seq; kv = kv_heads * (hidden // heads); width = 2 * ffn if gated else ffn\n"
    "gemms = [(tokens, hidden + 2 * kv, hidden), (tokens, hidden, hidden), (tokens, width, hidden),\n"
    "         (tokens, hidden, ffn)]\n"
    "flops = sum(2 * m * n * k for m, n, k in gemms) + 4 * tokens * seq * hidden\n"
    "values = sum(m * k + k * n + m * n for m, n, k in gemms) + tokens * (2 * hidden + 2 * kv)\n"
    "values += ((2 if gated else 1) + 1) * tokens * ffn + 2 * 2 * tokens * hidden + 2 * 3 * tokens * hidden\n"
    "return flops, dtype_bytes * values",
)


def layer_flops(hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, batch: int, dtype_bytes: int,
                gated: bool) -> tuple[int, int]:
    """The reference: one layer's forward matmul FLOPs and bytes moved, op by op."""
    tokens = batch * seq
    kv = kv_heads * (hidden // heads)
    width = 2 * ffn if gated else ffn  # gate and up side by side
    gemms = [(tokens, hidden + 2 * kv, hidden), (tokens, hidden, hidden), (tokens, width, hidden),
             (tokens, hidden, ffn)]
    flops = sum(2 * m * n * k for m, n, k in gemms)
    values = sum(m * k + k * n + m * n for m, n, k in gemms)
    flops += 4 * tokens * seq * hidden  # Q K^T and P V over every head, unmasked by convention
    values += tokens * (2 * hidden + 2 * kv)  # a flash attention: Q, K, V in, O out; never the scores
    values += ((2 if gated else 1) + 1) * tokens * ffn  # the activation: its input(s) and its output
    values += 2 * 2 * tokens * hidden + 2 * 3 * tokens * hidden  # two norms (read, write), two adds (two in, one out)
    return flops, dtype_bytes * values


def stub(hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, batch: int, dtype_bytes: int,
         gated: bool) -> tuple[int, int]:
    """A starting point: replace the body (see ``describe('layer_flops')``)."""
    raise NotImplementedError(
        "count one transformer layer's forward: return (matmul FLOPs, bytes moved) for batch sequences of seq tokens, "
        "op by op: the QKV GEMM, attention, the output projection, the MLP, the norms and the adds "
        "(exercises.hint('layer_flops') when stuck)")


def planner_count(shape: Shape) -> tuple[float, float]:
    """The planner's count for ``shape``: the forward ops of one layer (``planner.ops.stage_ops``) at tp = 1,
    their GEMM and attention FLOPs and every op's bytes."""
    spec = TransformerSpec("layer", layers=1, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                           ffn=shape.ffn, seq=shape.seq, vocab=1, gated_mlp=shape.gated)
    layout = Layout(dp=1, tp=1, pp=1, zero=0, checkpointing="none", micro_batch=shape.batch,
                    precision=PRECISION[shape.dtype_bytes])
    ops = stage_ops(spec, layout, first=False, last=False).forward
    return (sum(op.flops * op.count for op in ops if op.kind != MEMORY), sum(op.bytes * op.count for op in ops))


# -- judging -----------------------------------------------------------------------------------------------------
class Answer(Exception):
    """What the learner's function did wrong on a shape, as feedback."""


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.5)


def _ask(fn: Callable[..., Any], shape: Shape) -> tuple[float, float]:
    """The learner's (flops, bytes) for ``shape``; Answer if it raised or returned something else."""
    try:
        got = fn(*shape.args())
    except Exception as exc:  # noqa: BLE001 - any error of the learner's is feedback
        raise Answer(f"your function raised {type(exc).__name__} with {shape.text()}: "
                     f"{(str(exc).splitlines() or [''])[0]}") from None
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
    if _near(r, 0.5):
        why = ("causal? The convention counts a causal attention as if unmasked, 4 T seq hidden FLOPs (the planner "
               "knows a causal kernel runs about half of them, and uses that for the time, not the count)")
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


def _flops_problem(fn: Callable[..., Any], shape: Shape, got: float, want: float) -> str:
    if _near(_ratio(got, want), 0.5):
        return "every term is half the planner's: a multiply-add is 2 FLOPs, so an (m x k) @ (k x n) GEMM is 2 m n k"
    if _near(_ratio(got, want), 3):
        return ("three times the planner's: that is forward and backward (backward runs two GEMMs per forward one); "
                "count the forward")
    if not _close(_ask(fn, replace(shape, dtype_bytes=6 - shape.dtype_bytes))[0], got):
        return "your FLOPs change with dtype_bytes: the arithmetic is the same whatever the size of a value"
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


def judge(fn: Callable[..., Any]) -> str | None:
    """What is wrong with ``fn``'s count on the first shape it gets wrong, narrowed to a term; None if nothing."""
    try:
        for shape in SHAPES:
            got, want = _ask(fn, shape), planner_count(shape)
            for which, what, problem in ((0, "FLOPs", _flops_problem), (1, "bytes", _bytes_problem)):
                if not _close(got[which], want[which]):
                    raise Answer(f"With {shape.name} ({shape.text()}): your {what} {got[which]:,.0f}, the planner's "
                                 f"{want[which]:,.0f} ({_ratio(got[which], want[which]):.4g}x): "
                                 f"{problem(fn, shape, got[which], want[which])}.")
    except Answer as answer:
        return str(answer)
    return None


SUMMARY = (f"your FLOPs and bytes equal the planner's own count (dtlab.cost.planner.ops) on all {len(SHAPES)} "
           "shapes: multi-head, grouped-query and multi-query attention, plain and gated MLPs, bf16 and fp32. Their "
           "ratio is the layer's arithmetic intensity, which the roofline times it by.")

EXERCISE = LocalExercise("layer_flops", DESCRIPTION, judge, SUMMARY, layer_flops, stub, HINTS)
