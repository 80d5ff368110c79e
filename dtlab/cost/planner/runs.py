"""Published training runs as planner inputs: the CSV schema of ``data/published_runs.csv`` and its checks.

One row per run, these columns in this order (``SCHEMA``)::

    source,model,layers,hidden,heads,kv_heads,ffn,vocab,seq,experts,top_k,mlp,attention,gpu,gpus,tp,pp,dp,
    cp,ep,interleave,zero,recompute,micro_batch,global_batch,precision,metric,value

``experts`` is 0 for a dense model; ``mlp`` gated (SwiGLU: three matrices) or plain (two, GPT's);
``attention`` flash (the ``s x s`` scores never leave the chip) or materialised (written to memory,
softmaxed and read back: Megatron-LM before 2022, before FlashAttention), empty where the source does not
say (taken as ``ATTENTION_DEFAULT``, flash, and ``Run.attention_published`` is False); ``gpu`` a cluster preset's
GPU (``A100_80GB``, ``H100_SXM``, ``H200_SXM``), whose preset also gives the network; ``recompute``
none, selective or full; ``micro_batch`` and ``interleave`` may be empty (the source did not publish
them: ``planner.prediction.predict`` then takes what the planner would advise, its fastest choice that fits, and
gives the range over every choice that fits); ``precision`` bf16, fp16 (the same 16-bit mixed
precision to the planner) or fp32; ``metric`` one of ``METRICS`` and ``value`` the published figure
(``mfu`` as a fraction). Every switch the step model branches on is a column: nothing is read from a
name. What only counts parameters (the norm's bias, the Linears' biases, a position table, a head tied to the
embedding) is not a column: a row's block is counted as Llama's (RMSNorm, no biases, rotary, untied).

``read_runs(path)`` returns the rows as ``Run`` objects, or raises ValueError in one line naming the
row and the column of the first bad value.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.cost.planner.clusters import BY_GPU, Cluster, by_gpu
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.transformer import RECOMPUTE, TransformerSpec

__all__ = ["ATTENTION", "ATTENTION_DEFAULT", "METRICS", "MLPS", "PRECISIONS", "SCHEMA", "Run", "read_runs"]

SCHEMA = ("source", "model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "experts", "top_k",
          "mlp", "attention", "gpu", "gpus", "tp", "pp", "dp", "cp", "ep", "interleave", "zero", "recompute",
          "micro_batch", "global_batch", "precision", "metric", "value")
MLPS = {"gated": True, "plain": False}  # -> TransformerSpec.gated_mlp
ATTENTION = {"flash": True, "materialised": False}  # -> TransformerSpec.flash_attention
# an empty attention cell: what current training stacks run unless told otherwise (PyTorch's
# scaled_dot_product_attention dispatches to a fused kernel), and what the planner would advise
ATTENTION_DEFAULT = "flash"
METRICS = ("tflops_per_gpu_hw", "tflops_per_gpu_model", "tokens_per_s_per_gpu", "mfu")
PRECISIONS = {"bf16": "bf16", "fp16": "bf16", "fp32": "fp32"}
_POSITIVE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "gpus", "tp", "pp", "dp", "cp", "ep",
             "global_batch")


@dataclass(frozen=True)
class Run:
    """One published run: its model, cluster, layout (micro-batch and interleave None where unpublished)."""

    index: int  # 1-based data row
    source: str
    model: TransformerSpec
    cluster: Cluster
    gpu: str
    gpus: int
    layout: Layout
    micro_batch: int | None
    interleave: int | None
    global_batch: int
    metric: str
    value: float
    attention_published: bool = True  # False: the attention cell was empty, ATTENTION_DEFAULT taken

    @property
    def label(self) -> str:
        return f"row {self.index}: {self.model.name}, {self.gpus} x {self.gpu}"


class _Row:
    """A CSV row's fields, each read with an error naming the row and the column."""

    def __init__(self, where: str, fields: dict[str, str]) -> None:
        self.where, self.fields = where, fields

    def fail(self, column: str, why: str) -> ValueError:
        return ValueError(f"{self.where}, column {column}: {self.fields.get(column, '')!r} {why}")

    def text(self, column: str, choices: Any = None, default: str = "") -> str:
        value = (self.fields.get(column) or "").strip() or default
        if not value:
            raise self.fail(column, "is empty")
        if choices is not None and value not in choices:
            empty = f" (or empty: not published, taken as {default})" if default else ""
            raise self.fail(column, f"is not one of {', '.join(choices)}{empty}")
        return value

    def integer(self, column: str, low: int = 1, empty_ok: bool = False) -> int | None:
        value = (self.fields.get(column) or "").strip()
        if not value and empty_ok:
            return None
        try:
            number = int(value)
        except ValueError:
            raise self.fail(column, f"is not an integer >= {low}") from None
        if number < low:
            raise self.fail(column, f"is not an integer >= {low}")
        return number

    def number(self, column: str) -> float:
        try:
            value = float(self.fields.get(column) or "")
        except ValueError:
            raise self.fail(column, "is not a number > 0") from None
        if not value > 0 or value == float("inf"):
            raise self.fail(column, "is not a number > 0")
        return value


def _spec(row: _Row) -> TransformerSpec:
    ints = {c: row.integer(c) for c in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")}
    experts, top_k = row.integer("experts", 0), row.integer("top_k", 0)
    if experts == 1:
        raise row.fail("experts", "is 1: write 0 for a dense model, or the number of experts (>= 2)")
    gated = MLPS[row.text("mlp", tuple(MLPS))]
    flash = ATTENTION[row.text("attention", tuple(ATTENTION), ATTENTION_DEFAULT)]
    try:
        return TransformerSpec(row.text("model"), **ints,  # type: ignore[arg-type]
                               gated_mlp=gated, experts=max(1, experts or 1), top_k=max(1, top_k or 1),
                               flash_attention=flash)
    except ValueError as exc:  # the spec names its own field; the column has the same name
        column = str(exc).split("TransformerSpec.", 1)[-1].split("=", 1)[0]
        raise row.fail(column if column in SCHEMA else "model", f"is invalid ({exc})") from None


def _run(index: int, row: _Row) -> Run:
    for column in _POSITIVE:
        row.integer(column)
    spec = _spec(row)
    gpu = row.text("gpu", tuple(BY_GPU))
    tp, pp, dp, cp, ep = (row.integer(c) or 1 for c in ("tp", "pp", "dp", "cp", "ep"))
    gpus = row.integer("gpus") or 1
    if gpus != tp * pp * dp * cp:
        raise row.fail("gpus", f"is not tp x pp x dp x cp = {tp * pp * dp * cp}")
    micro, interleave = row.integer("micro_batch", empty_ok=True), row.integer("interleave", empty_ok=True)
    zero = row.integer("zero", 0)
    if zero is None or zero > 3:
        raise row.fail("zero", "is not a ZeRO stage 0-3")
    layout = Layout(dp, tp, pp, zero, row.text("recompute", RECOMPUTE), micro or 1,
                    PRECISIONS[row.text("precision", tuple(PRECISIONS))], ep, cp, interleave or 1,
                    "interleaved" if (interleave or 1) > 1 else "1f1b")
    return Run(index, row.text("source"), spec, by_gpu(gpu), gpu, gpus, layout, micro, interleave,
               row.integer("global_batch") or 1, row.text("metric", METRICS), row.number("value"),
               bool((row.fields.get("attention") or "").strip()))


def _header(path: Path, header: list[str]) -> None:
    names = tuple(name.strip() for name in header)
    if names != SCHEMA:
        missing = [c for c in SCHEMA if c not in names]
        extra = [c for c in names if c not in SCHEMA]
        what = f"column {missing[0]} is missing" if missing else (
            f"column {extra[0]} is not in the schema" if extra else "the columns are out of order")
        raise ValueError(f"{path} header: {what} (expected: {','.join(SCHEMA)})")


def read_runs(path: str | Path) -> list[Run]:
    """The runs of a CSV in ``SCHEMA`` (ValueError, one line naming the row and the column, if malformed)."""
    path = Path(path)
    try:
        with path.open(newline="") as handle:
            lines = [(reader_line, values) for reader_line, values in _numbered(csv.reader(handle))]
    except OSError as exc:
        raise ValueError(f"--runs {path}: cannot read it ({exc.strerror})") from None
    if not lines:
        raise ValueError(f"{path}: empty (expected the header {','.join(SCHEMA)})")
    _header(path, lines[0][1])
    runs = []
    for index, (line, values) in enumerate(lines[1:], 1):
        where = f"{path} row {index} (line {line})"
        if len(values) != len(SCHEMA):
            raise ValueError(f"{where}: {len(values)} columns where the schema has {len(SCHEMA)}")
        runs.append(_run(index, _Row(where, dict(zip(SCHEMA, values, strict=True)))))
    if not runs:
        raise ValueError(f"{path}: no runs (a header and at least one row are needed)")
    return runs


def _numbered(reader: Any) -> list[tuple[int, list[str]]]:
    """Non-blank records with the line each ends on."""
    return [(reader.line_num, values) for values in reader if any(v.strip() for v in values)]
