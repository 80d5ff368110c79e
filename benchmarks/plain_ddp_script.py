"""A plain DistributedDataParallel training script, as the PyTorch DDP tutorial writes one. Torch only.

The baseline that ``ddp_vs_script.py`` holds dtlab's ddp tier against: the
same model as ``dtlab.core.models.mlp`` (Flatten, Linear(64, W), ReLU, Linear(W, W),
ReLU, Linear(W, 10)), the same synthetic 8x8 data, SGD, the same global batch
split evenly over the ranks. The data sit in memory as tensors and each rank
indexes its share of every batch (no DataLoader, whose per-sample collation
would only slow the baseline down).

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 benchmarks/plain_ddp_script.py --model-size 256 --batch 128 --steps 60

Each rank times its own steps; rank 0 gathers the times and prints one JSON
line: ``samples_per_s`` (global batch / median step time over the steps after
``--warmup``, a step taking as long as its slowest rank) and the step times.
``plain_fsdp_script.py`` reuses this file's model, data, loop and report, so
the two baselines differ only in how they wrap the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(n_in: int, width: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, num_classes))


def synthetic(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8x8 inputs labelled by a fixed random teacher (as dtlab's synthetic data set)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(size, 1, 8, 8, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    return x, (torch.tanh(x.flatten(1)) @ teacher).argmax(1)


def arguments(description: str) -> argparse.Namespace:
    """The command line both plain scripts take (the benchmarks pass dtlab's run's values)."""
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--model-size", type=int, default=256, help="MLP width")
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> list[float]:
    """The training loop, each step timed on this rank: its share of every global batch, forward, backward, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch={args.batch} must be divisible by the world size {world}")
    per_rank = args.batch // world
    x_all, y_all = synthetic(args.dataset_size, args.seed)
    steps_per_epoch = (args.dataset_size // world) // per_rank
    g = torch.Generator().manual_seed(args.seed)

    step_s = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        epoch, i = divmod(step, steps_per_epoch)
        if i == 0:
            g.manual_seed(args.seed + epoch)
            mine = torch.randperm(args.dataset_size, generator=g)[rank::world]  # DistributedSampler's split
        idx = mine[i * per_rank:(i + 1) * per_rank]
        x, y = x_all[idx], y_all[idx]
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()  # what a script logging its loss pays every step
        step_s.append(time.perf_counter() - t0)
    return step_s


def report(step_s: list[float], args: argparse.Namespace) -> None:
    """Rank 0 prints the JSON line (a step taking as long as its slowest rank); then every rank leaves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[list[float] | None] = [None] * world
    dist.all_gather_object(gathered, step_s)
    if rank == 0:
        slowest = [max(times[s] for times in gathered) for s in range(args.steps)]
        steady = sorted(slowest[min(args.warmup, args.steps - 1):])
        mid = len(steady) // 2
        median = steady[mid] if len(steady) % 2 else (steady[mid - 1] + steady[mid]) / 2
        print(json.dumps({"samples_per_s": args.batch / median, "median_step_s": median, "world_size": world,
                          "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                          "step_s": slowest}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13 + gloo sometimes aborts during interpreter teardown even after
    # destroy_process_group ("terminate called without an active exception"); the
    # measurement is printed by now, so leave without running the teardown.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    args = arguments(__doc__)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment

    torch.manual_seed(args.seed)
    model = DDP(mlp(64, args.model_size, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    report(train(model, optimizer, args), args)


if __name__ == "__main__":
    main()
