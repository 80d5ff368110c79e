"""A script that hangs: at step 2 rank 1 skips the gradient all_reduce the other rank waits in."""

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    dist.init_process_group("gloo")
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.randn(2, 8)).sum().backward()
        if not (step == 2 and dist.get_rank() == 1):
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
