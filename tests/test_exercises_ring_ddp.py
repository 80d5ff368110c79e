"""ring_allreduce, naive_ddp and bucketed_ddp: wrong solutions fail naming their cause; correct ones written with
names imported from torch.distributed pass.

Every function here calls torch.distributed through names imported at the top of this module, bound when a rank
imports it, before that rank's recorder starts: a check must see those calls all the same. Each wrong solution
is checked at one world size; those that return on every rank share one launch per exercise and world size
(``check_each``), and its row names the words its feedback must contain.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed import (
    P2POp,
    ReduceOp,
    all_reduce,
    batch_isend_irecv,
    broadcast,
    get_rank,
    get_world_size,
    irecv,
    isend,
    recv,
    send,
)

from dtlab.exercises import bucketed_ddp, naive_ddp, ring_allreduce
from tests.exercise_batch import assert_names_its_cause, check, launches_ranks, verdicts_by_size


# -- ring_allreduce ----------------------------------------------------------------------------------------------
def exchange(outgoing, dst, incoming, src):
    for work in batch_isend_irecv([P2POp(isend, outgoing, dst), P2POp(irecv, incoming, src)]):
        work.wait()


def ring(t, reduce_rounds=None, gather_rounds=None):
    """The reference's ring, with the number of rounds of each phase as parameters."""
    rank, n = get_rank(), get_world_size()
    chunks = t.tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1 if reduce_rounds is None else reduce_rounds(n)):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        exchange(chunks[(rank - s) % n], right, incoming, left)
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1 if gather_rounds is None else gather_rounds(n)):
        exchange(chunks[(rank + 1 - s) % n], right, chunks[(rank - s) % n], left)


def ring_prebound(t):
    ring(t)


def ring_one_all_reduce(t):
    all_reduce(t)


def ring_traffic_around_a_hidden_all_reduce(t):
    """Sends the right chunks to the right neighbours, but the sum comes from one all_reduce."""
    total = t.clone()
    all_reduce(total)
    ring(t.clone())
    t.copy_(total)


def ring_one_round_too_many(t):
    ring(t, reduce_rounds=lambda n: n)


def ring_one_gather_round_short(t):
    ring(t, gather_rounds=lambda n: n - 2)


def ring_to_the_left(t):
    """The mirror image of a ring: rank r sends to r - 1 and receives from r + 1 (right values, wrong direction)."""
    rank, n = get_rank(), get_world_size()
    chunks = t.tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank + s + 1) % n])
        exchange(chunks[(rank + s) % n], (rank - 1) % n, incoming, (rank + 1) % n)
        chunks[(rank + s + 1) % n].add_(incoming)
    for s in range(n - 1):
        exchange(chunks[(rank - 1 + s) % n], (rank - 1) % n, chunks[(rank + s) % n], (rank + 1) % n)


def ring_with_the_neighbours_swapped(t):
    """The ring's chunks, sent to r - 1 and received from r + 1: at world size 3 the chunks that meet differ in
    size where the length does not divide by 3, and gloo aborts the rank."""
    rank, n = get_rank(), get_world_size()
    chunks = t.tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        exchange(chunks[(rank - s) % n], (rank - 1) % n, incoming, (rank + 1) % n)
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        exchange(chunks[(rank + 1 - s) % n], (rank - 1) % n, chunks[(rank - s) % n], (rank + 1) % n)


def ring_returning_the_sum(t):
    out = t.clone()
    ring(out)
    return out


def ring_averaging(t):
    ring(t)
    t.div_(get_world_size())


def ring_sending_first(t):
    rank, n = get_rank(), get_world_size()
    send(t, (rank + 1) % n)  # gloo's send waits for its receiver, which is sending too
    recv(t, (rank - 1) % n)


# -- naive_ddp ---------------------------------------------------------------------------------------------------
def ddp_prebound(model):
    n = get_world_size()
    for p in model.parameters():
        all_reduce(p.grad)
        p.grad.div_(n)


def ddp_summing(model):
    for p in model.parameters():
        all_reduce(p.grad)


def ddp_dividing_twice(model):
    n = get_world_size()
    for p in model.parameters():
        p.grad.div_(n)
        all_reduce(p.grad)
        p.grad.div_(n)


def ddp_broadcasting_rank_0s_gradient(model):
    """Every rank ends with the same gradient, but it is rank 0's shard's, not the global batch's."""
    for p in model.parameters():
        broadcast(p.grad, src=0)


def ddp_taking_the_maximum(model):
    n = get_world_size()
    for p in model.parameters():
        all_reduce(p.grad, op=ReduceOp.MAX)
        p.grad.div_(n)


def ddp_skipping_the_biases(model):
    n = get_world_size()
    for p in model.parameters():
        if p.dim() > 1:
            all_reduce(p.grad)
            p.grad.div_(n)


def ddp_stepping_too(model):
    """Averages the gradients, then also updates the parameters: the checker's SGD steps a second time."""
    n = get_world_size()
    with torch.no_grad():
        for p in model.parameters():
            all_reduce(p.grad)
            p.grad.div_(n)
            p.sub_(0.1 * p.grad)


def ddp_only_rank_0_divides(model):
    for p in model.parameters():
        all_reduce(p.grad)
        if get_rank() == 0:
            p.grad.div_(get_world_size())


# -- bucketed_ddp ------------------------------------------------------------------------------------------------
def greedy_buckets(params, bucket_bytes):
    """Greedy buckets of ``params`` in the order given: a parameter that would overflow a bucket opens the next."""
    buckets, filled = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets and filled + nbytes <= bucket_bytes:
            buckets[-1].append(p)
            filled += nbytes
        else:
            buckets.append([p])
            filled = nbytes
    return buckets


def bucketed(model, buckets, send_when=None, async_op=True, divide=True, reset=True):
    """A hook per parameter counts the gradients in; a bucket is all-reduced once ``send_when(count, size)``."""
    send_when = send_when or (lambda count, size: count == size)
    where = {id(p): b for b, params in enumerate(buckets) for p in params}
    ready, pending = [0] * len(buckets), []

    def hook(p):
        b = where[id(p)]
        ready[b] += 1
        if send_when(ready[b], len(buckets[b])):
            flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in buckets[b]])
            pending.append((buckets[b], flat, all_reduce(flat, async_op=async_op)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for params, flat, work in pending:
            if work is not None:
                work.wait()
            if divide:
                flat.div_(get_world_size())
            for q, part in zip(params, flat.split([q.numel() for q in params])):
                q.grad.copy_(part.view_as(q.grad))
        pending.clear()
        if reset:
            ready[:] = [0] * len(buckets)

    return finish


def backward_order(model):
    return list(reversed(list(model.parameters())))


def bucketed_prebound(model, bucket_bytes):
    return bucketed(model, greedy_buckets(backward_order(model), bucket_bytes))


def bucketed_after_backward(model, bucket_bytes):
    """naive_ddp in finish(): one blocking all_reduce per parameter once backward has returned."""
    def finish():
        for p in model.parameters():
            all_reduce(p.grad)
            p.grad.div_(get_world_size())
    return finish


def bucketed_with_a_hidden_all_reduce(model, bucket_bytes):
    """The right buckets travel during backward, but the averages come from one all_reduce in finish()."""
    buckets = greedy_buckets(backward_order(model), bucket_bytes)
    where = {id(p): b for b, params in enumerate(buckets) for p in params}
    ready, works = [0] * len(buckets), []

    def hook(p):
        b = where[id(p)]
        ready[b] += 1
        if ready[b] == len(buckets[b]):
            works.append(all_reduce(torch.cat([q.grad.reshape(-1) for q in buckets[b]]), async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for work in works:
            work.wait()
        works.clear()
        ready[:] = [0] * len(buckets)
        params = list(model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat)
        for p, part in zip(params, flat.div_(get_world_size()).split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p))
    return finish


def bucketed_one_per_parameter(model, bucket_bytes):
    return bucketed(model, [[p] for p in backward_order(model)])


def bucketed_blocking(model, bucket_bytes):
    return bucketed(model, greedy_buckets(backward_order(model), bucket_bytes), async_op=False)


def bucketed_summing(model, bucket_bytes):
    return bucketed(model, greedy_buckets(backward_order(model), bucket_bytes), divide=False)


def bucketed_before_ready(model, bucket_bytes):
    """Sends a bucket when its first gradient is in: the others are still missing (zeros) or last step's."""
    buckets = greedy_buckets(backward_order(model), bucket_bytes)
    return bucketed(model, buckets, send_when=lambda count, size: count == 1)


def bucketed_not_reset(model, bucket_bytes):
    """Never resets the counts: from the second step on no bucket is ever complete."""
    return bucketed(model, greedy_buckets(backward_order(model), bucket_bytes), reset=False)


def bucketed_in_forward_order(model, bucket_bytes):
    """The right buckets, all sent at once from the last hook of backward, first layer's bucket first."""
    buckets = greedy_buckets(backward_order(model), bucket_bytes)
    params, seen, pending = list(model.parameters()), [0], []

    def hook(p):
        seen[0] += 1
        if seen[0] == len(params):
            for b in reversed(buckets):
                flat = torch.cat([q.grad.reshape(-1) for q in b])
                pending.append((b, flat, all_reduce(flat, async_op=True)))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for b, flat, work in pending:
            work.wait()
            for q, part in zip(b, flat.div_(get_world_size()).split([q.numel() for q in b])):
                q.grad.copy_(part.view_as(q.grad))
        pending.clear()
        seen[0] = 0
    return finish


def bucketed_closing_at_the_cap(model, bucket_bytes):
    """DDP's own rule: a bucket closes only once it has reached bucket_bytes, so it may overshoot."""
    buckets, filled = [[]], 0
    for p in backward_order(model):
        buckets[-1].append(p)
        filled += p.numel() * p.element_size()
        if filled >= bucket_bytes:
            buckets.append([])
            filled = 0
    return bucketed(model, [b for b in buckets if b])


def test_packing_by_the_exercise_rule_and_by_ddps_own():
    sizes = bucketed_ddp.ready_order_bytes()
    assert bucketed_ddp.pack(sizes, 2048) == [1504, 3072, 128, 2048]
    assert bucketed_ddp.pack(sizes, 2048, ddp_rule=True) == [4576, 2176]  # a bucket closes once it reaches its cap


# -- the correct solutions pass at every world size --------------------------------------------------------------
@launches_ranks
@pytest.mark.parametrize("module,fn", [(ring_allreduce, ring_prebound), (naive_ddp, ddp_prebound),
                                       (bucketed_ddp, bucketed_prebound)], ids=["ring", "naive_ddp", "bucketed_ddp"])
def test_a_solution_calling_names_imported_from_torch_distributed_passes(module, fn):
    result = check(module, fn, module.EXERCISE.world_sizes)
    assert result.passed, result.feedback


# -- the wrong ones fail, each saying why ------------------------------------------------------------------------
# Each wrong solution, the world size it is checked at, and the words its feedback must contain.
COLLECTIVE = "called dist.all_reduce with 12 elements: this exercise allows only point-to-point calls"
WRONG = {
    ring_allreduce: {
        ring_one_all_reduce: (2, ["World size 2: rank 0 " + COLLECTIVE]),
        ring_traffic_around_a_hidden_all_reduce: (2, ["World size 2: rank 0 " + COLLECTIVE]),
        ring_one_round_too_many: (3, ["rank 0 sent 80 bytes for a tensor of 12 elements", "made 5 sends where a ring "
                                      "makes 2(n - 1) = 4, one per round: one round too many"]),
        ring_one_gather_round_short: (3, ["rank 0 holds wrong values with 12 elements", "Chunks 0 and 1 of 3 hold the "
                                          "sum, chunk 2 does not", "made 3 sends where a ring makes 2(n - 1) = 4, "
                                          "one per round: one round missing"]),
        ring_to_the_left: (3, ["World size 3: rank 0 sent to rank 2 in round 1 with 12 elements; in a ring, rank r "
                               "sends only to r + 1 (here rank 1)."]),
        ring_with_the_neighbours_swapped: (3, ["World size 3: rank 0 sent to rank 2 in round 1 with 12 elements; in "
                                               "a ring, rank r sends only to r + 1 (here rank 1)."]),
        ring_returning_the_sum: (2, ["Your function returned the sum but left t as it was"]),
        ring_averaging: (2, ["t holds the sum divided by the world size (2), a mean"]),
    },
    naive_ddp: {
        ddp_summing: (2, ["the gradients after your function are 2× the global batch's: summed, not averaged"]),
        ddp_dividing_twice: (2, ["the gradients after your function are 1/2 of the global batch's: divided by the "
                                 "world size twice"]),
        ddp_broadcasting_rank_0s_gradient: (2, ["the gradients after your function are rank 0's own shard's "
                                                "gradient: one rank's gradient copied to the others"]),
        ddp_taking_the_maximum: (2, ["the elementwise maximum of the ranks' gradients, divided by the world size: "
                                     "reduce with a sum"]),
        ddp_skipping_the_biases: (2, ["ranks disagree after step 0", "the gradients of 1.bias (16 elements) and "
                                      "3.bias (4 elements) are this rank's own shard's gradient: not averaged"]),
        ddp_stepping_too: (2, ["although the gradients match: your function should change only the gradients"]),
        ddp_only_rank_0_divides: (3, ["ranks disagree after step 0: after your function rank 1's gradients are 3× the "
                                      "global batch's: summed, not averaged", "while rank 0's are right"]),
    },
    bucketed_ddp: {
        bucketed_after_backward: (2, ["your buckets are reduced after backward: nothing overlaps", "issued all 8 of "
                                      "its all_reduces after loss.backward() had returned"]),
        bucketed_with_a_hidden_all_reduce: (2, ["in step 0 rank 0 issued 1 of its 5 all_reduces (6,752 bytes) after "
                                                "loss.backward() had returned, in finish()"]),
        bucketed_one_per_parameter: (2, ["rank 0 all-reduced 8 buckets", "That is one all_reduce per parameter"]),
        bucketed_blocking: (2, ["rank 0's all_reduce of bucket 1 (1,504 bytes) in step 0 was blocking"]),
        bucketed_summing: (2, ["they are 2× the global batch's: summed, not averaged"]),
        bucketed_before_ready: (2, ["in step 0 rank 0 issued its 1st all_reduce (1,504 bytes) when backward had "
                                    "computed only 16 bytes of gradients", "before all of its gradients were ready"]),
        bucketed_not_reset: (2, ["in step 1 rank 0 issued no all_reduce (in step 0 it issued 4)", "finish() must "
                                 "reset"]),
        bucketed_in_forward_order: (2, ["rank 0 all-reduced 4 buckets (2,048, 128, 3,072 and 1,504 bytes)",
                                        "The right buckets in another order"]),
        bucketed_closing_at_the_cap: (2, ["rank 0 all-reduced 2 buckets (4,576 and 2,176 bytes)", "That is DDP's own "
                                          "rule, a bucket closing once it has reached its cap"]),
    },
}
CASES = [(module, fn) for module, fns in WRONG.items() for fn in fns]


@pytest.fixture(scope="module")
def verdicts():
    """Every wrong solution's feedback: one launch per exercise and world size for all of them."""
    return verdicts_by_size(WRONG)


@launches_ranks
@pytest.mark.parametrize("module,fn", CASES, ids=[f"{m.EXERCISE.name}-{fn.__name__}" for m, fn in CASES])
def test_a_wrong_solution_fails_naming_its_cause(module, fn, verdicts):
    assert_names_its_cause(WRONG, module, fn, verdicts)


@launches_ranks
def test_every_rank_sending_first_hangs_and_the_report_names_the_call_and_its_peer():
    feedback = check(ring_allreduce, ring_sending_first, timeout_s=2).feedback
    named = ("rank 0 timed out waiting in send to rank 1", "rank 1 timed out waiting in send to rank 0")  # either
    assert feedback.startswith(tuple(f"World size 2: {words} (its 1st call, with 12 elements; in ring_sending_first"
                                     for words in named)), feedback
    assert "after 2 s: every send needs a matching receive" in feedback
