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

from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN

__all__ = ["by_op_and_bytes", "recorded_per_step", "textbook_collectives", "tp_bytes_per_step"]

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


def recorded_per_step(events: pd.DataFrame, steps: range) -> pd.DataFrame:
    """Recorded collectives of rank 0 per step: op, bytes and calls (averaged over ``steps``)."""
    df = events[(events["rank"] == 0) & events["step"].isin(list(steps))]
    out = df.groupby(["op", "bytes"]).size().div(len(steps)).rename("calls").reset_index()
    return out.sort_values(["op", "bytes"]).reset_index(drop=True)


def tp_bytes_per_step(table: pd.DataFrame) -> int:
    """Total bytes per step and rank of a ``textbook_collectives`` table."""
    return int((table["calls"] * table["bytes"]).sum())


def by_op_and_bytes(table: pd.DataFrame) -> dict[tuple[str, int], Any]:
    """``textbook_collectives`` summed per (op, bytes), to compare with ``recorded_per_step``."""
    return table.groupby(["op", "bytes"])["calls"].sum().to_dict()
