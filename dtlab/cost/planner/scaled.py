"""A planned layout as a job this machine can run: the same kind of parallelism, at charformer size.

The degrees shrink to what a few CPU processes hold (world size 2, or 4 for a
2-D mesh), the model to a small ``charformer`` (``moe`` for expert parallelism); what survives is *which*
strategies the layout combines, so a learner can watch them run and hold the
memory estimate against what the ranks measure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtlab.core import registry
from dtlab.core.config import RunConfig
from dtlab.tiers import ddp as ddp_tier
from dtlab.tiers import fsdp, fsdp_tp, pipeline, tp, zero

__all__ = ["scaled_down", "scaled_tier"]

WIDTH, DEPTH, BATCH = 64, 2, 16  # a charformer a CPU step takes milliseconds on


def scaled_tier(row: Mapping[str, Any]) -> tuple[str, int, str]:
    """(tier, world size, what the scaled job keeps and drops) for a plan row."""
    tier, world, why = _degrees(row)
    return tier, world, _note(row, tier, why)


def _degrees(row: Mapping[str, Any]) -> tuple[str, int, str]:
    dp, tpd, pp, stage = int(row["dp"]), int(row["tp"]), int(row["pp"]), int(row["zero"])
    ep = int(row.get("ep", 1))
    if ep > 1:
        return "ep", 2, (f"ep={ep} -> expert parallel on 2 ranks (the moe model, 2 of its 4 experts each); dp={dp}, "
                         f"tp={tpd}, pp={pp} and ZeRO stage {stage} are not combined here")
    if pp > 1:
        return "pipeline", 2, f"pp={pp} -> 2 pipeline stages (1F1B); dp={dp} and tp={tpd} are not combined here"
    if tpd > 1 and dp > 1:
        return "fsdp-tp", 4, f"dp={dp} x tp={tpd} -> a 2 x 2 mesh (FSDP2 across, tensor parallel along each row)"
    if tpd > 1:
        return "tp", 2, f"tp={tpd} -> tensor parallel on 2 ranks (the charformer's 2 heads, one per rank)"
    if dp > 1:
        tier = {0: "ddp", 1: "zero", 2: "zero", 3: "fsdp"}[stage]
        note = " (ZeroRedundancyOptimizer shards the optimizer state only: stage 1)" if stage == 2 else ""
        return tier, 2, f"dp={dp}, ZeRO stage {stage} -> {tier} on 2 ranks{note}"
    return "single", 1, "one GPU -> one process"


def _note(row: Mapping[str, Any], tier: str, why: str) -> str:
    """What the scaled job keeps of the row, and what it cannot."""
    spec = registry.get(tier)
    if row.get("checkpointing") == "selective" and spec.activation_checkpointing:
        why += "; selective recomputation runs as whole-block checkpointing"
    if row.get("checkpointing") in ("selective", "full") and not spec.activation_checkpointing:
        why += f"; the {tier} tier runs without checkpointing"
    if row.get("precision") == "bf16" and not spec.autocast:
        why += f"; the {tier} tier runs fp32 only"
    return why


def _options(tier: str, micro_batches: int) -> Any:
    if tier == "pipeline":
        return pipeline.Options(schedule="1f1b", microbatches=micro_batches)
    if tier == "fsdp-tp":
        return fsdp_tp.Options(tp_size=2)
    return {"ddp": ddp_tier.Options, "zero": zero.Options, "fsdp": fsdp.Options, "tp": tp.Options}.get(
        tier, lambda: None)()


def scaled_down(row: Mapping[str, Any], *, steps: int = 5, width: int = WIDTH) -> RunConfig:
    """The plan row's layout as a small charformer job on this machine (validated by RunConfig and the tier)."""
    tier, world, _ = scaled_tier(row)
    micro_batches = 4 if tier == "pipeline" else 1
    spec = registry.get(tier)
    recompute = str(row.get("checkpointing", "none")) != "none" and spec.activation_checkpointing
    precision = "bf16" if row.get("precision") == "bf16" and spec.autocast else "fp32"
    model = "moe" if tier == "ep" else "charformer"
    return RunConfig(tier=tier, world_size=world, model=model, dataset="text", model_size=width,
                     model_depth=DEPTH, global_batch_size=BATCH, steps=steps, lr=0.003, optimizer="adam",
                     threads_per_rank=1, precision=precision, activation_checkpointing=recompute,
                     tier_options=_options(tier, micro_batches))
