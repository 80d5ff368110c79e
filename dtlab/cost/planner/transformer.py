"""A decoder-only transformer on paper: parameters, FLOPs and activation bytes, from its shape alone.

Nothing is built: a 70B model is a handful of integers. The formulas and where they come from:

* parameters: counted layer by layer from the shape (each Linear's weight and, where the
  model has one, its bias; each norm's weight, and its bias for LayerNorm; embeddings
  and the vocabulary head). ``from_charformer`` gives dtlab's own model, so a test can
  hold the count against the real ``nn.Module``.
* training FLOPs per token: ``6 N`` for the weight matmuls (forward 2N, backward 4N)
  plus ``12 L h s`` for attention's scores and weighted sum (forward ``4 s h`` per
  layer), as PaLM's model-FLOPs count does (Chowdhery et al. 2022, "PaLM", appendix
  B). N counts the matmul weights only: embedding lookups, norms and biases do no
  matmul. Recomputation adds forward work that the model-FLOPs count leaves out.
  A mixture of experts (``experts > 1``: each MLP is ``experts`` copies and a router,
  a token uses ``top_k`` of them) counts the weights a token *uses* (its k experts and
  the router), as Mixtral's "active parameters" do.
* activation bytes per layer and micro-batch: Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), sec. 4:
  ``s b h (34 + 5 a s / h)`` with 16-bit activations; with tensor parallelism over t
  ranks ``s b h (10 + 24/t + 5 a s/(h t))``; with sequence parallelism too
  ``s b h / t (34 + 5 a s / h)``; selective recomputation drops the ``5 a s / h``
  term (the attention core is recomputed), and so does a flash attention, which never
  stores the scores (``flash_attention``, the default; Megatron-LM's 2021-2022 runs
  materialised them); full recomputation keeps ``2 s b h`` (the layer's input). Their
  coefficients are for a GPT block (a 4h MLP, multi-head attention); for other blocks
  they are an approximation, and ``assumptions`` says so.
  A mixture of experts keeps each token's MLP activations once per chosen expert:
  ``(k - 1)`` more copies of the MLP's share (its input 2 s b h and its two
  intermediates 16 s b h, scaled by ffn / 4h).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from dtlab.core import data as datasets
from dtlab.core.charformer import CharFormer

__all__ = ["LLAMA2_70B", "LLAMA2_7B", "MIXTRAL_8X7B", "MODELS", "RECOMPUTE", "TransformerSpec", "from_charformer",
           "get"]

RECOMPUTE = ("none", "selective", "full")
NORMS = ("rms", "layer")
BIASES = frozenset({"q", "k", "v", "out", "mlp", "head"})
LLAMA2_SOURCE = ("Touvron et al. 2023, 'Llama 2: Open Foundation and Fine-Tuned Chat Models' (arXiv 2307.09288), "
                 "Table 1 (4k context; grouped-query attention for 70B); shapes from the released configurations "
                 "(huggingface.co/meta-llama/Llama-2-7b-hf and Llama-2-70b-hf, config.json): SwiGLU MLP, RMSNorm, "
                 "rotary positions, no biases, untied 32000-token embedding and head")
MIXTRAL_SOURCE = ("Jiang et al. 2024, 'Mixtral of Experts' (arXiv 2401.04088), Table 1: 32 layers, dim 4096, 32 heads, "
                  "8 key/value heads, hidden 14336, 8 experts, top-2, vocabulary 32000 (46.7B parameters, 12.9B "
                  "active); SwiGLU experts, RMSNorm, no biases; sequence 4096 for the plan (its context is 32k)")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TransformerSpec.{name}={value!r} is invalid: must be an integer >= 1")


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer's shape. ``gated_mlp``: three MLP matrices (SwiGLU) instead of two."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int
    gated_mlp: bool = True
    norm: str = "rms"  # "rms": a weight per norm; "layer": a weight and a bias
    biases: frozenset[str] = field(default_factory=frozenset)  # Linears with a bias, of BIASES
    learned_positions: bool = False  # a position embedding table (seq x hidden); False: rotary, no parameters
    tied_embeddings: bool = False
    source: str = ""
    experts: int = 1  # > 1: every MLP is a mixture of this many experts with a router
    top_k: int = 1  # experts each token uses
    flash_attention: bool = True  # False: the s x s scores are written to memory (softmax, dropout), as before 2022

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab", "experts", "top_k"):
            _positive_int(name, getattr(self, name))
        if self.top_k > self.experts:
            raise ValueError(f"TransformerSpec.top_k={self.top_k} is invalid: at most experts={self.experts}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerSpec.heads={self.heads} is invalid: must divide hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"TransformerSpec.kv_heads={self.kv_heads} is invalid: must divide heads={self.heads}")
        if self.norm not in NORMS:
            raise ValueError(f"TransformerSpec.norm={self.norm!r} is invalid: choose one of {', '.join(NORMS)}")
        object.__setattr__(self, "biases", frozenset(self.biases))
        unknown = sorted(self.biases - BIASES)
        if unknown:
            raise ValueError(f"TransformerSpec.biases={unknown} is invalid: choose from {sorted(BIASES)}")

    # -- shape ---------------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def _norm(self) -> int:
        return self.hidden * (2 if self.norm == "layer" else 1)

    # -- parameters ----------------------------------------------------------------
    @property
    def router(self) -> int:
        """The router's weights per block (none without experts)."""
        return self.hidden * self.experts if self.experts > 1 else 0

    def _attention_matmul(self) -> int:
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim

    def layer_matmul(self) -> int:
        """One block's weight-matrix elements: q, k, v, out, every expert's MLP and the router."""
        return self._attention_matmul() + self.experts * self.mlp_matrices * self.hidden * self.ffn + self.router

    def active_layer_matmul(self) -> int:
        """The weight-matrix elements one token uses in a block: attention, its top_k MLPs, the router."""
        return self._attention_matmul() + self.top_k * self.mlp_matrices * self.hidden * self.ffn + self.router

    def _mlp_split(self) -> int:
        """One MLP's parameters that tensor parallelism splits (matrices, column-parallel biases)."""
        return self.mlp_matrices * self.hidden * self.ffn + (self.ffn * (self.mlp_matrices - 1)
                                                             if "mlp" in self.biases else 0)

    def expert_parameters(self, tp: int = 1, ep: int = 1) -> int:
        """One block's expert weights on a rank holding ``experts / ep`` experts, each split over ``tp`` as a
        dense MLP is (0 without experts: the MLP is then part of ``layer_parameters``' dense share)."""
        if self.experts == 1:
            return 0
        return self.experts // ep * (-(-self._mlp_split() // tp) + (self.hidden if "mlp" in self.biases else 0))

    def layer_parameters(self, tp: int = 1, ep: int = 1) -> int:
        """One block's parameters on one of ``tp`` tensor-parallel ranks (Megatron's split: column-parallel q, k,
        v and MLP-in with their biases, row-parallel out and MLP-out; their biases and the norms stay whole);
        with experts, the router whole and ``expert_parameters(tp, ep)``."""
        h, b = self.hidden, self.biases
        split = self._attention_matmul()
        split += (h if "q" in b else 0) + (self.kv_dim if "k" in b else 0) + (self.kv_dim if "v" in b else 0)
        whole = 2 * self._norm() + (h if "out" in b else 0)
        if self.experts > 1:
            return -(-split // tp) + whole + self.router + self.expert_parameters(tp, ep)
        return -(-(split + self._mlp_split()) // tp) + whole + (h if "mlp" in b else 0)

    def embedding_parameters(self, tp: int = 1) -> int:
        """The token embedding (split over the vocabulary under TP) and a learned position table (kept whole)."""
        return -(-self.vocab * self.hidden // tp) + (self.seq * self.hidden if self.learned_positions else 0)

    def head_parameters(self, tp: int = 1) -> int:
        """The final norm and the vocabulary head (none of its own when tied to the embedding)."""
        head = 0 if self.tied_embeddings else self.hidden * self.vocab
        head += self.vocab if "head" in self.biases else 0
        return self._norm() + -(-head // tp)

    def parameters(self) -> int:
        return self.layers * self.layer_parameters() + self.embedding_parameters() + self.head_parameters()

    def matmul_parameters(self) -> int:
        """Every weight a matmul reads, the vocabulary head included even when tied (every expert)."""
        return self.layers * self.layer_matmul() + self.hidden * self.vocab

    def active_matmul_parameters(self) -> int:
        """N of ``6 N``: the weights one token's matmuls read (``matmul_parameters`` without experts)."""
        return self.layers * self.active_layer_matmul() + self.hidden * self.vocab

    # -- FLOPs ---------------------------------------------------------------------
    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token (forward and backward), with what recomputation adds."""
        _check_recompute(recompute)
        n, attention = self.active_matmul_parameters(), 4 * self.layers * self.hidden * self.seq  # attention: fwd
        flops = 6 * n + 3 * attention
        if recompute == "full":  # every block's forward runs again in backward (the head's does not)
            flops += 2 * self.layers * self.active_layer_matmul() + attention
        elif recompute == "selective":  # only the attention core runs again
            flops += attention
        return float(flops)

    def model_flops_per_token(self) -> float:
        """What MFU counts: the work the model needs, without recomputation."""
        return self.flops_per_token("none")

    # -- activations ---------------------------------------------------------------
    def activation_bytes(self, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                         recompute: str = "none", bytes_per_value: int = 2) -> float:
        """Bytes one block keeps for backward for one micro-batch (Korthikanti et al. 2022, sec. 4 and 5)."""
        _check_recompute(recompute)
        s, b, h, a = self.seq, micro_batch, self.hidden, self.heads
        scale = bytes_per_value / 2  # the paper counts 16-bit values (and 1-byte dropout masks)
        if recompute == "full":
            return 2 * s * b * h * scale
        scores = 0.0 if recompute == "selective" or self.flash_attention else 5 * a * s / h
        if tp == 1 or sequence_parallel:
            per = s * b * h / tp * (34 + scores)
        else:
            per = s * b * h * (10 + 24 / tp + scores / tp)
        # each token's expert input and intermediates, once more per extra expert it uses
        per += (self.top_k - 1) * s * b * h / tp * (2 + 16 * self.ffn / (4 * h))
        return per * scale

    def output_activation_bytes(self, micro_batch: int, tp: int = 1, bytes_per_value: int = 2) -> float:
        """The vocabulary head and the loss: ``4 s b h / t (1 + v / h)`` (Korthikanti et al. 2022, sec. 4.3)."""
        s, b, h = self.seq, micro_batch, self.hidden
        return 4 * s * b * h / tp * (1 + self.vocab / h) * bytes_per_value / 2

    def assumptions(self) -> list[str]:
        notes = [f"model {self.name}: {self.layers} layers, hidden {self.hidden}, {self.heads} heads "
                 f"({self.kv_heads} key/value heads), MLP {self.ffn}{' (gated)' if self.gated_mlp else ''}, "
                 f"sequence {self.seq}, vocabulary {self.vocab}: {self.parameters() / 1e9:.3g} B parameters"
                 + (f" ({self.source})" if self.source else "")]
        if self.experts > 1:
            notes.append(f"mixture of experts: {self.experts} experts per block, top-{self.top_k}: "
                         f"{self.active_matmul_parameters() / 1e9:.3g} B matmul weights a token uses (the FLOPs' N)")
        if self.gated_mlp or self.kv_heads != self.heads or self.ffn != 4 * self.hidden:
            notes.append("activation bytes use Korthikanti et al.'s coefficients for a GPT block (4h MLP, multi-head "
                         "attention): an approximation for this block's shape")
        return notes


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"checkpointing={recompute!r} is invalid: choose one of {', '.join(RECOMPUTE)}")


LLAMA2_7B = TransformerSpec("Llama 2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, seq=4096,
                            vocab=32000, source=LLAMA2_SOURCE)
LLAMA2_70B = TransformerSpec("Llama 2 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=4096,
                             vocab=32000, source=LLAMA2_SOURCE)
MIXTRAL_8X7B = TransformerSpec("Mixtral 8x7B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096,
                               vocab=32000, experts=8, top_k=2, source=MIXTRAL_SOURCE)
MODELS: dict[str, TransformerSpec] = {"7B": LLAMA2_7B, "70B": LLAMA2_70B, "8x7B": MIXTRAL_8X7B}


def get(name: str) -> TransformerSpec:
    """A named size: ``7B``, ``70B`` or ``8x7B`` (Mixtral)."""
    if name not in MODELS:
        raise ValueError(f"unknown model size {name!r}: choose one of {', '.join(MODELS)}")
    return MODELS[name]


def from_charformer(width: int, depth: int, vocab: int | None = None, seq: int | None = None) -> TransformerSpec:
    """dtlab's ``charformer`` (``dtlab.core.charformer.CharFormer``) as a spec; vocabulary and sequence default to
    the shipped text data set's. Its block is GPT's: a 4x LayerNorm MLP with biases, learned positions, and
    no bias on the key projection (see ``docs/determinism.md``)."""
    heads = inspect.signature(CharFormer.__init__).parameters["heads"].default  # what models.build leaves it at
    if vocab is None or seq is None:
        text = datasets.load("text", 0, 0)
        vocab = text.num_classes if vocab is None else vocab
        seq = text.input_shape[0] if seq is None else seq
    return TransformerSpec(f"charformer w{width} d{depth}", layers=depth, hidden=width, heads=heads, kv_heads=heads,
                           ffn=4 * width, seq=seq, vocab=vocab, gated_mlp=False, norm="layer",
                           biases=frozenset({"q", "v", "out", "mlp", "head"}), learned_positions=True,
                           source="dtlab.core.charformer.CharFormer")
