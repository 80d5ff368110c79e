"""A layout: how a job's GPUs are shared out (dp x tp x pp x cp, ep, ZeRO, recomputation, micro-batch, schedule).

Ranks are ordered as Megatron-LM orders them: tensor-parallel ranks adjacent (a tp group never leaves a
node), then context parallel, then data parallel, pipeline stages outermost; expert parallelism takes
``ep`` of the data-parallel ranks (Megatron-LM and DeepSpeed-MoE place experts so). ``check_layout``
says in one line what makes a layout impossible; ``layouts`` enumerates the ones ``search`` ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtlab.cost.planner.clusters import Cluster
from dtlab.cost.planner.transformer import RECOMPUTE, TransformerSpec

__all__ = ["MICRO_BATCHES", "PRECISIONS", "SCHEDULES", "ZERO_STAGES", "Layout", "check_layout", "divisors", "layouts",
           "positive_int"]

MICRO_BATCHES = (1, 2, 4, 8)  # micro-batch sizes (sequences) the search tries
ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("bf16", "fp32")
# pipeline schedules: GPipe (all forwards, then all backwards), 1F1B (Narayanan et al. 2021), interleaved 1F1B
# with ``interleave`` model chunks per GPU (ibid.), and zero bubble ZB-H1 (Qi et al. 2023, arXiv 2401.10241)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


@dataclass(frozen=True)
class Layout:
    """One way to run the job; ``micro_batch`` is in sequences, ``interleave`` the model chunks per pipeline GPU."""

    dp: int
    tp: int
    pp: int
    zero: int
    checkpointing: str
    micro_batch: int
    precision: str
    ep: int = 1  # expert parallel: the experts shared out over ep of the dp ranks
    cp: int = 1  # context parallel: each sequence split over cp ranks
    interleave: int = 1
    schedule: str = "1f1b"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def stage_layers(self, layers: int) -> int:
        """Layers on the busiest stage: ``layers / pp``, rounded up when they do not divide (Llama 3's 126 layers
        on 16 stages: the first and last stages, which hold the embedding and the head, take one fewer)."""
        return -(-layers // self.pp)


def positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")


def _check_parallel(model: TransformerSpec, cluster: Cluster, layout: Layout) -> None:
    for name in ("dp", "tp", "pp", "cp", "micro_batch", "ep", "interleave"):
        positive_int(name, getattr(layout, name))
    if layout.ep > 1 and (layout.dp % layout.ep or model.experts % layout.ep):
        raise ValueError(f"ep={layout.ep} is invalid: it must divide dp={layout.dp} and the model's "
                         f"{model.experts} expert(s)")
    if layout.tp > cluster.gpus_per_node or cluster.gpus_per_node % layout.tp:
        raise ValueError(f"tp={layout.tp} is invalid: a tensor-parallel group stays inside one node of "
                         f"{cluster.gpus_per_node} GPUs (tp must divide it)")
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        raise ValueError(f"tp={layout.tp} is invalid: it must divide the {model.heads} attention heads and the "
                         f"{model.kv_heads} key/value heads")
    if model.seq % (2 * layout.cp) and layout.cp > 1:
        raise ValueError(f"cp={layout.cp} is invalid: each of the cp ranks takes two chunks of the {model.seq}-token "
                         f"sequence (2 x cp must divide it)")
    if layout.pp > model.layers:
        raise ValueError(f"pp={layout.pp} is invalid: more stages than the {model.layers} layers")
    if layout.stage_layers(model.layers) % layout.interleave:
        raise ValueError(f"interleave={layout.interleave} is invalid: it must divide the "
                         f"{layout.stage_layers(model.layers)} layers of a stage into equal chunks")


def _check_schedule(layout: Layout, global_batch: int) -> None:
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"schedule={layout.schedule!r} is invalid: choose one of {', '.join(SCHEDULES)}")
    if (layout.schedule == "interleaved") != (layout.interleave > 1):
        raise ValueError(f"interleave={layout.interleave} is invalid with schedule={layout.schedule!r}: the "
                         f"interleaved schedule, and only it, runs more than one chunk per GPU")
    if layout.pp > 1 and layout.micro_batches(global_batch) < layout.pp and layout.schedule != "gpipe":
        raise ValueError(f"micro_batch={layout.micro_batch} is invalid: {layout.schedule} needs at least "
                         f"pp={layout.pp} micro-batches per step")


def check_layout(model: TransformerSpec, cluster: Cluster, layout: Layout, global_batch: int) -> None:
    """ValueError, one line naming the field, for a layout that cannot run."""
    _check_parallel(model, cluster, layout)
    if layout.zero not in ZERO_STAGES:
        raise ValueError(f"zero={layout.zero!r} is invalid: choose one of {ZERO_STAGES}")
    if layout.pp > 1 and layout.zero >= 3:
        raise ValueError(f"zero={layout.zero} is invalid with pp={layout.pp}: pipelines shard the optimizer state and "
                         f"gradients (stages 1-2), not the parameters every micro-batch needs")
    if layout.checkpointing not in RECOMPUTE:
        raise ValueError(f"checkpointing={layout.checkpointing!r} is invalid: choose one of {', '.join(RECOMPUTE)}")
    if layout.precision not in PRECISIONS:
        raise ValueError(f"precision={layout.precision!r} is invalid: choose one of {', '.join(PRECISIONS)}")
    if global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"micro_batch={layout.micro_batch} is invalid: dp x micro_batch = "
                         f"{layout.dp * layout.micro_batch} must divide global_batch={global_batch}")
    _check_schedule(layout, global_batch)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(model: TransformerSpec, pp: int) -> list[tuple[int, str]]:
    """1F1B, and the interleaved schedule with two chunks where a stage's layers split in two."""
    if pp == 1:
        return [(1, "1f1b")]
    return [(1, "1f1b")] + ([(2, "interleaved")] if (model.layers // pp) % 2 == 0 else [])


def layouts(model: TransformerSpec, cluster: Cluster, gpus: int, global_batch: int) -> Iterator[Layout]:
    """Every valid layout of ``gpus`` GPUs without context parallelism (ZeRO stages above 0 only where dp > 1:
    one rank has nothing to shard)."""
    for tp in divisors(gpus):
        for pp in [p for p in divisors(gpus // tp) if model.layers % p == 0]:  # the search keeps stages equal
            dp = gpus // (tp * pp)
            for ep in [e for e in divisors(dp) if model.experts % e == 0]:
                for b in MICRO_BATCHES:
                    for zero in ZERO_STAGES if dp > 1 else (0,):
                        for ckpt in RECOMPUTE:
                            for precision in PRECISIONS:
                                for v, schedule in _schedules(model, pp):
                                    layout = Layout(dp, tp, pp, zero, ckpt, b, precision, ep, 1, v, schedule)
                                    try:
                                        check_layout(model, cluster, layout, global_batch)
                                    except ValueError:
                                        continue
                                    yield layout
