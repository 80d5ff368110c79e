"""Exercise ulysses_attention: the reference and other correct designs pass; gathering, point-to-point rings, a
missing mask, a wrong scale (a common one named, any other fitted), a softmax that overflows, heads or blocks put
back in the wrong places, a missing return trip or inverse all-to-all, extra bytes, uneven splits and keys and values
of every head relayed to the ranks that attend with them fail saying why.

Each wrong solution below is a mistake a learner makes; its row asserts on the part of the feedback that names it.
Every function (right or wrong) shares one launch per world size (``check_each``). Names imported from
torch.distributed at the top of this module are bound when a rank imports it, before that rank's recorder starts:
a check must see the calls made through them all the same.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_gather_into_tensor as collect_every_position
from torch.distributed import all_to_all_single, get_world_size

from dtlab import exercises
from dtlab.exercises import ulysses_attention
from dtlab.exercises._check import run_check
from tests.exercise_batch import check_each, launches_ranks

EX = ulysses_attention.EXERCISE


def to_heads(t, n):
    """[heads, block, d] -> [n, heads / n, block, d]: head group g first, for rank g."""
    h, b, d = t.shape
    return t.reshape(n, h // n, b, d)


def heads_out(q, k, v):
    """q, k, v stacked, head group g in dim 0 (for rank g), exchanged: [3, heads / n, n * block, d], rank order."""
    n = dist.get_world_size()
    h, t, d = q.shape
    got = exchange(torch.stack([q, k, v]).reshape(3, n, h // n, t, d).transpose(0, 1))
    return got.permute(1, 2, 0, 3, 4).reshape(3, h // n, n * t, d)


def exchange(send):
    send = send.contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send)
    return got


# -- correct designs other than the reference --------------------------------------------------------------------
def three_calls_through_names_imported_from_torch_distributed(q, k, v):
    """q, k and v in three all-to-alls and the output in a fourth, every call through a name bound before the
    recorder started; softmax written out with its own mask."""
    n = get_world_size()
    h, t, d = q.shape
    full = []
    for x in (q, k, v):
        got = torch.empty(n, h // n, t, d)
        all_to_all_single(got, to_heads(x, n).contiguous())
        full.append(got.transpose(0, 1).reshape(h // n, n * t, d))
    s = full[0] @ full[1].transpose(-2, -1) / math.sqrt(d)
    s = s.masked_fill(torch.ones(n * t, n * t, dtype=torch.bool).triu(1), -math.inf)
    y = torch.softmax(s, -1) @ full[2]
    back = torch.empty(n, h // n, t, d)
    all_to_all_single(back, y.reshape(h // n, n, t, d).transpose(0, 1).contiguous())
    return back.reshape(h, t, d)


def interleaved_heads_with_list_all_to_all(q, k, v):
    """Rank g looks after heads g, g + n, ... (not a contiguous group), through dist.all_to_all with lists."""
    n = dist.get_world_size()
    h, t, d = q.shape
    qkv = torch.stack([q, k, v])
    got = [torch.empty(3, h // n, t, d) for _ in range(n)]
    dist.all_to_all(got, [qkv[:, g::n].contiguous() for g in range(n)])
    full = torch.cat(got, 2)  # [3, h / n, n * t, d], rank order
    y = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)
    back = [torch.empty(h // n, t, d) for _ in range(n)]
    dist.all_to_all(back, list(y.split(t, 1)))
    out = torch.empty_like(q)
    for g in range(n):
        out[g::n] = back[g]
    return out


# -- wrong solutions ---------------------------------------------------------------------------------------------
def gathered_with_all_gather(q, k, v):
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    r = dist.get_rank()
    return _attend_block(q, torch.cat(ks, 1), torch.cat(vs, 1), r * q.shape[1])


def gathered_through_a_name_imported_before_the_recorder(q, k, v):
    """all_gather_into_tensor under another name, bound when this module was imported: seen all the same."""
    n, (h, t, d) = dist.get_world_size(), k.shape
    whole = []
    for x in (k, v):
        every = torch.empty(n * h, t, d)  # rank s's block in rows s * h ..
        collect_every_position(every, x)
        whole.append(every.reshape(n, h, t, d).transpose(0, 1).reshape(h, n * t, d))
    return _attend_block(q, *whole, dist.get_rank() * t)


def _attend_block(q, keys, values, first):
    """Causal attention of q (positions first.. first + block) to the whole sequence's keys."""
    s = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    pos = torch.arange(first, first + q.shape[1])
    s = s.masked_fill(torch.arange(keys.shape[1]) > pos[:, None], -math.inf)
    return torch.softmax(s, -1) @ values


def passed_around_a_ring(q, k, v):
    n, r = dist.get_world_size(), dist.get_rank()
    kv, blocks = torch.stack([k, v]), {}
    for step in range(n):
        blocks[(r - step) % n] = kv
        if step < n - 1:
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, (r + 1) % n), dist.P2POp(dist.irecv, incoming, (r - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            kv = incoming
    whole = torch.cat([blocks[s] for s in range(n)], 2)
    return _attend_block(q, whole[0], whole[1], r * q.shape[1])


def own_block_only(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def without_the_causal_mask(q, k, v):
    n = dist.get_world_size()
    h, t, d = q.shape
    full = heads_out(q, k, v)
    y = F.scaled_dot_product_attention(full[0], full[1], full[2])
    return exchange(y.reshape(h // n, n, t, d).transpose(0, 1)).reshape(h, t, d)


def scaled_by_one_over_head_dim(q, k, v):
    return ulysses_attention.ulysses_attention(q / math.sqrt(q.shape[-1]), k, v)


def heads_back_interleaved(q, k, v):
    """Contiguous head groups out, but the returning groups put back as if they were interleaved."""
    n = dist.get_world_size()
    h, t, d = q.shape
    full = heads_out(q, k, v)
    y = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)
    back = exchange(y.reshape(h // n, n, t, d).transpose(0, 1))  # [g, h / n, t, d]
    return back.transpose(0, 1).reshape(h, t, d)  # heads g, g + n, ... from group g: the wrong places


def blocks_in_reverse_order(q, k, v):
    """The arriving blocks concatenated last rank first: the causal mask then sees the positions out of order."""
    n = dist.get_world_size()
    h, t, d = q.shape
    got = exchange(torch.stack([q, k, v]).reshape(3, n, h // n, t, d).transpose(0, 1)).flip(0)
    full = got.permute(1, 2, 0, 3, 4).reshape(3, h // n, n * t, d)
    y = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)
    return exchange(y.reshape(h // n, n, t, d).transpose(0, 1).flip(0)).reshape(h, t, d)


def no_return_trip(q, k, v):
    full = heads_out(q, k, v)
    return F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)


def softmax_without_the_row_max(q, k, v):
    """exp(scores) straight: with the large scores, exp overflows float32 and the softmax gives NaN."""
    n, (h, t, d) = dist.get_world_size(), q.shape
    full = heads_out(q, k, v)
    s = full[0] @ full[1].transpose(-2, -1) / math.sqrt(d)
    e = torch.exp(s).masked_fill(torch.ones(n * t, n * t, dtype=torch.bool).triu(1), 0)
    y = e / e.sum(-1, keepdim=True) @ full[2]
    return exchange(y.reshape(h // n, n, t, d).transpose(0, 1)).reshape(h, t, d)


def scaled_by_the_model_width(q, k, v):
    """1/sqrt(heads x head_dim): the width of the whole model, not of a head."""
    n, (h, t, d) = dist.get_world_size(), q.shape
    full = heads_out(q, k, v)
    y = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True, scale=1 / math.sqrt(h * d))
    return exchange(y.reshape(h // n, n, t, d).transpose(0, 1)).reshape(h, t, d)


def scaled_with_a_temperature(q, k, v):
    """Scores times 0.7 on top of 1/sqrt(head_dim): no common mistake's scale, so it is fitted."""
    return ulysses_attention.ulysses_attention(q * 0.7, k, v)


def without_the_inverse_all_to_all(q, k, v):
    """This rank's heads over the whole sequence, reshaped to q's shape instead of sent back."""
    h, t, d = q.shape
    full = heads_out(q, k, v)
    return F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True).reshape(h, t, d)


def relayed_in_uneven_splits_padded_to_4x(q, k, v):
    """No head split: rank 1 gets rank 0's keys and values of every head in an uneven all-to-all whose inputs are
    padded (rows kept for the sender itself) to exactly 4 x q's bytes; each rank attends its own block."""
    r, (h, t, d) = dist.get_rank(), q.shape
    kv = torch.stack([k, v]).reshape(-1, d)
    rows, pad = kv.shape[0], torch.zeros_like(kv)
    if r == 0:
        send, sent, expect = torch.cat([pad, kv]), [rows, rows], [rows, 0]
    else:
        send, sent, expect = torch.cat([kv, pad]), [0, 2 * rows], [rows, 2 * rows]
    got = torch.empty(sum(expect), d)
    dist.all_to_all_single(got, send, expect, sent)
    before = got[:rows].reshape(2, h, t, d)[:, :, :0 if r == 0 else t]
    return _attend_block(q, torch.cat([before[0], k], 1), torch.cat([before[1], v], 1), r * t)


def keys_and_values_of_every_head_to_every_rank(q, k, v):
    """No head split, in even splits: each rank's keys and values of every head to every rank (at n = 2 exactly
    4 x q's bytes); each rank attends its own block with every head."""
    n, r, (h, t, d) = dist.get_world_size(), dist.get_rank(), q.shape
    got = torch.empty(n, 2, h, t, d)
    dist.all_to_all_single(got, torch.stack([k, v]).expand(n, 2, h, t, d).contiguous())
    keys, values = (got[:, i].transpose(0, 1).reshape(h, n * t, d) for i in (0, 1))
    return _attend_block(q, keys, values, r * t)


def exchanged_in_float64(q, k, v):
    return ulysses_attention.ulysses_attention(q.double(), k.double(), v.double()).float()


def every_head_to_every_rank(q, k, v):
    """Right output, but each rank sends all its heads to every rank (and takes them all back)."""
    n = dist.get_world_size()
    h, t, d = q.shape
    got = exchange(torch.stack([q, k, v]).expand(n, 3, h, t, d))  # [s, 3, h, t, d]: rank s's block, all heads
    whole = got.permute(1, 2, 0, 3, 4).reshape(3, h, n * t, d)
    y = F.scaled_dot_product_attention(whole[0], whole[1], whole[2], is_causal=True)
    r = dist.get_rank()
    return exchange(y.reshape(h, n, t, d).transpose(0, 1))[r]  # every rank computed every head: keep one copy


# -- no processes ------------------------------------------------------------------------------------------------
def test_description_says_what_is_checked_without_giving_the_exchange_away():
    text = EX.description
    assert text.startswith("Write fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor")
    assert "\n" not in text and "Checked at world sizes 2 and 4" in text and EX.world_sizes == (2, 4)
    for secret in ("reshape", "permute", "transpose", "stack", "is_causal", "scaled_dot_product"):
        assert secret not in text
    assert "all_to_all_single" in EX.hints[1] and "all_to_all" not in EX.hints[0]
    assert "all_to_all_single(got, send)" in EX.hints[2]
    assert "describe('ulysses_attention')" in EX.stub.__doc__


def test_a_world_size_the_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="ulysses_attention runs at world sizes 2, 4"):
        exercises.check("ulysses_attention", EX.solution, world_sizes=[3])


# -- on ranks ----------------------------------------------------------------------------------------------------
# Each function, the world size it is checked at, and the words its feedback must contain ("passed": no problem).
RIGHT = [EX.solution, three_calls_through_names_imported_from_torch_distributed,
         interleaved_heads_with_list_all_to_all]
WRONG = {
    gathered_with_all_gather: (2, ["World size 2: rank 0 called dist.all_gather with random blocks: only "
                                   "all-to-alls are allowed here", "n times the keys and values"]),
    gathered_through_a_name_imported_before_the_recorder: (2, ["rank 0 called dist.all_gather_into_tensor with "
                                                               "random blocks: only all-to-alls are allowed here"]),
    passed_around_a_ring: (2, ["rank 0 called dist.isend with random blocks", "as ring attention does"]),
    own_block_only: (2, ["rank 1's output is wrong with random blocks", "within this rank's own block only"]),
    without_the_causal_mask: (4, ["output is wrong with random blocks", "without the causal mask"]),
    scaled_by_one_over_head_dim: (2, ["The scores are scaled by 1/head_dim = 1/8, not 1/√head_dim = 1/√8"]),
    heads_back_interleaved: (2, ["Every head's attention is right but in the wrong place: head 1 of your output "
                                 "holds head 2's"]),
    blocks_in_reverse_order: (4, ["over the blocks put together in the order [3, 2, 1, 0], not in rank order"]),
    no_return_trip: (2, ["returned a tensor of shape (2, 8, 8) with random blocks, not (4, 4, 8)",
                         "the second all-to-all must bring every block's output back"]),
    exchanged_in_float64: (2, ["rank 0's all-to-alls carried 4,096 bytes with random blocks", "4 × q's 512 bytes = "
                               "2,048 bytes per rank", "Twice the bytes"]),
    every_head_to_every_rank: (4, ["rank 0's all-to-alls carried 8,192 bytes", "send each head group once"]),
    softmax_without_the_row_max: (2, ["output is wrong with large scores (queries ×50)", "NaN or infinite values, "
                                      "with scores this large", "Subtract each row's largest score before exp"]),
    scaled_by_the_model_width: (2, ["The scores are scaled by 1/√(heads × head_dim) = 1/√32 (the model's width, not "
                                    "a head's), not 1/√head_dim = 1/√8"]),
    scaled_with_a_temperature: (4, ["The scores are scaled by about 0.2475 (your output is right under that scale), "
                                    "not 1/√head_dim = 1/√8 ≈ 0.3536"]),
    without_the_inverse_all_to_all: (2, ["rank 0's output is wrong with random blocks", "It holds the attention of "
                                         "heads 0, 1 over the whole sequence", "The inverse all-to-all sends each "
                                         "block of those outputs to the rank whose block it is"]),
    relayed_in_uneven_splits_padded_to_4x: (2, ["rank 0's all_to_all_single with random blocks sent [32, 32] rows to "
                                                "ranks 0..1 and received [32, 0]: uneven",
                                                "Ulysses' exchanges are even"]),
    keys_and_values_of_every_head_to_every_rank: (2, ["rank 0 held other ranks' keys or values of 4 heads (0, 1, 2, "
                                                      "3) at once", "with random blocks. Ulysses gives each rank "
                                                      "heads / n = 2 whole heads",
                                                      "More means the heads were not split"]),
    EX.stub: (2, ["World size 2: rank 0 raised NotImplementedError", "write Ulysses attention",
                  "exercises.hint('ulysses_attention') when stuck"]),
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
    assert feedback != "passed"
    for phrase in phrases:
        assert phrase in feedback, feedback
    for phrase in ("torch.stack", "permute", "is_causal=True"):  # feedback names the mistake, not the algorithm
        assert phrase not in feedback


@launches_ranks
def test_the_reference_passes_through_check_at_2_and_4_ranks():
    result = run_check(EX, EX.solution, (2, 4), timeout_s=10)
    assert result.passed, result.feedback
    assert "at world sizes 2, 4" in result.feedback
    assert "n=2: 2,048 bytes in all_to_all_single ×2; n=4: 2,048 bytes in all_to_all_single ×2" in result.feedback
