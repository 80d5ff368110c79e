"""Memory per rank of tensor parallelism and activation checkpointing, counted from the tensors.

A charformer of 4 blocks (width 64, batch 64; quick: 2 blocks, 2 steps) on
``single``, ``ddp`` and ``tp`` (with and without sequence parallelism) at world
2, and ``single`` with activation checkpointing. Counts, not timings, so one
run each is exact.

Prints ``tp_memory.parameters`` (tp / ddp parameter bytes per rank, target
<= 0.55) and ``tp_memory.recompute`` (activation bytes with / without
activation checkpointing, target <= 0.5) and writes ``tp_memory.csv``.

    .venv/bin/python benchmarks/tp_memory.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import _common as common

from dtlab.core.config import RunConfig
from dtlab.tiers.tp import Options
from dtlab.train import run

NAME = "tp_memory"
KINDS = ("parameters", "gradients", "optimizer_state", "activations")


def main() -> None:
    args = common.parse(common.parser(__doc__))
    base = RunConfig(model="charformer", dataset="text", model_depth=2 if args.quick else 4, steps=2,
                     optimizer="sgd", lr=0.05, threads_per_rank=1)
    runs = {
        "single": base,
        "single + activation checkpointing": base.replace(activation_checkpointing=True),
        "ddp": base.replace(tier="ddp", world_size=2),
        "tp": base.replace(tier="tp", world_size=2),
        "tp + sequence parallel": base.replace(tier="tp", world_size=2,
                                               tier_options=Options(sequence_parallel=True)),
    }
    largest = {}
    for label, cfg in runs.items():
        result = run(cfg, progress=False)
        largest[label] = {k: max(r.memory.get(k, 0) for r in result.ranks) for k in KINDS}
    rows = [{"run": label, **kinds} for label, kinds in largest.items()]
    params = largest["tp"]["parameters"] / largest["ddp"]["parameters"]
    acts = largest["single + activation checkpointing"]["activations"] / largest["single"]["activations"]
    detail = "; ".join(f"{label}: {kinds['parameters'] / 1e3:.0f} kB parameters, "
                       f"{kinds['activations'] / 1e6:.1f} MB activations" for label, kinds in largest.items())
    common.result_line(f"{NAME}.parameters", params, "<= 0.55", quick=args.quick, passed=params <= 0.55,
                       detail=f"largest rank's parameters, tp / ddp at world 2; {detail}")
    common.result_line(f"{NAME}.recompute", acts, "<= 0.5", quick=args.quick, passed=acts <= 0.5,
                       detail="recorded activation bytes of single, with / without activation checkpointing")
    common.write_csv(args.out / f"{NAME}.csv", rows)


if __name__ == "__main__":
    main()
