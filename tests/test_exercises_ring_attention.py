"""Exercise ring_attention: the reference passes; wrong merges, collectives and extra rounds fail saying why.

Each wrong solution below is a mistake a learner makes; each test asserts on the
part of the feedback that names it. Most fail at world size 2, one launch each.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dtlab.exercises import ring_attention
from dtlab.exercises._check import run_check


def launches_ranks(test):
    """Starts rank processes: slow, and no process may outlive it."""
    return pytest.mark.slow(pytest.mark.usefixtures("no_survivors")(test))


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


# -- wrong solutions ---------------------------------------------------------------------------------------------
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
    assert "n=2: 768 in isend ×1, irecv ×1; n=4: 2,304 in isend ×3, irecv ×3" in result.feedback


@launches_ranks
def test_a_log_sum_exp_merge_passes_too():
    result = check(merged_by_log_sum_exp, world_sizes=(4,))
    assert result.passed, result.feedback


@launches_ranks
def test_the_stub_fails_saying_what_to_write():
    feedback = check(EX.stub).feedback
    assert feedback.startswith("World size 2: rank ") and "raised NotImplementedError" in feedback
    assert "write ring attention: attend to your own K/V block" in feedback


@launches_ranks
def test_all_gather_is_rejected_as_a_collective():
    feedback = check(gathered_with_all_gather).feedback
    assert feedback.startswith("World size 2: rank 0 called dist.all_gather with random blocks: collectives are "
                               "not allowed here.")
    assert "passes K/V blocks around the ring with point-to-point calls" in feedback
    assert "all_gather moves every block to every rank at once" in feedback


@launches_ranks
def test_a_merge_that_does_not_rescale_the_output_is_told_to():
    feedback = check(merged_without_rescaling_the_output).feedback
    assert feedback.startswith("World size 2: rank 0's output is wrong with random blocks: at [")
    assert "must be rescaled to the new running maximum, by exp(m_old - m_new)" in feedback


@launches_ranks
def test_a_merge_without_the_maximum_overflows_on_large_scores():
    feedback = check(merged_without_the_maximum).feedback
    assert "output is wrong with large scores (queries ×50)" in feedback and "it is nan" in feedback
    assert "works on random blocks but gives inf or NaN once scores are large" in feedback
    assert "Subtract each row's running maximum" in feedback


@launches_ranks
def test_blocks_normalised_apart_are_named():
    feedback = check(softmax_of_each_block_averaged).feedback
    assert "wrong with random blocks" in feedback and "each softmax normalised over its own block's keys" in feedback


@launches_ranks
def test_an_extra_round_is_counted_in_bytes():
    feedback = check(one_round_too_many).feedback
    assert feedback.startswith("World size 2: rank 0 sent 1,536 bytes with random blocks; ring attention passes its "
                               "K and V blocks (768 bytes together) once in each of the n - 1 = 1 rounds: 768 bytes.")
    assert "An n-th round only brings every block back to its owner" in feedback


@launches_ranks
def test_blocks_widened_to_float64_are_counted_in_bytes():
    feedback = check(passed_on_in_float64).feedback
    assert feedback.startswith("World size 2: rank 0 sent a message of 1,536 bytes with random blocks; a K or V "
                               "block is 384 bytes (float32), both stacked 768")


@launches_ranks
def test_everyone_sending_first_hangs_and_is_named():
    feedback = check(everyone_sends_first, world_sizes=(2,), timeout_s=2).feedback
    assert "timed out waiting in send to rank" in feedback and "with random blocks" in feedback
    assert "every send needs a matching receive" in feedback
