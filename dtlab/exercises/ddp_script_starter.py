"""Starter for the ``ddp_script`` exercise: a training script for ONE process. Make it data parallel.

Copy it, edit the copy, and check the copy::

    import shutil
    from dtlab import exercises

    shutil.copy(exercises.stub("ddp_script"), "my_ddp_script.py")
    # ... edit my_ddp_script.py: the TODOs below ...
    exercises.check("ddp_script", "my_ddp_script.py")

The check runs it as ``python -m torch.distributed.run --nproc-per-node 2 my_ddp_script.py
--out DIR --epochs 2``: two processes, each running this whole script. Each TODO is
one piece of DistributedDataParallel training; ``exercises.describe("ddp_script")``
has the rules.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small MLP on DIR/data.pt.")
    parser.add_argument("--out", required=True, help="the folder that holds data.pt and receives the results")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    # TODO 1: join the other processes into one world: dist.init_process_group("gloo"). torchrun's environment
    # (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) gives it everything it needs.
    if not dist.is_initialized():
        raise NotImplementedError(
            "this starter trains on one process; under torchrun every rank runs it separately. TODO 1: call "
            "dist.init_process_group('gloo'), then give each rank its share of the data (DistributedSampler, "
            "set_epoch every epoch), wrap the model in DistributedDataParallel, and save on rank 0 only, behind "
            "a barrier: see the TODOs in the starter")
    rank = dist.get_rank()

    data = torch.load(os.path.join(args.out, "data.pt"), weights_only=True)
    dataset = TensorDataset(data["x"], data["y"])
    # TODO 2: sampler = DistributedSampler(dataset, shuffle=True, seed=0), and DataLoader(..., sampler=sampler)
    loader = DataLoader(dataset, batch_size=4, shuffle=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    # TODO 3: wrap the model in DistributedDataParallel (its optimizer then takes the wrapper's parameters)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(args.epochs):
        # TODO 4: sampler.set_epoch(epoch), and write list(sampler) (this rank's samples, in order) below
        indices = list(range(len(dataset)))
        with open(os.path.join(args.out, f"indices_rank{rank}_epoch{epoch}.json"), "w") as f:
            json.dump(indices, f)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    # TODO 5: save on rank 0 only (the wrapped model's model.module.state_dict()), then dist.barrier() on every
    # rank, then dist.destroy_process_group()
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
