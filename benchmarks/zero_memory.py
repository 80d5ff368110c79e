"""ZeRO's memory ratio: the largest rank's optimizer state under ZeroRedundancyOptimizer / under DDP.

An MLP of depth 20 (width 256; quick: 64), Adam, at world sizes 2 and 4; the
optimizer state is counted from its tensors (``dtlab.core.memory``), so the ratio is
a count, not a timing. Ideal: 1/world (0.5, 0.25); the largest
shard is a little above it when the layers do not divide evenly. Also FSDP2,
which shards parameters and gradients too.

Those ratios count parameters, gradients and optimizer state only. Beside them
(in the detail and the CSV): the largest rank's every counted kind added up
(activations and communication buffers too: DDP's bucket buffers, FSDP2's
all-gathered units; an upper bound on what the rank holds at once, since
activations are freed as gradients fill in), and each process's peak resident
memory (``peak_rss``: the interpreter and torch's libraries included).

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
COUNTED = (*KINDS, "activations", "comm_buffers")


def largest_rank(result) -> dict[str, int]:
    """Per kind the largest rank's bytes; ``counted``: the largest of the ranks' every kind added up."""
    out = {k: max(r.memory.get(k, 0) for r in result.ranks) for k in (*COUNTED, "peak_rss")}
    out["counted"] = max(sum(r.memory.get(k, 0) for k in COUNTED) for r in result.ranks)
    return out


def main() -> None:
    args = common.parse(common.parser(__doc__))
    width = 64 if args.quick else 256
    rows = []
    for world, bound in TARGETS.items():
        largest = {}
        for tier in ("ddp", "zero", "fsdp"):
            cfg = RunConfig(tier=tier, world_size=world, model="mlp", model_size=width, model_depth=20,
                            optimizer="adam", lr=1e-3, steps=2, global_batch_size=16, threads_per_rank=1)
            largest[tier] = largest_rank(run(cfg, progress=False))
            rows.append({"world_size": world, "tier": tier, **largest[tier]})
        ratio = largest["zero"]["optimizer_state"] / largest["ddp"]["optimizer_state"]
        fsdp = sum(largest["fsdp"][k] for k in KINDS) / sum(largest["ddp"][k] for k in KINDS)
        counted, rss = ({t: largest[t][key] / largest["ddp"][key] for t in ("zero", "fsdp")}
                        for key in ("counted", "peak_rss"))
        common.result_line(f"{NAME}.w{world}", ratio, f"<= {bound:g}", quick=args.quick, passed=ratio <= bound,
                           detail=f"largest rank's optimizer state, zero / ddp; FSDP2 / DDP for parameters, "
                                  f"gradients and optimizer state together: {fsdp:.3f}; every counted kind "
                                  f"(activations and comm buffers too), largest rank, zero / ddp "
                                  f"{counted['zero']:.3f}, fsdp / ddp {counted['fsdp']:.3f}; peak RSS per process "
                                  f"zero / ddp {rss['zero']:.3f}, fsdp / ddp {rss['fsdp']:.3f} (ddp "
                                  f"{largest['ddp']['peak_rss'] / 2**20:.0f} MiB)")
    common.write_csv(args.out / f"{NAME}.csv", rows)

if __name__ == "__main__":
    main()
