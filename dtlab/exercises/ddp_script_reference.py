"""The reference for the ``ddp_script`` exercise: data-parallel training of a small MLP, run by torchrun.

::

    python -m torch.distributed.run --nproc-per-node 2 ddp_script_reference.py --out DIR --epochs 2

DIR must hold ``data.pt`` (``exercises.check("ddp_script", path)`` writes it).
torchrun starts this script once per rank, with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in each process's environment; every rank builds the same model,
trains on its own share of each epoch, and DDP averages the gradients in backward.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small MLP on DIR/data.pt with DistributedDataParallel.")
    parser.add_argument("--out", required=True, help="the folder that holds data.pt and receives the results")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # rank, world size and rank 0's address come from torchrun's environment
    rank = dist.get_rank()

    data = torch.load(os.path.join(args.out, "data.pt"), weights_only=True)
    dataset = TensorDataset(data["x"], data["y"])
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's 1/n of the samples, shuffled
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)  # 4 samples per rank: a global batch of 4n

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # shuffle with seed + epoch: a new order each epoch, the same on every rank
        with open(os.path.join(args.out, f"indices_rank{rank}_epoch{epoch}.json"), "w") as f:
            json.dump(list(sampler), f)  # the samples this rank trains on this epoch, in order
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # DDP all-reduces the gradients: the global batch's mean
            optimizer.step()

    if rank == 0:  # the replicas are identical: one copy is enough
        torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
    dist.barrier()  # no rank goes on (or reads model.pt) before it is written
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
