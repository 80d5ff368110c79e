"""Exercise moe_dispatch: the reference passes; even splits, a missing combine or un-permute, gathered tokens, a
wrong expert-to-rank mapping and swapped split sizes fail naming their cause.

Names imported from torch.distributed at the top of this module are bound when a rank imports it, before that
rank's recorder starts: a check must see the calls made through them all the same. The wrong solutions that
return (or raise) on every rank share one launch (``check_each``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_gather as collect_every_token
from torch.distributed import all_to_all_single, get_rank, get_world_size

from dtlab import exercises
from dtlab.exercises import moe_dispatch
from dtlab.exercises._check import run_check
from dtlab.exercises._moe_check import CASES, EXPERTS, TOKENS, route_of, routing
from tests.exercise_batch import check_each, launches_ranks

EX = moe_dispatch.EXERCISE


def check(fn, world_sizes=(2, 4), timeout_s=10):
    return run_check(EX, fn, world_sizes, timeout_s=timeout_s)


def route(x, expert_of, experts, *, exchange=None, even=False, combine=True, unpermute=True, swap=False):
    """The reference's steps, each of which a wrong solution below leaves out or gets wrong."""
    exchange = exchange or dist.all_to_all_single
    n, m, rank = get_world_size(), experts.per_rank, get_rank()
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=experts.count)
    got = torch.empty_like(counts)
    exchange(got, counts)
    send, recv = counts.view(n, m).sum(1).tolist(), got.view(n, m).sum(1).tolist()
    if even:
        ids = torch.empty_like(expert_of)
        arrived = torch.empty_like(x)
        exchange(arrived, x[order])
        exchange(ids, expert_of[order])
        done = arrived.clone()
        for e in range(rank * m, (rank + 1) * m):
            done[ids == e] = experts(e, arrived[ids == e])
        back = torch.empty_like(x)
        exchange(back, done)
    else:
        arrived = x.new_empty(sum(recv), x.shape[1])
        exchange(arrived, x[order], *((send, recv) if swap else (recv, send)))
        done = torch.cat([experts(rank * m + i % m, rows) for i, rows in enumerate(arrived.split(got.tolist()))])
        if not combine:
            return done
        back = torch.empty_like(x)
        exchange(back, done, send, recv)
    if not unpermute:
        return back
    y = torch.empty_like(x)
    y[order] = back
    return y


# -- correct -------------------------------------------------------------------------------------------------------
def with_names_imported_from_torch_distributed(x, expert_of, experts):
    return route(x, expert_of, experts, exchange=all_to_all_single)


# -- wrong ---------------------------------------------------------------------------------------------------------
def even_splits(x, expert_of, experts):
    """No split sizes: all_to_all_single cuts every input into n equal parts; the expert ids travel the same way."""
    return route(x, expert_of, experts, even=True)


def without_the_combine(x, expert_of, experts):
    """Returns what its experts computed, on the experts' rank."""
    return route(x, expert_of, experts, combine=False)


def without_the_unpermute(x, expert_of, experts):
    """The outputs come back in the order they were sent: sorted by expert."""
    return route(x, expert_of, experts, unpermute=False)


def with_the_splits_swapped(x, expert_of, experts):
    return route(x, expert_of, experts, swap=True)


def experts_dealt_round_robin(x, expert_of, experts):
    """Takes expert e to live on rank e % n: sends its tokens there, and runs them there."""
    n, rank = get_world_size(), get_rank()
    home = expert_of % n
    order = torch.argsort(home * experts.count + expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=experts.count)
    got = torch.empty(n * experts.count, dtype=counts.dtype)
    dist.all_gather_into_tensor(got, counts)
    mine = [e for e in range(experts.count) if e % n == rank]
    send = torch.bincount(home, minlength=n).tolist()
    recv = [int(got.view(n, -1)[s, mine].sum()) for s in range(n)]
    arrived = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(arrived, x[order], recv, send)
    sizes = [int(got.view(n, -1)[s, e]) for s in range(n) for e in mine]
    done = torch.cat([experts(mine[i % len(mine)], rows) for i, rows in enumerate(arrived.split(sizes))])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    y = torch.empty_like(x)
    y[order] = back
    return y


def _gathered(x, expert_of, experts, gather):
    """Every rank gathers every token, runs its experts on those that chose them, and the outputs are summed."""
    n, rank, m = get_world_size(), get_rank(), experts.per_rank
    xs, ids = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(expert_of) for _ in range(n)]
    gather(xs, x)
    gather(ids, expert_of)
    every, chosen = torch.cat(xs), torch.cat(ids)
    out = torch.zeros_like(every)
    for e in range(rank * m, (rank + 1) * m):
        out[chosen == e] = experts(e, every[chosen == e])
    dist.all_reduce(out)
    return out[rank * x.shape[0]:(rank + 1) * x.shape[0]]


def gathered_every_token(x, expert_of, experts):
    return _gathered(x, expert_of, experts, dist.all_gather)


def gathered_through_a_name_imported_before_the_recorder(x, expert_of, experts):
    return _gathered(x, expert_of, experts, collect_every_token)


# -- no processes ----------------------------------------------------------------------------------------------------
def test_the_routing_is_uneven_and_every_rank_sends_and_receives_the_same_rows():
    for n in (2, 4):
        m = EXPERTS // n
        for rank in range(n):
            send, recv = route_of(rank, n, 0)
            assert sum(send) == TOKENS and send != [TOKENS // n] * n  # an even split is wrong for every rank
            assert recv == [route_of(s, n, 0)[0][rank] for s in range(n)]
            assert route_of(rank, n, 1) == ([TOKENS] + [0] * (n - 1), [TOKENS] * n if rank == 0 else [0] * n)
        chosen = torch.cat([routing(r, n, 0)[1] for r in range(n)])
        assert bool((chosen // m != chosen % n).any())  # the rank of e is not e % n: a wrong mapping shows


def test_moe_dispatch_is_registered_described_and_hinted():
    assert exercises.names()[-2:] == ("moe_dispatch", "layer_flops")  # layer_flops (notebook 19) comes after
    text = exercises.describe("moe_dispatch")
    assert text.startswith("Write fn(x: torch.Tensor, expert_of: torch.Tensor, experts) -> torch.Tensor")
    assert "Checked at world sizes 2 and 4" in text and "\n" not in text and EX.world_sizes == (2, 4)
    for secret in ("argsort", "bincount", "view(n, m)", "y[order]"):
        assert secret not in text
    assert "input_split_sizes" in EX.hints[1] and "y[order] = back" in EX.hints[2]
    assert "describe('moe_dispatch')" in EX.stub.__doc__ and CASES[0] in text


def test_an_expert_runs_only_on_its_own_rank():
    experts = moe_dispatch.Experts(rank=1, world_size=4)
    with pytest.raises(ValueError, match="this rank holds experts 2 to 3 .* expert 4 is on rank 2"):
        experts(4, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="rows must be a k × 4 tensor"):
        experts(2, torch.zeros(4))
    assert experts(3, torch.zeros(0, 4)).shape == (0, 4)


# -- on ranks ------------------------------------------------------------------------------------------------------
@launches_ranks
def test_the_reference_passes_at_2_and_4_ranks():
    result = check(EX.solution)
    assert result.passed, result.feedback
    assert "at world sizes 2, 4, with uneven routing and with every token choosing expert 0" in result.feedback
    assert ("Rank 0 at n=2 with uneven routing made all_to_all_single ×3: its dispatch sent [7, 5] rows and "
            "received [7, 7]; its combine sent [7, 7] rows and received [7, 5]") in result.feedback


@launches_ranks
def test_names_imported_from_torch_distributed_pass():
    result = check(with_names_imported_from_torch_distributed, world_sizes=(4,))
    assert result.passed, result.feedback


@launches_ranks
def test_the_stub_fails_saying_what_to_write():
    feedback = check(EX.stub).feedback
    assert feedback.startswith("World size 2: rank ") and "raised NotImplementedError" in feedback
    assert "send each token to the rank that holds its expert" in feedback
    assert "exercises.hint('moe_dispatch') when stuck" in feedback


WRONG = {
    even_splits: ["World size 2: rank 0's dispatch (the all_to_all_single carrying its tokens) with uneven routing "
                  "sent [6, 6] rows to ranks 0..1 and received [6, 6]; its tokens' experts need [7, 5] out",
                  "an even split", "pass the sizes"],
    without_the_combine: ["rank 0 made all_to_all_single ×2 with uneven routing, and only one, the tokens going out "
                          "carried rows of 4 values", "(the combine)"],
    without_the_unpermute: ["rank 0's outputs are right but in the wrong places with uneven routing",
                            "y[order] = back"],
    with_the_splits_swapped: ["rank 0's all_to_all_single with uneven routing failed (Split sizes doesn't match "
                              "total dim 0 size): its input has 12 rows split as [7, 7]",
                              "input_split_sizes and output_split_sizes are swapped"],
    experts_dealt_round_robin: ["World size 2: rank 0 raised ValueError (with uneven routing",
                                "experts(4, rows) on rank 0: this rank holds experts 0 to 3 (m = 4 per rank, expert e "
                                "on rank e // m); expert 4 is on rank 1, so its tokens must be sent there"],
    gathered_every_token: ["rank 0 called dist.all_gather with uneven routing", "It sends every token to every rank"],
    gathered_through_a_name_imported_before_the_recorder: ["rank 0 called dist.all_gather with uneven routing"],
}


@pytest.fixture(scope="module")
def verdicts():
    """Every wrong solution's feedback at world size 2, in one launch."""
    return check_each(EX, {fn.__name__: fn for fn in WRONG}, 2)


@pytest.mark.parametrize("fn", list(WRONG), ids=[fn.__name__ for fn in WRONG])
@launches_ranks
def test_a_wrong_solution_fails_naming_its_cause(fn, verdicts):
    feedback = verdicts[fn.__name__]
    for phrase in WRONG[fn]:
        assert phrase in feedback, feedback
