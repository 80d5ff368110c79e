"""Memory accounting: exact tensor bytes, and ZeRO's sharded optimizer state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtlab import RunConfig
from dtlab.core.memory import SavedActivations, optimizer_state_bytes, parameter_bytes, tensor_bytes
from dtlab.train import run

pytestmark = pytest.mark.usefixtures("no_survivors")
WIDTH = 64


def twenty_linear_layers(input_shape, num_classes):
    """The ZeroRedundancyOptimizer recipe's model (20 x Linear(2000, 2000)), shrunk to Linear(64, 64)."""
    return nn.Sequential(nn.Flatten(), *[nn.Linear(WIDTH, WIDTH) for _ in range(20)])


def test_tensor_bytes_counts_shared_storage_once():
    t = torch.zeros(100)
    assert tensor_bytes([t, t[:10], t.view(10, 10)]) == 400
    assert parameter_bytes(nn.Linear(10, 5)) == (50 + 5) * 4


def test_adam_state_is_two_moments_per_parameter():
    model = nn.Linear(10, 5)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    # exp_avg + exp_avg_sq per parameter; the step counters are scalar tensors
    assert optimizer_state_bytes(opt) == 2 * parameter_bytes(model) + 2 * 4


def test_saved_activations_are_counted():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(32, 8)
    with SavedActivations() as acts:
        model(x)
    # input to layer 1, ReLU output (saved by ReLU and layer 2): 32x8 + 32x16 floats, weights excluded
    assert acts.bytes(exclude=model.parameters()) == (32 * 8 + 32 * 16) * 4


def recipe(tier: str, world_size: int) -> RunConfig:
    return RunConfig(tier=tier, world_size=world_size, model=twenty_linear_layers, optimizer="adam", lr=1e-3,
                     steps=2, global_batch_size=16, threads_per_rank=1)


@pytest.mark.parametrize("world_size,bound", [(2, 0.55), (4, 0.3)])
def test_zero_shards_optimizer_state(world_size, bound):
    ddp = run(recipe("ddp", world_size), progress=False)
    zero = run(recipe("zero", world_size), progress=False)
    ddp_state = max(r.memory["optimizer_state"] for r in ddp.ranks)
    zero_state = [r.memory["optimizer_state"] for r in zero.ranks]
    assert ddp_state > 0
    assert max(zero_state) <= bound * ddp_state
    # nothing is lost: the shards add up to one full copy of the state
    assert sum(zero_state) == pytest.approx(ddp_state, rel=0.01)
    # parameters and gradients are not sharded by ZeRO-1
    assert zero.ranks[0].memory["parameters"] == ddp.ranks[0].memory["parameters"]
    assert zero.ranks[0].memory["gradients"] == ddp.ranks[0].memory["gradients"]
