"""The tensor-parallel MLP and FSDP-unit exercises: the references pass; wrong solutions fail saying why.

Each wrong solution below is a mistake a learner makes; its test asserts on the
part of the feedback that names the mistake. A wrong solution fails at the first
world size, so it is checked at world size 2 only: one launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises import fsdp_unit, tp_mlp
from dtlab.exercises._check import CheckResult, run_check

EXERCISES = (tp_mlp, fsdp_unit)
NAMES = ["tp_mlp", "fsdp_unit"]


def launches_ranks(test):
    """Marks a test that starts rank processes: slow, and failed if any rank outlives it."""
    return pytest.mark.slow(pytest.mark.usefixtures("no_survivors")(test))


def check(module, fn, world_sizes=(2,)) -> CheckResult:
    return run_check(module.EXERCISE, fn, world_sizes, timeout_s=10)


# -- tensor parallelism: communication written as autograd Functions ----------------------------------------------
class SumInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class SumInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out)
        return out


class SumBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out)
        return out


def tp_without_summing_x_grad(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(x, w1, b1))
    return SumInForward.apply(F.linear(h, w2)) + b2


def tp_summing_the_hidden_activation(x, w1, b1, w2, b2):
    h = SumInForward.apply(F.linear(SumInBackward.apply(x), w1, b1))
    return F.linear(F.gelu(h), w2) + b2


def tp_summing_the_output_gradient_too(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(SumInBackward.apply(x), w1, b1))
    return SumBothWays.apply(F.linear(h, w2)) + b2


def tp_adding_b2_on_every_rank(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(SumInBackward.apply(x), w1, b1))
    return SumInForward.apply(F.linear(h, w2, b2))


# -- FSDP: one unit's step -----------------------------------------------------------------------------------------
def _gather(unit):
    full = torch.empty(unit.padded_numel)
    dist.all_gather_into_tensor(full, unit.shard)
    return full.requires_grad_()


def fsdp_freeing_storage_as_fsdp_does(unit, x, y, lr):
    """Keeps one buffer across steps, list-based collectives, and frees the buffer's storage after each step."""
    n = dist.get_world_size()
    if not hasattr(unit, "buffer"):
        unit.buffer = torch.empty(unit.padded_numel)
    unit.buffer.untyped_storage().resize_(4 * unit.padded_numel)
    dist.all_gather(list(unit.buffer.chunk(n)), unit.shard)
    full = unit.buffer.detach().requires_grad_()
    loss = F.cross_entropy(unit.forward(full, x), y)
    loss.backward()
    grad = torch.empty_like(unit.shard)
    dist.reduce_scatter(grad, list(full.grad.chunk(n)))
    unit.shard.sub_(grad, alpha=lr / n)
    unit.buffer.untyped_storage().resize_(0)
    return loss.item()


def fsdp_without_dividing(unit, x, y, lr):
    full = _gather(unit)
    F.cross_entropy(unit.forward(full, x), y).backward()
    grad = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(grad, full.grad)
    unit.shard.sub_(lr * grad)


def fsdp_keeping_the_full_parameter(unit, x, y, lr):
    unit.full = _gather(unit)  # kept on the unit until the next step replaces it
    F.cross_entropy(unit.forward(unit.full, x), y).backward()
    grad = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(grad, unit.full.grad)
    unit.shard.sub_(grad, alpha=lr / dist.get_world_size())


def fsdp_gathering_into_a_kept_buffer(unit, x, y, lr):
    if not hasattr(unit, "buffer"):
        unit.buffer = torch.empty(unit.padded_numel)
    dist.all_gather_into_tensor(unit.buffer, unit.shard)
    full = unit.buffer.clone().requires_grad_()
    F.cross_entropy(unit.forward(full, x), y).backward()
    grad = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(grad, full.grad)
    unit.shard.sub_(grad, alpha=lr / dist.get_world_size())


def fsdp_all_reducing_the_gradient(unit, x, y, lr):
    full = _gather(unit)
    F.cross_entropy(unit.forward(full, x), y).backward()
    dist.all_reduce(full.grad)
    size, rank = unit.shard.numel(), dist.get_rank()
    unit.shard.sub_(full.grad[rank * size:(rank + 1) * size], alpha=lr / dist.get_world_size())


# -- no processes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", EXERCISES, ids=NAMES)
def test_each_exercise_is_described_with_three_hints_and_a_stub(module):
    ex = module.EXERCISE
    assert ex.description.startswith("Write fn(") and "\n" not in ex.description
    assert "Checked at world sizes 2 and 4" in ex.description
    assert ex.world_sizes == (2, 4) and ex.allowed_world_sizes == (2, 4)
    assert len(ex.hints) == 3 and all(len(h) > 80 for h in ex.hints)
    assert callable(ex.solution) and f"describe('{ex.name}')" in ex.stub.__doc__


def test_tp_shares_of_x_grad_add_up_to_the_unsplit_gradient():
    _, grads, shares = tp_mlp.reference(4)
    assert torch.allclose(sum(shares), grads[0]["x"], atol=1e-6)
    assert not torch.allclose(shares[0], grads[0]["x"], atol=1e-3)  # a partial sum is told apart from the whole
    assert grads[1]["w1"].shape == (tp_mlp.HIDDEN // 4, tp_mlp.D_IN)


def test_fsdp_unit_pads_its_shards_and_forward_wants_the_whole_parameter():
    unit = fsdp_unit.FlatUnit(rank=1, world_size=4)
    assert (unit.numel, unit.padded_numel, unit.shard.numel()) == (113, 116, 29)
    x = torch.zeros(3, fsdp_unit.FEATURES)
    with pytest.raises(ValueError, match="unit.padded_numel = 116 elements; got \\(113,\\)"):
        unit.forward(torch.zeros(113, requires_grad=True), x)
    with pytest.raises(ValueError, match="call full.requires_grad_\\(\\) first"):
        unit.forward(torch.zeros(116), x)


# -- on ranks ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module,verified", [
    (tp_mlp, "forward: all_reduce ×1 of 192 bytes (the output); its backward: all_reduce ×1 of 384 bytes"),
    (fsdp_unit, "n=2: all_gather_into_tensor and reduce_scatter_tensor of 456 bytes each, a shard of 228 bytes"),
], ids=NAMES)
@launches_ranks
def test_the_reference_passes_at_world_sizes_2_and_4(module, verified):
    result = check(module, module.EXERCISE.solution, (2, 4))
    assert result.passed, result.feedback
    assert "world sizes 2, 4" in result.feedback and verified in result.feedback


@pytest.mark.parametrize("module,says", [
    (tp_mlp, "write the tensor-parallel MLP: compute with this rank's shards"),
    (fsdp_unit, "write the FSDP step: gather the whole flat parameter from every rank's unit.shard"),
], ids=NAMES)
@launches_ranks
def test_the_stub_fails_saying_what_to_write(module, says):
    feedback = check(module, module.EXERCISE.stub).feedback
    assert feedback.startswith("World size 2: rank ") and "raised NotImplementedError" in feedback and says in feedback


@launches_ranks
def test_fsdp_accepts_a_kept_buffer_whose_storage_is_freed():
    result = check(fsdp_unit, fsdp_freeing_storage_as_fsdp_does)
    assert result.passed, result.feedback


@pytest.mark.parametrize("fn,says", [
    (tp_without_summing_x_grad, ["x.grad on rank 0 is only this rank's partial sum",
                                 "nothing in your backward summed them over the ranks"]),
    (tp_summing_the_hidden_activation, ["rank 0 all-reduced 640 bytes (this rank's hidden activation, 8 × 20 "
                                        "float32) in forward; expected one all_reduce of 192 bytes (the output's "
                                        "size, 8 × 6 float32)", "adds unrelated units together"]),
    (tp_summing_the_output_gradient_too, ["the gradients of x, w1, b1 and w2 are 2× the unsplit MLP's",
                                          "the output's gradient was summed over the ranks in backward",
                                          "counts it 2 times"]),
    (tp_adding_b2_on_every_rank, ["rank 0's output is the unsplit MLP's plus 1 × b2"]),
], ids=["no-sum-in-backward", "sum-of-hidden", "sum-both-ways", "b2-on-every-rank"])
@launches_ranks
def test_tp_rejects_a_wrong_placement_saying_what_is_wrong(fn, says):
    feedback = check(tp_mlp, fn).feedback
    assert feedback.startswith("World size 2: ")
    for phrase in says:
        assert phrase in feedback, feedback


@pytest.mark.parametrize("fn,says", [
    (fsdp_without_dividing, ["after step 0 the shards, put together, differ by",
                             "the gradient is 2× the global batch's", "divide by the world size"]),
    (fsdp_keeping_the_full_parameter, ["after step 0 rank 0 still holds the full parameter you passed to "
                                       "unit.forward (456 bytes)", "the full parameter is kept between steps"]),
    (fsdp_gathering_into_a_kept_buffer, ["still holds the all-gathered parameter (456 bytes)",
                                         "the full parameter is kept between steps"]),
    (fsdp_all_reducing_the_gradient, ["rank 0 all-reduced 456 bytes in step 0, the whole flat gradient",
                                      "Reduce-scatter it"]),
], ids=["not-divided", "keeps-full", "keeps-buffer", "all-reduce"])
@launches_ranks
def test_fsdp_rejects_a_wrong_step_saying_what_is_wrong(fn, says):
    feedback = check(fsdp_unit, fn).feedback
    assert feedback.startswith("World size 2: ")
    for phrase in says:
        assert phrase in feedback, feedback
