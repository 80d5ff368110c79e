"""Data parallelism by hand: the gradients averaged with a pre-bound all_reduce after backward."""

import os

import torch
from torch import nn
from torch.distributed import ReduceOp, all_reduce, get_world_size, init_process_group


def main() -> None:
    init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = nn.Linear(10, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        loss = model(torch.randn(5, 10)).square().sum()
        loss.backward()
        for p in model.parameters():
            all_reduce(p.grad, op=ReduceOp.SUM)
            p.grad /= get_world_size()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
