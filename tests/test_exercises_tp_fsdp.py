"""The tensor-parallel MLP and FSDP-unit exercises: the references pass; wrong solutions fail saying why.

Each wrong solution below is a mistake a learner makes; its row asserts on the part of the feedback that names
the mistake. A wrong solution fails at the first world size, so it is checked at world size 2 only, and all
that return on every rank share one launch per exercise (``check_each``). Names imported from
torch.distributed at the top of this module are bound when a rank imports it, before that rank's recorder
starts: a check must see the calls made through them all the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_gather as gather_the_weights
from torch.distributed import all_gather_into_tensor, all_reduce, get_rank, get_world_size, reduce_scatter_tensor

from dtlab.exercises import fsdp_unit, tp_mlp
from tests.exercise_batch import check, check_each, launches_ranks

EXERCISES = (tp_mlp, fsdp_unit)
NAMES = ["tp_mlp", "fsdp_unit"]



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


class MeanInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out)
        return out / dist.get_world_size()


class SumThroughPreboundName(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = t.clone()
        all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class SumInBackwardThroughPreboundName(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        all_reduce(out)
        return out


def tp_with_names_imported_from_torch_distributed(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(SumInBackwardThroughPreboundName.apply(x), w1, b1))
    return SumThroughPreboundName.apply(F.linear(h, w2)) + b2


def tp_averaging_the_output(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(SumInBackward.apply(x), w1, b1))
    return SumInForward.apply(F.linear(h, w2)) / dist.get_world_size() + b2


def tp_averaging_x_grad(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(MeanInBackward.apply(x), w1, b1))
    return SumInForward.apply(F.linear(h, w2)) + b2


def tp_computing_whole_after_a_renamed_gather(x, w1, b1, w2, b2):
    """Gathers the other ranks' weights through a name bound before the recorder, then runs the whole MLP; its own
    shards stay in the graph, so every output and gradient is right and nothing needs summing."""
    rank, n = get_rank(), get_world_size()
    rows = [torch.empty_like(w1) for _ in range(n)]
    biases = [torch.empty_like(b1) for _ in range(n)]
    columns = [torch.empty_like(w2.T.contiguous()) for _ in range(n)]
    gather_the_weights(rows, w1.detach())
    gather_the_weights(biases, b1.detach())
    gather_the_weights(columns, w2.detach().T.contiguous())
    rows[rank], biases[rank], columns[rank] = w1, b1, w2.T
    return F.linear(F.gelu(F.linear(x, torch.cat(rows), torch.cat(biases))), torch.cat(columns).T) + b2


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


def fsdp_with_names_imported_from_torch_distributed(unit, x, y, lr):
    full = torch.empty(unit.padded_numel)
    all_gather_into_tensor(full, unit.shard)
    loss = F.cross_entropy(unit.forward(full.requires_grad_(), x), y)
    loss.backward()
    grad = torch.empty_like(unit.shard)
    reduce_scatter_tensor(grad, full.grad)
    unit.shard.sub_(grad, alpha=lr / get_world_size())
    return loss.item()


def _step(unit, x, y, lr, full):
    """Forward, backward, reduce-scatter and SGD with the gathered ``full``; returns the loss tensor."""
    loss = F.cross_entropy(unit.forward(full, x), y)
    loss.backward()
    grad = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(grad, full.grad)
    with torch.no_grad():
        unit.shard.sub_(grad, alpha=lr / dist.get_world_size())
    return loss


def fsdp_keeping_a_detached_view(unit, x, y, lr):
    full = _gather(unit)
    _step(unit, x, y, lr, full)
    unit.saved = full.detach()  # another object, the same storage


KEPT_PARAMETER = {}


def fsdp_keeping_data_in_a_global(unit, x, y, lr):
    full = _gather(unit)
    _step(unit, x, y, lr, full)
    KEPT_PARAMETER["last"] = full.data


def _keeping_the_gradient_in_a_closure():
    last = []

    def fsdp_step(unit, x, y, lr):
        full = _gather(unit)
        _step(unit, x, y, lr, full)
        last[:] = [full.grad.detach()]

    return fsdp_step


fsdp_keeping_the_gradient_in_a_closure = _keeping_the_gradient_in_a_closure()


def fsdp_keeping_a_clone(unit, x, y, lr):
    full = _gather(unit)
    _step(unit, x, y, lr, full)
    unit.cache = {"full": full.detach().clone()}  # other storage, the same bytes


def fsdp_keeping_a_half_copy(unit, x, y, lr):
    full = _gather(unit)
    _step(unit, x, y, lr, full)
    unit.small = full.detach().half()  # half the bytes, every value


def fsdp_keeping_the_other_half_in_pieces(unit, x, y, lr):
    full = _gather(unit)
    _step(unit, x, y, lr, full)
    rest = full.detach()[unit.shard.numel():].clone()  # at n = 2: rank 1's part, in three small tensors
    unit.pieces = list(rest.chunk(3))
    unit.pieces = [p.clone() for p in unit.pieces]


def fsdp_keeping_the_loss(unit, x, y, lr):
    unit.loss = _step(unit, x, y, lr, _gather(unit))  # its graph holds the gathered parameter


def fsdp_keeping_it_in_torch(unit, x, y, lr):
    full = _gather(unit)
    _step(unit, x, y, lr, full)
    torch.distributed.last_full_parameter = full.detach()  # out of reach of the unit and fn's globals


def fsdp_without_padding(unit, x, y, lr):
    full = torch.empty(unit.numel)  # 113 elements: not n shards
    dist.all_gather_into_tensor(full, unit.shard)
    return _step(unit, x, y, lr, full.requires_grad_()).item()


def fsdp_all_reducing_through_a_renamed_name(unit, x, y, lr):
    full = _gather(unit)
    F.cross_entropy(unit.forward(full, x), y).backward()
    all_reduce(full.grad)
    size, rank = unit.shard.numel(), get_rank()
    unit.shard.sub_(full.grad[rank * size:(rank + 1) * size], alpha=lr / get_world_size())


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
    with pytest.raises(ValueError, match="unit.padded_numel = 116 elements \\(the 113 parameters padded to a "
                                         "multiple of the world size\\); got \\(113,\\)"):
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
    assert f"exercises.hint('{module.EXERCISE.name}') when stuck" in feedback


@pytest.mark.parametrize("module,fn", [
    (fsdp_unit, fsdp_freeing_storage_as_fsdp_does),
    (fsdp_unit, fsdp_with_names_imported_from_torch_distributed),
    (tp_mlp, tp_with_names_imported_from_torch_distributed),
], ids=["fsdp-frees-its-buffer", "fsdp-imported-names", "tp-imported-names"])
@launches_ranks
def test_other_correct_designs_pass(module, fn):
    result = check(module, fn)
    assert result.passed, result.feedback


# Each exercise's wrong solutions, and the words each one's feedback must contain (checked at world size 2).
WRONG = {
    tp_mlp: {
        tp_without_summing_x_grad: ["x.grad on rank 0 is only this rank's partial sum",
                                    "nothing in your backward summed them over the ranks"],
        tp_summing_the_hidden_activation: ["rank 0 all-reduced 640 bytes (this rank's hidden activation, 8 × 20 "
                                           "float32) in forward; expected one all_reduce of 192 bytes (the output's "
                                           "size, 8 × 6 float32)", "adds unrelated units together"],
        tp_summing_the_output_gradient_too: ["the gradients of x, w1, b1 and w2 are 2× the unsplit MLP's",
                                             "the output's gradient was summed over the ranks in backward",
                                             "counts it 2 times"],
        tp_adding_b2_on_every_rank: ["rank 0's output is the unsplit MLP's plus 1 × b2"],
        tp_averaging_the_output: ["rank 0's output (b2 aside) is 1/2 of the unsplit MLP's: it was divided by the "
                                  "world size in forward"],
        tp_averaging_x_grad: ["x.grad on rank 0 is 1/2 of the unsplit MLP's", "divided by the world size in "
                                                                              "backward"],
        tp_computing_whole_after_a_renamed_gather: [
            "World size 2: rank 0 held rank 1's rows of W1 at line",
            "of tp_computing_whole_after_a_renamed_gather (in tp_computing_whole_after_a_renamed_gather's local "
            "rows[…]", "each rank holds only its 1/n of W1 and W2"],
    },
    fsdp_unit: {
        fsdp_without_dividing: ["after step 0 the shards, put together, differ by",
                                "the gradient is 2× the global batch's", "divide by the world size"],
        fsdp_keeping_the_full_parameter: ["after step 0 rank 0 still holds the whole flat parameter (a tensor over "
                                          "the storage of full itself) (456 bytes) in unit.full",
                                          "the full parameter is kept between steps"],
        fsdp_gathering_into_a_kept_buffer: ["still holds a copy of the whole flat parameter (456 bytes) in "
                                            "unit.buffer", "the full parameter is kept between steps"],
        fsdp_keeping_a_detached_view: ["still holds the whole flat parameter (a tensor over the storage of full "
                                       "itself) (456 bytes) in unit.saved"],
        fsdp_keeping_data_in_a_global: ["still holds the whole flat parameter (a tensor over the storage of full "
                                        "itself) (456 bytes) in global KEPT_PARAMETER['last']"],
        fsdp_keeping_the_gradient_in_a_closure: ["still holds the whole flat gradient (a tensor over the storage of "
                                                 "full.grad itself) (456 bytes) in fsdp_step's closure variable "
                                                 "last[…]"],
        fsdp_keeping_a_clone: ["still holds a copy of the whole flat parameter (456 bytes) in unit.cache['full']"],
        fsdp_keeping_the_loss: ["(456 bytes) in unit.loss (through its autograd graph)"],
        fsdp_keeping_a_half_copy: ["still holds the values of rank 1's part of the whole flat parameter (a copy) (228 "
                                   "bytes) in unit.small"],
        fsdp_keeping_the_other_half_in_pieces: ["still holds the values of rank 1's part of the whole flat parameter "
                                                "(a copy)", "in unit.pieces[…]"],
        fsdp_keeping_it_in_torch: ["still holds the whole flat parameter (a tensor over the storage of full itself) "
                                   "(456 bytes) in a tensor alive outside the unit and what fn refers to"],
        fsdp_without_padding: ["World size 2: rank 0's all_gather_into_tensor failed in step 0: its output (the "
                               "whole parameter) has 113 elements where n × the shard's 57 = 114 fit",
                               "padded to a multiple of the world size: unit.padded_numel = 114 elements at n = 2"],
        fsdp_all_reducing_the_gradient: ["rank 0 all-reduced 456 bytes in step 0, the whole flat gradient",
                                         "Reduce-scatter it"],
        fsdp_all_reducing_through_a_renamed_name: ["rank 0 all-reduced 456 bytes in step 0, the whole flat "
                                                   "gradient"],
    },
}
CASES = [(module, fn) for module, fns in WRONG.items() for fn in fns]


@pytest.fixture(scope="module")
def verdicts():
    """Every wrong solution's feedback: one launch per exercise for all of its wrong solutions."""
    return {module: check_each(module.EXERCISE, {fn.__name__: fn for fn in fns}, 2) for module, fns in WRONG.items()}


@pytest.mark.parametrize("module,fn", CASES, ids=[f"{m.EXERCISE.name}-{fn.__name__}" for m, fn in CASES])
@launches_ranks
def test_a_wrong_solution_fails_naming_its_cause(module, fn, verdicts):
    feedback = verdicts[module][fn.__name__]
    assert feedback.startswith("World size 2: "), feedback
    for phrase in WRONG[module][fn]:
        assert phrase in feedback, feedback


@launches_ranks
def test_a_kept_parameter_fails_the_same_through_check():
    """The shared launch judges as check() does: one wrong solution through run_check."""
    feedback = check(fsdp_unit, fsdp_keeping_a_detached_view).feedback
    assert feedback.startswith("World size 2: after step 0 rank 0 still holds the whole flat parameter"), feedback
