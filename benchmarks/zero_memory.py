"""ZeRO's memory ratio: the largest rank's optimizer state under ZeroRedundancyOptimizer / under DDP.

An MLP of depth 20 (width 256; quick: 64), Adam, at world sizes 2 and 4; the
optimizer state is counted from its tensors (``dtlab.core.memory``), so the ratio is
a count, not a timing. Ideal: 1/world (0.5, 0.25); the largest
shard is a little above it when the layers do not divide evenly. Also FSDP2,
which shards parameters and gradients too.

Prints ``zero_memory.w2`` (target <= 0.55) and ``zero_memory.w4`` (target <=
0.3) and writes ``zero_memory.csv``.

    .venv/bin/python benchmarks/zero_memory.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import _common as common

from dtlab.core.config import RunConfig
from dtlab.train import run

NAME = "zero_memory"
TARGETS = {2: 0.55, 4: 0.3}
KINDS = ("parameters", "gradients", "optimizer_state")


def main() -> None:
    args = common.parse(common.parser(__doc__))
    width = 64 if args.quick else 256
    rows = []
    for world, bound in TARGETS.items():
        largest = {}
        for tier in ("ddp", "zero", "fsdp"):
            cfg = RunConfig(tier=tier, world_size=world, model="mlp", model_size=width, model_depth=20,
                            optimizer="adam", lr=1e-3, steps=2, global_batch_size=16, threads_per_rank=1)
            result = run(cfg, progress=False)
            largest[tier] = {k: max(r.memory.get(k, 0) for r in result.ranks) for k in KINDS}
            rows.append({"world_size": world, "tier": tier, **largest[tier]})
        ratio = largest["zero"]["optimizer_state"] / largest["ddp"]["optimizer_state"]
        fsdp = sum(largest["fsdp"].values()) / sum(largest["ddp"].values())
        common.result_line(f"{NAME}.w{world}", ratio, f"<= {bound:g}", quick=args.quick, passed=ratio <= bound,
                           detail=f"largest rank's optimizer state, zero / ddp; FSDP2 / DDP for parameters, "
                                  f"gradients and optimizer state together: {fsdp:.3f}")
    common.write_csv(args.out / f"{NAME}.csv", rows)


if __name__ == "__main__":
    main()
