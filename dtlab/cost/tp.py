"""Tensor parallelism by the book: the collectives each step must issue, to set beside the recorded ones.

The counts follow Megatron-LM (Shoeybi et al. 2019, sec. 3: "f" and "g", one
all-reduce each per column/row pair) and sequence parallelism (Korthikanti et
al. 2022, sec. 4.2.2: each all-reduce becomes a reduce-scatter and an
all-gather) for the plans in ``dtlab.tiers.tp``. Bytes follow nccl-tests'
convention, as the recorder counts them: an all-gather counts what it gathers,
a reduce-scatter what it reduces -- the full activation either way.
"""


from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from dtlab.core import models
from dtlab.core.comm import bus_factor
from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN
from dtlab.cost.estimate.tensor_parallel import tp_locals

__all__ = ["FLOAT", "by_op_and_bytes", "bytes_by_formula", "sent_bytes_per_step", "textbook_collectives",
           "tp_bytes_per_step"]

FLOAT = 4  # bytes of an fp32 activation


def _rows(rows: list[tuple[str, str, int, int, str]]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=["pass", "op", "calls", "bytes", "why"])
    return frame[frame["calls"] > 0].reset_index(drop=True)


def textbook_collectives(cfg: RunConfig, vocab: int = 0, input_features: int = 64, classes: int = 10) -> pd.DataFrame:
    """Per step and rank: pass, op, calls, bytes per call and why, for ``cfg`` on the ``tp`` tier.

    ``vocab``: the text data set's characters (the charformer's classes);
    ``input_features``: the mlp's input width (64 for the 8x8 digits); ``classes``: its outputs (10 digits).
    """
    o = cfg.tier_options
    b, w = cfg.global_batch_size, cfg.model_size
    if cfg.model == "mlp":
        linears = cfg.model_depth + 1  # an odd last one stays whole
        pairs, act = linears // 2, b * w * FLOAT
        # with an even count the last pair's row-split Linear is the head: its partial sums are the logits
        head = linears % 2 == 0
        return _rows([("forward", "all_reduce", pairs - head, act, "g: the row-split Linear's partial sums"),
                      ("forward", "all_reduce", int(head), b * classes * FLOAT, "g: the head's partial logits"),
                      # the first pair's input is the data: no gradient to reduce
                      ("backward", "all_reduce", pairs - 1, act, "f: the input gradient of each later pair")])
    layers, act, tokens = cfg.model_depth, b * SEQ_LEN * w * FLOAT, b * SEQ_LEN
    tp = cfg.world_size if cfg.tier == "tp" else o.tp_size
    # DTensor pads uneven shards to equal ones before gathering: ceil(vocab / tp) columns per rank
    logits = tokens * -(-vocab // tp) * tp * FLOAT
    rows = [("forward", "all_reduce", 1, act, "the row-split token embedding's partial sums")]
    if o.loss_parallel:
        rows.append(("forward", "all_reduce", 3, tokens * FLOAT, "loss parallel: max, sum of exp, target logit"))
    else:
        rows.append(("forward", "all_gather_into_tensor", 1, logits, "the vocabulary head's logits"))
    if not o.sequence_parallel:
        rows += [("forward", "all_reduce", 2 * layers, act, "g: after attention's and the MLP's row-split Linear"),
                 ("backward", "all_reduce", 2 * layers + 1, act, "f: the input gradient of attention, MLP and head")]
        return _rows(rows)
    norms = 2 * layers + 1
    rows += [
        ("forward", "all_gather_into_tensor", 2 * layers + 1, act,
         "g: the sequence gathered before each pair and the head"),
        ("forward", "reduce_scatter_tensor", 2 * layers, act, "g-bar: each pair's output scattered along the sequence"),
        ("backward", "reduce_scatter_tensor", 2 * layers + 1, act, "the input gradient of each pair and the head"),
        ("backward", "all_gather_into_tensor", 2 * layers + 1, act, "each pair's output gradient; the blocks' input"),
        ("optimizer", "all_reduce", 2 * norms, w * FLOAT,
         "norm weight and bias gradients: partial over the sequence"),
    ]
    return _rows(rows)


def tp_bytes_per_step(table: pd.DataFrame) -> int:
    """Total bytes per step and rank of a ``textbook_collectives`` table."""
    return int((table["calls"] * table["bytes"]).sum())


def by_op_and_bytes(table: pd.DataFrame) -> dict[tuple[str, int], Any]:
    """``textbook_collectives`` summed per (op, bytes), to compare with ``recorded_per_step``."""
    return table.groupby(["op", "bytes"])["calls"].sum().to_dict()


def sent_bytes_per_step(table: pd.DataFrame, n: int) -> float:
    """What each of ``n`` ranks sends per step with ring algorithms, for a ``textbook_collectives`` table:
    nccl-tests' bus factor of each op's size (2(n-1)/n for an all-reduce, (n-1)/n for a gather or scatter)."""
    factors = [bus_factor(op, n) for op in table["op"]]
    return float((table["calls"] * table["bytes"] * factors).sum())


def bytes_by_formula(cfg: RunConfig, vocab: int = 0, input_features: int = 64,
                     classes: int = 10) -> dict[str, tuple[float, float]]:
    """By formula, per step and rank for ``cfg``'s model on ``cfg.world_size`` ranks: (bytes communicated,
    counted as op sizes; parameter bytes held) under ``"ddp"``, ``"fsdp"`` and ``"tp"``.

    With P the parameter bytes and n ranks: DDP all-reduces every gradient once (P) and holds P; FSDP2
    all-gathers the parameters before forward and before backward and reduce-scatters the gradients (3 P),
    holding P / n; TP issues ``textbook_collectives`` and holds rank 0's share under the tp plan (the larger
    piece of each split dimension). ``cfg``: a ``tp`` job; the other arguments as ``textbook_collectives``.
    """
    if cfg.tier != "tp":
        raise ValueError(f"bytes_by_formula: a tp job's config, not tier {cfg.tier!r}")
    shape, outputs = ((SEQ_LEN,), vocab) if cfg.model == "charformer" else ((input_features,), classes)
    with torch.device("meta"):  # shapes only: no memory for the weights
        model = models.build(cfg.model, shape, outputs, cfg.model_size, cfg.model_depth)
    p = sum(t.numel() * t.element_size() for t in model.parameters())
    local = tp_locals(model, cfg.tier_options, cfg.world_size, 0).values()
    tp_params = sum(t.numel() * t.element_size() for t in local)
    tp_comm = tp_bytes_per_step(textbook_collectives(cfg, vocab, input_features, classes))
    return {"ddp": (p, p), "fsdp": (3 * p, p / cfg.world_size), "tp": (tp_comm, tp_params)}
