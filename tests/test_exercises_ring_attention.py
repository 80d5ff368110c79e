"""Exercise ring_attention: the reference passes; wrong merges, scales, collectives, extra rounds and kept blocks fail
saying why.

Each wrong solution below is a mistake a learner makes; its row asserts on the part of the feedback that names
it. The wrong solutions that return on every rank share one launch per world size (``check_each``). Names
imported from torch.distributed at the top of this module are bound when a rank imports it, before that rank's
recorder starts: a check must see the calls made through them all the same.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed import P2POp, batch_isend_irecv, get_rank, get_world_size, irecv, isend
from torch.distributed import all_gather as gather_every_block

from dtlab.exercises import ring_attention
from dtlab.exercises._check import run_check
from tests.exercise_batch import check_each, launches_ranks

EX = ring_attention.EXERCISE


def check(fn, world_sizes=(2, 4), timeout_s=10):
    return run_check(EX, fn, world_sizes, timeout_s=timeout_s)


def scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def ring_blocks(k, v):
    """Yield the K/V blocks this rank sees, its own first, passing each on around the ring (n - 1 rounds)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    for step in range(n):
        yield kv[0], kv[1]
        if step < n - 1:
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            kv = incoming


# -- a correct design other than the reference -------------------------------------------------------------------
def merged_by_log_sum_exp(q, k, v):
    """Each block normalised on its own, then merged by their log-sum-exps (the cp tier's way)."""
    out = lse = None
    for kb, vb in ring_blocks(k, v):
        s = scores(q, kb)
        block_lse = torch.logsumexp(s, -1, keepdim=True)
        block_out = torch.exp(s - block_lse) @ vb
        if out is None:
            out, lse = block_out, block_lse
        else:
            new = torch.logaddexp(lse, block_lse)
            out, lse = torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new
    return out


def ring_with_names_imported_from_torch_distributed(q, k, v):
    """The reference's algorithm, every call through a name bound before the recorder started."""
    rank, n = get_rank(), get_world_size()
    kv = torch.stack([k, v])
    m, total, acc = torch.full((*q.shape[:-1], 1), -math.inf), torch.zeros(*q.shape[:-1], 1), torch.zeros_like(q)
    for step in range(n):
        incoming, works = kv, []
        if step < n - 1:
            incoming = torch.empty_like(kv)
            works = batch_isend_irecv([P2POp(isend, kv, (rank + 1) % n), P2POp(irecv, incoming, (rank - 1) % n)])
        s = scores(q, kv[0])
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
        total, acc, m = alpha * total + p.sum(-1, keepdim=True), alpha * acc + p @ kv[1], m_new
        for work in works:
            work.wait()
        kv = incoming
    return acc / total


def k_and_v_as_two_messages_with_buffers_written_late(q, k, v):
    """Correct; K and V travel as two messages, and buffers are allocated before they are written: the memory of a
    block let go comes back in them, which must not count as holding that block."""
    rank, n = get_rank(), get_world_size()
    m, total, acc = torch.full((*q.shape[:-1], 1), -math.inf), torch.zeros(*q.shape[:-1], 1), torch.zeros_like(q)
    kb, vb = k, v
    for step in range(n):
        works = []
        if step < n - 1:
            nk, nv = torch.empty_like(kb), torch.empty_like(vb)
            works = batch_isend_irecv([P2POp(isend, kb, (rank + 1) % n), P2POp(isend, vb, (rank + 1) % n),
                                       P2POp(irecv, nk, (rank - 1) % n), P2POp(irecv, nv, (rank - 1) % n)])
        s = scores(q, kb)
        unused = torch.empty_like(q)  # allocated, never written
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
        total, acc, m = alpha * total + p.sum(-1, keepdim=True), alpha * acc + p @ vb, m_new
        del unused
        for work in works:
            work.wait()
        if works:
            kb, vb = nk, nv
    out = torch.empty_like(q)
    return out.copy_(acc / total)


# -- wrong solutions ---------------------------------------------------------------------------------------------
def gathered_through_a_name_imported_before_the_recorder(q, k, v):
    """all_gather under another name, bound when this module was imported: the recorder must see it anyway."""
    n = get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    gather_every_block(ks, k)
    gather_every_block(vs, v)
    return torch.softmax(scores(q, torch.cat(ks, -2)), -1) @ torch.cat(vs, -2)


def kept_every_block_for_one_softmax(q, k, v):
    """A right ring and a right output, but every block kept until one plain softmax at the end."""
    blocks = [(kb.clone(), vb.clone()) for kb, vb in ring_blocks(k, v)]
    keys, values = torch.cat([b[0] for b in blocks], -2), torch.cat([b[1] for b in blocks], -2)
    return torch.softmax(scores(q, keys), -1) @ values


KEPT_BLOCKS = []


def kept_every_block_in_a_global(q, k, v):
    """The blocks go into a module-level list (as stacked K/V, detached): held all the same."""
    KEPT_BLOCKS.clear()
    for kb, vb in ring_blocks(k, v):
        KEPT_BLOCKS.append(torch.stack([kb, vb]).detach())
    kv = torch.cat(KEPT_BLOCKS, -2)
    return torch.softmax(scores(q, kv[0]), -1) @ kv[1]


def _kept_in_a_closure():
    seen = []

    def attend(q, k, v):
        seen.clear()
        keys = []
        for kb, vb in ring_blocks(k, v):
            keys.append(kb * 1.0)
            seen.append(vb.double())  # the values widened: still the same numbers
        return (torch.softmax(scores(q, torch.cat(keys, -2)), -1).double() @ torch.cat(seen, -2)).float()

    return attend


kept_values_in_a_closure = _kept_in_a_closure()


def scaled_by_one_over_head_dim(q, k, v):
    """The reference's merge with the scores divided by d, not sqrt(d)."""
    return merged_by_log_sum_exp(q / math.sqrt(q.shape[-1]), k, v)


def without_its_own_block(q, k, v):
    """Attends to the blocks that arrive, and forgets the one it started with."""
    out = lse = None
    for step, (kb, vb) in enumerate(ring_blocks(k, v)):
        if step == 0:
            continue
        s = scores(q, kb)
        block_lse = torch.logsumexp(s, -1, keepdim=True)
        block_out = torch.exp(s - block_lse) @ vb
        if out is None:
            out, lse = block_out, block_lse
        else:
            new = torch.logaddexp(lse, block_lse)
            out, lse = torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new
    return out


def gathered_with_all_gather(q, k, v):
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return torch.softmax(scores(q, torch.cat(ks, -2)), -1) @ torch.cat(vs, -2)


def merged_without_rescaling_the_output(q, k, v):
    """Tracks the running maximum and rescales the sum, but adds to the old output as it was."""
    m, total, acc = torch.full((*q.shape[:-1], 1), -math.inf), 0.0, torch.zeros_like(q)
    for kb, vb in ring_blocks(k, v):
        s = scores(q, kb)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        total = torch.exp(m - m_new) * total + p.sum(-1, keepdim=True)
        acc = acc + p @ vb
        m = m_new
    return acc / total


def merged_without_the_maximum(q, k, v):
    """Right in exact arithmetic; exp of a large score is inf in float32."""
    total, acc = 0.0, torch.zeros_like(q)
    for kb, vb in ring_blocks(k, v):
        p = torch.exp(scores(q, kb))
        total = total + p.sum(-1, keepdim=True)
        acc = acc + p @ vb
    return acc / total


def softmax_of_each_block_averaged(q, k, v):
    outs = [torch.softmax(scores(q, kb), -1) @ vb for kb, vb in ring_blocks(k, v)]
    return torch.stack(outs).mean(0)


def one_round_too_many(q, k, v):
    """The right output, but the blocks go all the way round: the last round brings each back to its owner."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv, blocks = torch.stack([k, v]), []
    for _ in range(n):
        blocks.append(kv)
        incoming = torch.empty_like(kv)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % n),
                                            dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]):
            work.wait()
        kv = incoming
    keys, values = torch.cat([b[0] for b in blocks], -2), torch.cat([b[1] for b in blocks], -2)
    return torch.softmax(scores(q, keys), -1) @ values


def passed_on_in_float64(q, k, v):
    """The right output, but each round's message is twice the bytes the blocks need."""
    out = merged_by_log_sum_exp(q.double(), k.double(), v.double())
    return out.float()


def everyone_sends_first(q, k, v):
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    dist.send(kv, (rank + 1) % n)  # gloo's send waits for its receiver, which is sending too
    dist.recv(kv, (rank - 1) % n)
    return q


# -- no processes ------------------------------------------------------------------------------------------------
def test_description_says_what_is_checked_without_giving_the_merge_away():
    text = EX.description
    assert text.startswith("Write fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor")
    assert "\n" not in text and "Checked at world sizes 2 and 4" in text and EX.world_sizes == (2, 4)
    for secret in ("running max", "maximum", "exp(", "rescal", "online", "log-sum-exp", "logsumexp"):
        assert secret not in text.lower()
    assert all(EX.hints) and "running maximum" not in EX.hints[0] and "P2POp" in EX.hints[1]
    assert "for step in range(n)" in EX.hints[2]
    assert "describe('ring_attention')" in EX.stub.__doc__


# -- on ranks ----------------------------------------------------------------------------------------------------
@launches_ranks
def test_the_reference_passes_at_2_and_4_ranks():
    result = check(EX.solution)
    assert result.passed, result.feedback
    assert "at world sizes 2, 4" in result.feedback
    assert "holding at most 3 ranks' K/V blocks at once (at n = 4)" in result.feedback
    assert "n=2: 768 in isend ×1, irecv ×1; n=4: 2,304 in isend ×3, irecv ×3" in result.feedback


@pytest.mark.parametrize("fn", [merged_by_log_sum_exp, ring_with_names_imported_from_torch_distributed,
                                k_and_v_as_two_messages_with_buffers_written_late],
                         ids=["log-sum-exp", "names-imported-from-torch-distributed", "two-messages-late-writes"])
@launches_ranks
def test_other_correct_designs_pass(fn):
    result = check(fn, world_sizes=(4,))
    assert result.passed, result.feedback
    assert "holding at most 3 ranks' K/V blocks at once (at n = 4)" in result.feedback


@launches_ranks
def test_the_stub_fails_saying_what_to_write():
    feedback = check(EX.stub).feedback
    assert feedback.startswith("World size 2: rank ") and "raised NotImplementedError" in feedback
    assert "write ring attention: attend to your own K/V block" in feedback
    assert "exercises.hint('ring_attention') when stuck" in feedback


# Each wrong solution, the world size it is checked at, and the words its feedback must contain.
WRONG = {
    gathered_with_all_gather: (2, ["World size 2: rank 0 called dist.all_gather with random blocks: collectives "
                                   "are not allowed here.", "passes K/V blocks around the ring with point-to-point "
                                   "calls", "all_gather moves every block to every rank at once"]),
    gathered_through_a_name_imported_before_the_recorder: (2, ["rank 0 called dist.all_gather with random blocks: "
                                                               "collectives are not allowed here."]),
    merged_without_rescaling_the_output: (2, ["World size 2: rank 0's output is wrong with random blocks: at [",
                                              "must be rescaled to the new running maximum, by exp(m_old - m_new)"]),
    merged_without_the_maximum: (2, ["output is wrong with large scores (queries ×50)", "it is nan",
                                     "works on random blocks but gives inf or NaN once scores are large",
                                     "Subtract each row's running maximum"]),
    softmax_of_each_block_averaged: (2, ["wrong with random blocks", "each softmax normalised over its own block's "
                                                                     "keys"]),
    scaled_by_one_over_head_dim: (2, ["rank 0's output is wrong with random blocks",
                                      "The scores are scaled by 1/head_dim = 1/8, not 1/√head_dim = 1/√8"]),
    without_its_own_block: (4, ["rank 0's output is wrong with random blocks",
                                "It is attention to every block but its own"]),
    one_round_too_many: (2, ["World size 2: rank 0 sent 1,536 bytes with random blocks; ring attention passes its "
                             "K and V blocks (768 bytes together) once in each of the n - 1 = 1 rounds: 768 bytes.",
                             "An n-th round only brings every block back to its owner"]),
    passed_on_in_float64: (2, ["World size 2: rank 0 sent a message of 1,536 bytes with random blocks; a K or V "
                               "block is 384 bytes (float32), both stacked 768"]),
    kept_every_block_for_one_softmax: (4, ["World size 4: rank 0 held all 4 ranks' K/V blocks at once with random "
                                           "blocks", "kept_every_block_for_one_softmax's local blocks[…]",
                                           "holds at most 3 blocks at a time"]),
    kept_every_block_in_a_global: (4, ["rank 0 held all 4 ranks' K/V blocks at once with random blocks",
                                       "global KEPT_BLOCKS[…]"]),
    kept_values_in_a_closure: (4, ["rank 0 held all 4 ranks' K/V blocks at once with random blocks",
                                   "attend's closure variable seen[…]"]),
}


@pytest.fixture(scope="module")
def verdicts():
    """Every wrong solution's feedback: one launch per world size for all of them."""
    out = {}
    for n in (2, 4):
        fns = {fn.__name__: fn for fn, (size, _) in WRONG.items() if size == n}
        out.update(check_each(EX, fns, n))
    return out


@pytest.mark.parametrize("fn", list(WRONG), ids=[fn.__name__ for fn in WRONG])
@launches_ranks
def test_a_wrong_solution_fails_naming_its_cause(fn, verdicts):
    feedback = verdicts[fn.__name__]
    for phrase in WRONG[fn][1]:
        assert phrase in feedback, feedback


@launches_ranks
def test_a_wrong_solution_fails_the_same_through_check():
    """The shared launch judges as check() does: one wrong solution through run_check, at 2 then 4 ranks."""
    feedback = check(kept_every_block_for_one_softmax).feedback
    assert feedback.startswith("World size 4: rank 0 held all 4 ranks' K/V blocks at once with random blocks")


@launches_ranks
def test_everyone_sending_first_hangs_and_is_named():
    feedback = check(everyone_sends_first, world_sizes=(2,), timeout_s=2).feedback
    assert "timed out waiting in send to rank" in feedback and "with random blocks" in feedback
    assert "every send needs a matching receive" in feedback
