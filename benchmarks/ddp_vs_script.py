"""dtlab's ddp tier against a plain torchrun DDP script: steady-state throughput. Target: dtlab/script >= 0.98.

Per round, interleaved: ``dtlab.train.run`` with tier ddp at world size 2
(recording on, as a user runs it), then ``plain_ddp_script.py`` under torchrun
with 2 processes. Same model (MLP), data (synthetic 8x8), global batch, steps,
SGD and one torch thread per rank. Both throughputs are the global batch over
the median step time after the same warm-up steps, a step lasting as long as
its slowest rank: process start-up is not in either number.

    .venv/bin/python benchmarks/ddp_vs_script.py [--quick] [--out results/bench] [--model-size 256 --batch 128]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _common as common

from dtlab.core.config import RunConfig
from dtlab.train import run

NAME = "ddp_vs_script"
TARGET = 0.98
WORLD = 2
THREADS = 1
SCRIPT = Path(__file__).resolve().parent / "plain_ddp_script.py"


def dtlab_variant(cfg: RunConfig, steps_out: list):
    def go(round_: int) -> dict:
        result = run(cfg, progress=False)
        threads = {r.provenance["threads_per_rank"] for r in result.ranks}
        if threads != {THREADS} or len(result.ranks) != WORLD:
            raise RuntimeError(f"dtlab ran {len(result.ranks)} ranks with {threads} threads")
        steps_out.extend({"round": round_, "variant": "dtlab", "step": step, "step_s": s}
                         for step, s in result.step_times().items())
        step_s = common.steady_step_s(result)
        return {"samples_per_s": cfg.global_batch_size / step_s, "median_step_s": step_s, "wall_s": result.wall_s}
    return go


def script_variant(cfg: RunConfig, steps_out: list, timeout_s: float):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPT),
               "--model-size", str(cfg.model_size), "--batch", str(cfg.global_batch_size), "--steps", str(cfg.steps),
               "--warmup", str(common.WARMUP_STEPS), "--dataset-size", str(cfg.dataset_size), "--lr", str(cfg.lr),
               "--seed", str(cfg.seed), "--threads", str(THREADS)]
    # As dtlab's ranks: gloo on loopback; OMP_NUM_THREADS also keeps torchrun from warning about it.
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "GLOO_SOCKET_IFNAME": "lo"}

    def go(round_: int) -> dict:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"plain DDP script failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-4000:]}")
        out = json.loads(lines[-1])
        if out["threads"] != THREADS or out["world_size"] != WORLD:
            raise RuntimeError(f"plain DDP script ran with {out['threads']} threads, world {out['world_size']}")
        steps_out.extend({"round": round_, "variant": "script", "step": step, "step_s": s}
                         for step, s in enumerate(out["step_s"]))
        return {"samples_per_s": out["samples_per_s"], "median_step_s": out["median_step_s"]}
    return go


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--model-size", type=int, default=256, help="MLP width (default 256)")
    p.add_argument("--batch", type=int, default=128, help="global batch size (default 128, 64 per rank)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 100, quick 10)")
    args = common.parse(p)
    steps = args.steps or (10 if args.quick else 100)
    cfg = RunConfig(tier="ddp", world_size=WORLD, model="mlp", model_size=args.model_size, dataset="synthetic",
                    dataset_size=4096, global_batch_size=args.batch, steps=steps, optimizer="sgd", lr=0.05,
                    threads_per_rank=THREADS)
    steps_rows: list = []  # per step, its slowest rank's time (s)
    variants = {"dtlab": dtlab_variant(cfg, steps_rows), "script": script_variant(cfg, steps_rows, timeout_s=300.0)}
    rows = common.interleave(variants, common.repeats(args, full=10, quick=1), warmup_rounds=0 if args.quick else 1,
                             log=common.note)
    rows = [{"model_size": cfg.model_size, "global_batch": cfg.global_batch_size, "steps": cfg.steps,
             "threads_per_rank": THREADS, "world_size": WORLD, **row} for row in rows]
    common.write_csv(args.out / f"{NAME}.csv", rows)
    common.write_csv(args.out / f"{NAME}_steps.csv", steps_rows)
    r = common.ratios(rows, "dtlab", "script", "samples_per_s")
    common.note(f"dtlab/script samples/s per round: {common.spread(r)}")
    ratio = common.median(r)
    dtlab_sps = common.median(common.per_round(rows, "dtlab", "samples_per_s").values())
    script_sps = common.median(common.per_round(rows, "script", "samples_per_s").values())
    common.result_line(NAME, ratio, f">= {TARGET}", quick=args.quick, passed=ratio >= TARGET,
                       detail=f"median samples/s dtlab {dtlab_sps:.0f}, script {script_sps:.0f} "
                              f"(MLP {cfg.model_size}, batch {cfg.global_batch_size}, world {WORLD}, "
                              f"{THREADS} thread/rank)")


if __name__ == "__main__":
    main()
