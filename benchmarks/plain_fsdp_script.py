"""A plain FSDP2 training script, as PyTorch's FSDP2 tutorial writes one. Torch only.

The baseline that ``fsdp_vs_script.py`` holds dtlab's fsdp tier against. As
the tutorial does: ``fully_shard`` on each block of the model, then on the root,
with FSDP2's defaults (the process group's devices as the mesh, parameters
resharded after forward in every block but the root, no mixed precision, no
offload), and the optimizer built over the sharded parameters. The blocks are
the units dtlab's fsdp tier shards (``dtlab.tiers.fsdp.shard_units``): for the
MLP, an ``nn.Sequential``, each child with parameters -- its three Linear
layers. The model, data, training loop, timing and JSON line are
``plain_ddp_script.py``'s, so the two baselines differ only in the wrapping.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 benchmarks/plain_fsdp_script.py --model-size 256 --batch 128 --steps 60
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from plain_ddp_script import arguments, mlp, report, train  # this folder: torchrun runs the script from here
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args = arguments(__doc__)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment

    torch.manual_seed(args.seed)  # every rank builds the same full model; fully_shard keeps each rank's slice
    model = mlp(64, args.model_size, 10)
    for layer in model:
        if any(True for _ in layer.parameters()):  # Flatten and ReLU hold nothing to shard
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # over the DTensor shards
    report(train(model, optimizer, args), args)


if __name__ == "__main__":
    main()
