"""What a learner's code holds, found by storage and values (dtlab.exercises._reach), and the factor and torch-call
helpers of _check: small cases in this process, no ranks."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtlab.exercises._check import torch_call
from dtlab.exercises._reach import (
    Fingerprints,
    Found,
    HeldWatch,
    fold,
    held_values,
    places,
    reachable_tensors,
    storage_bytes,
    storage_key,
    tensors_made,
)
from dtlab.exercises._values import scale_factor, world_factor


class Unit:
    pass


def wheres(found):
    return {f.where for f in found}


def test_a_detached_view_data_and_views_share_the_storage_a_clone_does_not():
    full = torch.randn(10, requires_grad=True)
    for other in (full.detach(), full.data, full[2:5], full.view(2, 5)):
        assert storage_key(other) == storage_key(full) and storage_bytes(other) == 40
    copy = full.detach().clone()
    assert storage_key(copy) != storage_key(full) and storage_bytes(copy) == 40
    assert storage_bytes(full[:1]) == 40  # a one-element view keeps the whole storage alive


KEPT = {}
UNUSED = [torch.ones(50)]


def keeps_in_a_global(t):
    KEPT["last"] = t.data


def _closure():
    cache = []

    def keeps_in_a_closure(t):
        cache[:] = [t.detach()]

    return keeps_in_a_closure


def test_the_walk_finds_tensors_on_objects_in_globals_and_closures_by_the_paths_a_learner_wrote():
    full = torch.randn(6, requires_grad=True)
    unit = Unit()
    unit.saved = full.detach()
    unit.nested = {"a": [full.detach().clone()], "b": (None, full.grad)}
    keeps_in_a_global(full)
    keeps_closure = _closure()
    keeps_closure(full)
    found = reachable_tensors({"unit": unit, "fn": keeps_in_a_global, "other": keeps_closure})
    assert {"unit.saved", "unit.nested['a'][0]", "global KEPT['last']",
            "keeps_in_a_closure's closure variable cache[0]"} <= wheres(found)
    assert not any("UNUSED" in w for w in wheres(found))  # a global the function does not name is not its state
    assert all(isinstance(f, Found) and isinstance(f.tensor, torch.Tensor) for f in found)


def test_the_walk_follows_a_kept_loss_into_its_autograd_graph_and_a_functions_ctx():
    full = torch.randn(5, requires_grad=True)
    unit = Unit()
    unit.loss = (full * 2).sum()

    class Stash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.kept = t * 3
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    unit.out = Stash.apply(torch.randn(4, requires_grad=True))
    found = reachable_tensors({"unit": unit})
    through = [f.tensor for f in found if f.where.endswith("(through its autograd graph)")]
    assert any(t is full for t in through)  # the leaf the loss came from
    assert any(t.shape == (4,) and t is not unit.out for t in through)  # what the Function's ctx kept


def test_the_walk_finds_module_parameters_optimizer_state_numpy_views_and_generator_locals():
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    base = torch.randn(8)
    array = base.numpy()[2:4]  # a NumPy view of a tensor: the whole buffer stays alive

    def blocks():
        held = torch.randn(7)
        yield held

    gen = blocks()
    next(gen)
    found = reachable_tensors({"model": model, "opt": opt, "array": array, "gen": gen})
    places_found = wheres(found)
    assert "model._parameters['weight']" in places_found
    assert any("exp_avg" in w for w in places_found)
    assert any(storage_bytes(f.tensor) == 32 for f in found if f.where == "array")
    assert "blocks's local held" in places_found


def test_the_walk_skips_what_it_is_told_to_and_stops_at_its_limit():
    unit = Unit()
    unit.private = Unit()
    unit.private.t = torch.ones(3)
    assert reachable_tensors({"unit": unit}, skip=frozenset({id(unit.private)})) == []
    unit.many = [torch.ones(1) for _ in range(100)]
    assert len(reachable_tensors({"unit": unit}, limit=10)) < 10


def test_paths_fold_their_list_indices():
    assert fold("global KEPT[3]['a'][10]") == "global KEPT[…]['a'][…]"
    assert places(["kept[0]", "kept[1]", "x", "y", "z", "w"], most=3) == "kept[…], x, y and 2 more"


def test_fingerprints_find_a_tensor_in_any_dtype_and_layout_and_nothing_else():
    blocks = [torch.randn(2, 6, 8) for _ in range(4)]
    prints = Fingerprints(blocks)
    held = [blocks[0].transpose(-2, -1).contiguous(), blocks[1].double(), blocks[2].half(), torch.randn(500)]
    shares = prints.shares(held_values([Found(str(i), t) for i, t in enumerate(held)]))
    # rounded to float16 two random values may meet, one point in eight; a whole tensor's eight points do not
    assert list(shares[:3]) == [1.0, 1.0, 1.0] and shares[3] < 0.5
    kept_half = blocks[3].reshape(-1)[:48].clone()  # part of a block is part of it
    assert 0 < prints.shares(held_values([Found("half", kept_half)]))[3] < 1
    view = blocks[3][0, :1]  # a small view holds its whole storage, so all of the block
    assert prints.shares(held_values([Found("view", view)]))[3] == 1.0


KEEPER = types.SimpleNamespace()


def test_tensors_made_finds_a_tensor_kept_anywhere_since_the_block_began_and_only_those():
    before = torch.randn(30)
    with tensors_made() as made:
        KEEPER.kept = torch.randn(20)  # somewhere no walk from the learner's objects would look
        temporary = torch.randn(40)
        del temporary
        found = made(frozenset())
        assert any(t is KEEPER.kept for t in found)
        assert not any(t is before for t in found)
        assert not any(t is KEEPER.kept for t in made(frozenset({id(KEEPER.kept)})))
    del KEEPER.kept


def test_the_watch_sees_what_the_learner_holds_at_every_line_and_as_it_returns():
    counts, moments = [], []
    parts = [torch.randn(5) for _ in range(3)]

    def probe(found, moment):
        counts.append(sum(1 for f in found if f.where.startswith("learner's local kept")))
        moments.append(moment)

    def learner(blocks):
        kept = []
        for b in blocks:
            kept.append(b.clone())
        return torch.cat(kept).sum()

    previous = sys.gettrace()
    with HeldWatch(probe, learner):
        learner(parts)
    assert sys.gettrace() is previous
    assert max(counts) == 3 and moments[-1] == "as learner returned"
    assert any(m.startswith("at line ") and m.endswith(" of learner") for m in moments)


def test_inside_the_watch_a_new_buffer_shows_no_freed_values_and_the_mode_is_restored_after():
    freed = torch.randn(1000)
    del freed

    def learner():
        return torch.empty(1000)

    with HeldWatch(lambda found, moment: None, learner):
        fresh = learner()
    assert bool(fresh.isnan().all())  # not the values of the tensor freed just before
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_failing_probe_is_raised_when_the_watch_ends():
    def probe(found, moment):
        raise KeyError("broken")

    def learner():
        return 1

    with pytest.raises(RuntimeError, match="the held-tensor probe failed: KeyError"), HeldWatch(probe, learner):
        learner()


def test_a_result_off_by_the_world_size_is_named():
    ref = torch.randn(4, 3)
    assert world_factor(scale_factor(ref / 4, ref, 1e-6), 4) == "1/4 of"
    assert world_factor(scale_factor(2 * ref, ref, 1e-6), 2) == "2×"
    assert world_factor(scale_factor(ref + 0.1, ref, 1e-6), 2) is None
    assert scale_factor(ref, torch.zeros(4, 3), 1e-6) is None and scale_factor(ref, ref[:2], 1e-6) is None


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")
def test_torch_call_names_the_distributed_function_an_error_came_from_and_its_arguments():
    out, shard = torch.empty(113), torch.empty(57)
    with pytest.raises(Exception) as info:
        dist.all_gather_into_tensor(out, shard)  # no process group here: it raises inside torch's function
    op, args = torch_call(info.value)
    assert op == "all_gather_into_tensor" and args["output_tensor"] is out and args["input_tensor"] is shard
    assert torch_call(ValueError("not from torch")) is None
