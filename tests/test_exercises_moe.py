"""Exercise moe_dispatch: the reference and the other designs the description allows pass (names imported from
torch.distributed, the counts as an [n, m] int64 tensor or all-gathered, each token sent with its expert's id as an
extra column); even splits, a missing combine or un-permute, gathered tokens or weights, a wrong expert-to-rank
mapping, swapped or guessed split sizes and outputs recomputed on the token's own rank fail naming their cause.

Names imported from torch.distributed at the top of this module are bound when a rank imports it, before that
rank's recorder starts: a check must see the calls made through them all the same. Every function, right or
wrong, returns (or raises) on every rank, so all of them share one launch per world size (``check_each``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_gather as collect_every_token
from torch.distributed import all_to_all_single, get_rank, get_world_size

from dtlab import exercises
from dtlab.exercises import moe_dispatch
from dtlab.exercises._agree import Sizes, SizesDisagree, _disagreement, _sizes
from dtlab.exercises._check import run_check
from dtlab.exercises._moe_check import CASES, EXPERTS, TOKENS, WIDTH, draw_weights, route_of, routing
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


def counts_as_an_n_by_m_int64_tensor(x, expert_of, experts):
    """The counts exchanged as an [n, m] tensor: row s for rank s. Its 64-bit integers weigh as much as a row of
    float32 tokens would, so only their dtype tells them from the tokens."""
    n, m, rank = get_world_size(), experts.per_rank, get_rank()
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=experts.count).view(n, m)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    send, recv = counts.sum(1).tolist(), got.sum(1).tolist()
    arrived = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(arrived, x[order], recv, send)
    parts = arrived.split(got.reshape(-1).tolist())
    done = torch.cat([experts(rank * m + i % m, rows) for i, rows in enumerate(parts)])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    y = torch.empty_like(x)
    y[order] = back
    return y


def expert_id_as_an_extra_column(x, expert_of, experts):
    """Each token travels with its expert's id in a last column: only the rows per rank are exchanged first."""
    n, m = get_world_size(), experts.per_rank
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of // m, minlength=n)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    send, recv = counts.tolist(), got.tolist()
    arrived = x.new_empty(sum(recv), x.shape[1] + 1)
    dist.all_to_all_single(arrived, torch.cat([x, expert_of[:, None].float()], 1)[order], recv, send)
    ids, done = arrived[:, -1].long(), torch.empty(arrived.shape[0], x.shape[1])
    for e in ids.unique().tolist():
        done[ids == e] = experts(e, arrived[ids == e, :-1])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    y = torch.empty_like(x)
    y[order] = back
    return y


def counts_all_gathered(x, expert_of, experts):
    """Every rank's counts gathered (integers): each rank reads its sizes out of the whole table."""
    n, m, rank = get_world_size(), experts.per_rank, get_rank()
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=experts.count)
    table = torch.empty(n * experts.count, dtype=counts.dtype)
    dist.all_gather_into_tensor(table, counts)
    table = table.view(n, n, m)  # [from rank, to rank, its j-th expert]
    send, recv = table[rank].sum(1).tolist(), table[:, rank].sum(1).tolist()
    arrived = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(arrived, x[order], recv, send)
    parts = arrived.split(table[:, rank].reshape(-1).tolist())
    done = torch.cat([experts(rank * m + i % m, rows) for i, rows in enumerate(parts)])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    y = torch.empty_like(x)
    y[order] = back
    return y


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


def _weights_guessed(experts):
    """Every expert's weights as a rank can get them without asking: its own from the experts it was handed, the
    others' drawn as a fixed seed once drew them."""
    gen = torch.Generator().manual_seed(4242)
    w, b = torch.randn(EXPERTS, WIDTH, WIDTH, generator=gen), torch.randn(EXPERTS, WIDTH, generator=gen)
    first, m = get_rank() * experts.per_rank, experts.per_rank
    w[first:first + m], b[first:first + m] = experts._weights
    return w, b


def recomputed_locally(x, expert_of, experts):
    """Dispatches and runs its experts as it should, combines zeros, and computes every output on the token's own
    rank with whatever weights it can reach."""
    n, m, rank = get_world_size(), experts.per_rank, get_rank()
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=experts.count)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    send, recv = counts.view(n, m).sum(1).tolist(), got.view(n, m).sum(1).tolist()
    arrived = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(arrived, x[order], recv, send)
    for i, rows in enumerate(arrived.split(got.tolist())):
        experts(rank * m + i % m, rows)
    back = torch.empty_like(x)
    dist.all_to_all_single(back, torch.zeros(sum(recv), x.shape[1]), send, recv)
    w, b = _weights_guessed(experts)
    return torch.einsum("tw,twv->tv", x, w[expert_of]) + b[expert_of]


def gathered_the_experts_weights(x, expert_of, experts):
    """Gathers every rank's expert weights (float32, no token among them) and computes every output at home."""
    n = get_world_size()
    w, b = experts._weights
    every = torch.cat([w.reshape(w.shape[0], -1), b], 1)
    table = torch.empty(n * every.shape[0], every.shape[1])
    dist.all_gather_into_tensor(table, every)
    w, b = table[:, :WIDTH * WIDTH].reshape(-1, WIDTH, WIDTH), table[:, WIDTH * WIDTH:]
    return torch.einsum("tw,twv->tv", x, w[expert_of]) + b[expert_of]


def guessed_receive_splits(x, expert_of, experts):
    """Sends the right rows, but guesses it receives as many from each rank as it sends there."""
    n, m = get_world_size(), experts.per_rank
    order = torch.argsort(expert_of, stable=True)
    send = torch.bincount(expert_of // m, minlength=n).tolist()
    arrived = x.new_empty(sum(send), x.shape[1])
    dist.all_to_all_single(arrived, x[order], send, send)
    return x


# -- no processes ----------------------------------------------------------------------------------------------------
def test_the_routing_is_uneven_and_every_rank_sends_and_receives_the_same_rows():
    for n in (2, 4):
        m = EXPERTS // n
        for rank in range(n):
            send, recv = route_of(rank, n, 0)
            assert sum(send) == TOKENS and send != [TOKENS // n] * n  # an even split is wrong for every rank
            assert recv != send  # a rank that guesses it receives what it sends is wrong
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
    assert "drawn anew for every check" in text and "carries integers only" in text


def test_an_expert_runs_only_on_its_own_rank_with_weights_drawn_for_each_check():
    weights = draw_weights(2)
    experts = moe_dispatch.Experts(rank=1, world_size=4, weights=weights)
    with pytest.raises(ValueError, match="this rank holds experts 2 to 3 .* expert 4 is on rank 2"):
        experts(4, torch.zeros(1, WIDTH))
    with pytest.raises(ValueError, match=f"rows must be a k × {WIDTH} tensor"):
        experts(2, torch.zeros(WIDTH))
    assert experts(3, torch.zeros(0, WIDTH)).shape == (0, WIDTH)
    rows = torch.randn(3, WIDTH)
    assert torch.equal(experts(3, rows), rows @ weights[0][1] + weights[1][1])  # expert 3 is this rank's second
    assert not torch.equal(draw_weights(2)[0], weights[0])  # another check, other weights


def test_sizes_that_disagree_are_named_by_the_first_pair_in_rank_order():
    out = torch.empty(10, WIDTH)
    mine = _sizes({"input": torch.empty(12, WIDTH), "output": out, "input_split_sizes": [5, 7],
                   "output_split_sizes": [5, 5]}, 2)
    assert mine == Sizes((5, 7), (5, 5), (4 * WIDTH, 4 * WIDTH))
    assert _sizes({"input": torch.empty(12, WIDTH), "output": out, "input_split_sizes": [5, 5],
                   "output_split_sizes": []}, 2) is None  # its own sizes do not add up: torch says so itself
    peer = Sizes((3, 3), (7, 3), (4 * WIDTH, 4 * WIDTH))
    assert _disagreement([mine, peer]) == (0, 1)  # rank 0 expects 5 from rank 1, which sends it 3
    assert ("in the 1st all_to_all_single, rank 0 expects 5 rows from rank 1 (its output_split_sizes [5, 5]), which "
            "sends it 3 (its input_split_sizes [3, 3])") == str(SizesDisagree(1, 0, 1, [mine, peer]))
    agreed = Sizes((5, 7), (5, 3), (4 * WIDTH, 4 * WIDTH))
    assert _disagreement([agreed, Sizes((3, 3), (7, 3), (4 * WIDTH, 4 * WIDTH))]) is None
    wider = Sizes((3, 3), (7, 3), (4 * WIDTH + 4, 4 * WIDTH))
    assert "expects rows of 24 bytes from rank 1, which sends rows of 28 bytes" in str(
        SizesDisagree(1, *_disagreement([agreed, wider]), [agreed, wider]))


# -- on ranks ------------------------------------------------------------------------------------------------------
@launches_ranks
def test_the_reference_passes_at_2_and_4_ranks():
    result = check(EX.solution)
    assert result.passed, result.feedback
    assert "at world sizes 2, 4, with uneven routing and with every token choosing expert 0" in result.feedback
    assert ("Rank 0 at n=2 with uneven routing made all_to_all_single ×3: its dispatch sent [5, 7] rows and "
            "received [5, 9]; its combine sent [5, 9] rows and received [5, 7]") in result.feedback
    assert "weights drawn for this check on its own rank alone" in result.feedback


# Each function, the world size it is checked at, and the words its feedback must contain.
RIGHT = [EX.solution, with_names_imported_from_torch_distributed, counts_as_an_n_by_m_int64_tensor,
         expert_id_as_an_extra_column, counts_all_gathered]
WRONG = {
    even_splits: (2, ["World size 2: rank 0's dispatch (the all_to_all_single carrying its tokens) with uneven "
                      "routing sent [6, 6] rows to ranks 0..1 and received [6, 6]; its tokens' experts need [5, 7] "
                      "out", "an even split", "pass the sizes"]),
    without_the_combine: (2, ["rank 0 made all_to_all_single ×2 with uneven routing, and only one, the tokens going "
                              "out, carried tokens", "(the combine)"]),
    without_the_unpermute: (2, ["rank 0's outputs are right but in the wrong places with uneven routing",
                                "y[order] = back"]),
    with_the_splits_swapped: (2, ["rank 0's all_to_all_single with uneven routing failed (Split sizes doesn't match "
                                  "total dim 0 size): its input has 12 rows split as [5, 9]",
                                  "input_split_sizes and output_split_sizes are swapped"]),
    experts_dealt_round_robin: (2, ["World size 2: rank 0 raised ValueError (with uneven routing",
                                    "experts(4, rows) on rank 0: this rank holds experts 0 to 3 (m = 4 per rank, "
                                    "expert e on rank e // m); expert 4 is on rank 1, so its tokens must be sent "
                                    "there"]),
    gathered_every_token: (2, ["rank 0 called dist.all_gather on float32 values with uneven routing",
                               "It sends every token to every rank"]),
    gathered_through_a_name_imported_before_the_recorder: (2, ["rank 0 called dist.all_gather on float32 values",
                                                                    "It sends every token to every rank"]),
    gathered_the_experts_weights: (4, ["rank 0 called dist.all_gather_into_tensor on float32 values with "
                                       "uneven routing", "another call may carry the counts (integers), never a "
                                       "token or anything else of floating point."]),
    recomputed_locally: (4, ["rank 0's outputs are right for the tokens whose experts it holds, but not for those "
                             "whose experts are on other ranks with uneven routing",
                             "drawn anew for every check: those outputs can only come back from there, in the "
                             "combine"]),
    guessed_receive_splits: (2, ["World size 2: In the 1st all_to_all_single, rank 0 expects 7 rows from rank 1 (its "
                                 "output_split_sizes [5, 7]), which sends it 9 (its input_split_sizes [9, 3]) with "
                                 "uneven routing", "A rank cannot guess what it will receive",
                                 "Every rank was stopped before that call"]),
    EX.stub: (2, ["World size 2: rank 0 raised NotImplementedError", "send each token to the rank that holds its "
                  "expert", "exercises.hint('moe_dispatch') when stuck"]),
}


@pytest.fixture(scope="module")
def verdicts():
    """Every function's feedback: one launch per world size for all of them."""
    out = {}
    for n in (2, 4):
        fns = {fn.__name__: fn for fn, (size, _) in WRONG.items() if size == n}
        fns.update({f"{fn.__name__} (right)": fn for fn in RIGHT})
        out[n] = check_each(EX, fns, n)
    return out


@pytest.mark.parametrize("fn", RIGHT, ids=[fn.__name__ for fn in RIGHT])
@pytest.mark.parametrize("n", [2, 4])
@launches_ranks
def test_correct_designs_pass(fn, n, verdicts):
    assert verdicts[n][f"{fn.__name__} (right)"] == "passed"


@pytest.mark.parametrize("fn", list(WRONG), ids=[fn.__name__ for fn in WRONG])
@launches_ranks
def test_a_wrong_solution_fails_naming_its_cause(fn, verdicts):
    n, phrases = WRONG[fn]
    feedback = verdicts[n][fn.__name__]
    for phrase in phrases:
        assert phrase in feedback, feedback
    if fn is not gathered_every_token and fn is not gathered_through_a_name_imported_before_the_recorder:
        assert "every token to every rank" not in feedback, feedback  # said only where the tokens went everywhere


@launches_ranks
def test_guessed_splits_fail_the_same_through_check_and_no_rank_dies():
    result = check(guessed_receive_splits, world_sizes=(4,))
    assert not result.passed and "A rank cannot guess what it will receive" in result.feedback, result.feedback
    assert "SIGABRT" not in result.feedback and "died" not in result.feedback
