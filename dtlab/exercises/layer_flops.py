"""Exercise ``layer_flops``: one transformer layer's forward FLOPs and bytes moved, as a roofline needs them.

The checker is the model itself: the learner's count is held against the planner's own
(``dtlab.cost.planner.ops.stage_ops``, the ops a step's time is predicted from) on four shapes drawn
for each check, with multi-head, grouped-query and multi-query attention, plain and gated MLPs, bf16
and fp32 (``dtlab.exercises._flops_check``, which also narrows a wrong count down to its term). It
runs in this process: arithmetic needs no ranks.
"""

from __future__ import annotations

from dtlab.exercises._flops_check import Shape, draw_shapes, judge, planner_count
from dtlab.exercises._local import LocalExercise

__all__ = ["EXERCISE", "Shape", "draw_shapes", "layer_flops", "planner_count", "stub"]

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
    "(dtlab.cost.planner.ops) on four shapes drawn anew for every check: multi-head, grouped-query and multi-query "
    "attention, plain and gated MLPs, bf16 and fp32; a wrong count is narrowed down to its term. Your function may "
    "not call the planner."
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

SUMMARY = ("your FLOPs and bytes equal the planner's own count (dtlab.cost.planner.ops) on 4 shapes drawn for "
           "this check: multi-head, grouped-query and multi-query attention, plain and gated MLPs, bf16 and fp32. "
           "Their ratio is the layer's arithmetic intensity, which the roofline times it by.")

EXERCISE = LocalExercise("layer_flops", DESCRIPTION, judge, SUMMARY, layer_flops, stub, HINTS)
