"""The operations of one training step, from a transformer's shape and a layout: what the roofline times.

Per pipeline stage and micro-batch, on one GPU (``T = micro_batch x seq / cp`` tokens, ``t = tp``):

* **GEMMs** (forward): QKV ``(T, (h + 2 kv) / t, h)`` (grouped-query attention: ``kv = kv_heads x
  head_dim``), attention output ``(T, h, h / t)``, MLP in ``(T, f / t, h)`` (``2 f / t`` when gated),
  MLP out ``(T, h, f / t)``; a mixture of experts replaces the MLP by a router ``(T / t, experts, h)``
  and, per local expert, the same two GEMMs on its share of the ``T x top_k`` routed tokens
  (``ep`` GPUs share the experts out, the load taken as even); the vocabulary head ``(T, V / t, h)``
  on the last stage. Backward runs two GEMMs per forward one: the input's gradient ``(m, k, n)``
  and the weight's ``(k, n, m)``, kept apart (a zero-bubble schedule moves the second).
* **attention's scores and weighted sum** as a flash attention runs them: ``4 T s h / t`` FLOPs
  forward, counted unmasked as the FLOP conventions do, of which a causal kernel executes the
  diagonal and the blocks below it (``1/2 + 64 / s`` with 128-row blocks); backward counts twice the
  forward and executes 5/4 of that (FlashAttention-2 recomputes the scores: five matmuls to the
  forward's two); its bytes are Q, K, V and O, never the ``s x s`` scores. A model without flash
  attention (``TransformerSpec.flash_attention = False``, Megatron-LM before 2022) runs the same
  FLOPs as two batched GEMMs per head, ``(s, s, d)`` and ``(s, d, s)``, unmasked, with the scores
  written and read by a fused softmax and by dropout (its 1-byte mask too) in between.
* **memory-bound passes**: two norms, two residual adds, the activation (SwiGLU reads two inputs),
  the embedding, the loss over the logits; with tensor parallelism sequence parallelism splits the
  norms and adds over the ``t`` ranks (Korthikanti et al. 2022). Their bytes are each tensor read
  and written once per pass; their FLOPs are not counted in MFU or HFU (nor by the conventions).
* **recomputation**: full repeats every layer's forward before its backward, selective only the
  attention core (Korthikanti et al. 2022); those ops are ``recomputed`` (hardware FLOPs).
* **the optimizer**: Adam over the GPU's shard of the parameters (``optimizer_ops``), memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.transformer import TransformerSpec
from dtlab.cost.roofline.model import ATTENTION, MEMORY, Op, gemm

__all__ = ["ADAM_BYTES", "StageOps", "causal_fraction", "dtype_of", "optimizer_ops", "stage_ops", "value_bytes"]

ATTENTION_BLOCK = 128  # a flash attention's query/key tile
FA_BACKWARD = 5 / 4  # executed over counted backward FLOPs: 5 matmuls where the convention counts 4
# Adam per parameter on the GPU's shard: fp32 master, momentum and variance read and written (24 bytes), the
# gradient read (its own dtype) and the 16-bit copy written for the next forward (mixed precision only)
ADAM_BYTES = {"bf16": 24 + 2 + 2, "fp32": 24 + 4}


def dtype_of(precision: str) -> str:
    return "bf16" if precision == "bf16" else "fp32"


def value_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def causal_fraction(seq: int) -> float:
    """The share of an unmasked attention's FLOPs a causal flash kernel runs: the blocks on and below the diagonal."""
    blocks = max(1, -(-seq // ATTENTION_BLOCK))
    return (blocks + 1) / (2 * blocks)


@dataclass
class StageOps:
    """One micro-batch on one stage: forward, backward for inputs, backward for weights, recomputation."""

    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)
    weight: list[Op] = field(default_factory=list)
    recompute: list[Op] = field(default_factory=list)

    def all(self) -> list[Op]:
        return self.forward + self.backward + self.weight + self.recompute


def _memory(name: str, flops: float, nbytes: float, count: float, dtype: str) -> Op:
    return Op(name, MEMORY, flops, nbytes, count, dtype=dtype)


def _add_gemm(ops: StageOps, name: str, m: int, n: int, k: int, count: float, dtype: str, vb: int) -> None:
    """A forward GEMM and its two backward GEMMs."""
    m, n, k = max(1, m), max(1, n), max(1, k)
    ops.forward.append(gemm(name, m, n, k, dtype=dtype, itemsize=vb, count=count))
    ops.backward.append(gemm(f"{name}.dgrad", m, k, n, dtype=dtype, itemsize=vb, count=count))
    ops.weight.append(gemm(f"{name}.wgrad", k, n, m, dtype=dtype, itemsize=vb, count=count))


def _mlp(ops: StageOps, model: TransformerSpec, layout: Layout, tokens: int, count: float, dtype: str,
         vb: int) -> None:
    h, t, f = model.hidden, layout.tp, model.ffn
    width_in = (2 if model.gated_mlp else 1) * f // t
    if model.experts == 1:
        _add_gemm(ops, "mlp_in", tokens, width_in, h, count, dtype, vb)
        _add_gemm(ops, "mlp_out", tokens, h, f // t, count, dtype, vb)
        routed = tokens
    else:
        local = model.experts // layout.ep
        per_expert = tokens * model.top_k * layout.ep // model.experts
        _add_gemm(ops, "router", tokens // t, model.experts, h, count, dtype, vb)
        _add_gemm(ops, "expert_in", per_expert, width_in, h, count * local, dtype, vb)
        _add_gemm(ops, "expert_out", per_expert, h, f // t, count * local, dtype, vb)
        routed = tokens * model.top_k
    reads = 2 if model.gated_mlp else 1
    ops.forward.append(_memory("activation", 8.0 * routed * f / t, vb * (reads + 1) * routed * f / t, count, dtype))
    ops.backward.append(_memory("activation.bwd", 8.0 * routed * f / t, vb * (2 * reads + 1) * routed * f / t, count,
                                dtype))


def _attention(model: TransformerSpec, layout: Layout, tokens: int, count: float, dtype: str, vb: int,
               recomputed: bool = False) -> Op:
    s, t = model.seq, layout.tp
    flops = 4.0 * tokens * s * model.hidden / t
    nbytes = vb * tokens * (2 * model.hidden + 2 * model.kv_dim) / t
    return Op("attention", ATTENTION, flops, nbytes, count, (s // layout.cp, s, model.hidden // model.heads), dtype,
              recomputed, causal_fraction(s))


def _materialised(ops: StageOps, model: TransformerSpec, layout: Layout, count: float, dtype: str, vb: int,
                  recomputed: bool = False) -> None:
    """Attention with its scores in memory: QK^T and PV as batched GEMMs, softmax and dropout between them."""
    s, d = model.seq, model.hidden // model.heads
    s_q = s // layout.cp
    batch = count * layout.micro_batch * model.heads // layout.tp  # one GEMM per sequence and local head
    scores = batch * s_q * s  # elements of the score matrices
    part = StageOps()
    _add_gemm(part, "attention.scores", s_q, s, d, batch, dtype, vb)
    _add_gemm(part, "attention.context", s_q, d, s, batch, dtype, vb)
    part.forward.insert(1, _memory("attention.softmax", 5.0 * scores, (4.0 * vb + 1) * scores, 1, dtype))
    part.backward.append(_memory("attention.softmax.bwd", 5.0 * scores, (5.0 * vb + 1) * scores, 1, dtype))
    if recomputed:
        ops.recompute += [Op(op.name + ".recompute", op.kind, op.flops, op.bytes, op.count, op.shape, op.dtype, True)
                          for op in part.forward]
        return
    ops.forward += part.forward
    ops.backward += part.backward
    ops.weight += part.weight


def _attention_core(ops: StageOps, model: TransformerSpec, layout: Layout, tokens: int, count: float, dtype: str,
                    vb: int, recomputed: bool = False) -> None:
    if not model.flash_attention:
        _materialised(ops, model, layout, count, dtype, vb, recomputed)
        return
    attention = _attention(model, layout, tokens, count, dtype, vb, recomputed)
    if recomputed:
        ops.recompute.append(attention)
        return
    ops.forward.append(attention)
    ops.backward.append(Op("attention.bwd", ATTENTION, 2 * attention.flops, 2 * attention.bytes, count,
                           attention.shape, dtype, False, attention.executed * FA_BACKWARD))


def _layers(model: TransformerSpec, layout: Layout, layers: int, dtype: str, vb: int) -> StageOps:
    """``layers`` transformer blocks, forward and backward, for one micro-batch."""
    ops = StageOps()
    h, t = model.hidden, layout.tp
    tokens = layout.micro_batch * model.seq // layout.cp
    split = tokens / t if t > 1 else tokens  # sequence parallelism: norms and adds on this rank's tokens
    n = float(layers)
    _add_gemm(ops, "qkv", tokens, (h + 2 * model.kv_dim) // t, h, n, dtype, vb)
    _attention_core(ops, model, layout, tokens, n, dtype, vb)
    _add_gemm(ops, "attn_out", tokens, h, h // t, n, dtype, vb)
    _mlp(ops, model, layout, tokens, n, dtype, vb)
    ops.forward += [_memory("norm", 5.0 * split * h, 2.0 * vb * split * h, 2 * n, dtype),
                    _memory("residual", split * h, 3.0 * vb * split * h, 2 * n, dtype)]
    ops.backward += [_memory("norm.bwd", 8.0 * split * h, 3.0 * vb * split * h, 2 * n, dtype),
                     _memory("residual.bwd", split * h, 3.0 * vb * split * h, 2 * n, dtype)]
    if layout.checkpointing == "full":
        ops.recompute = [Op(op.name + ".recompute", op.kind, op.flops, op.bytes, op.count, op.shape, op.dtype, True,
                            op.executed) for op in ops.forward]
    elif layout.checkpointing == "selective":
        _attention_core(ops, model, layout, tokens, n, dtype, vb, recomputed=True)
    return ops


def stage_ops(model: TransformerSpec, layout: Layout, *, first: bool, last: bool) -> StageOps:
    """One micro-batch's ops on a stage of ``layers / pp`` blocks; the first holds the embedding, the last the
    final norm, the vocabulary head and the loss."""
    dtype, vb = dtype_of(layout.precision), value_bytes(layout.precision)
    ops = _layers(model, layout, layout.stage_layers(model.layers), dtype, vb)
    tokens = layout.micro_batch * model.seq // layout.cp
    h, t, v = model.hidden, layout.tp, model.vocab
    if first:
        ops.forward.append(_memory("embedding", 0.0, 2.0 * vb * tokens * h, 1, dtype))
        ops.backward.append(_memory("embedding.bwd", tokens * h, 3.0 * vb * tokens * h, 1, dtype))
    if last:
        ops.forward.append(_memory("norm", 5.0 * tokens * h / t, 2.0 * vb * tokens * h / t, 1, dtype))
        _add_gemm(ops, "logits", tokens, -(-v // t), h, 1, dtype, vb)
        logits = tokens * v / t
        ops.forward.append(_memory("loss", 5.0 * logits, 2.0 * vb * logits, 1, dtype))
        ops.backward.append(_memory("loss.bwd", 3.0 * logits, 2.0 * vb * logits, 1, dtype))
    return ops


def optimizer_ops(parameters: float, precision: str) -> list[Op]:
    """Adam over ``parameters`` (this GPU's shard): memory-bound, about 10 FLOPs a parameter."""
    return [_memory("optimizer", 10.0 * parameters, ADAM_BYTES[precision] * parameters, 1, "fp32")]
