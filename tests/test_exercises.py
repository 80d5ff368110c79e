"""Exercises: every reference passes its checker; wrong solutions and the stubs fail with feedback that says why.

The wrong solutions below are the mistakes a learner makes; each test asserts on
the part of the feedback that names the mistake. A wrong solution usually fails
at the first world size, so it costs one launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlab import exercises
from dtlab.exercises import CheckResult

launches_ranks = pytest.mark.usefixtures("no_survivors")  # (conftest marks these slow)


# -- correct designs other than the references -------------------------------------------------------------------
def ring_with_blocking_calls(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = t.tensor_split(n)

    def swap(outgoing, incoming):  # even ranks send first, odd ones receive first: no rank waits forever
        if rank % 2 == 0:
            dist.send(outgoing, (rank + 1) % n)
            dist.recv(incoming, (rank - 1) % n)
        else:
            dist.recv(incoming, (rank - 1) % n)
            dist.send(outgoing, (rank + 1) % n)

    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        swap(chunks[(rank - s) % n], incoming)
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        swap(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])


def ddp_with_one_flat_all_reduce(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.div_(dist.get_world_size()).split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def zero1_with_a_flat_shard(params, grads, state, lr):
    """Rank r owns elements [r * size, (r + 1) * size) of the flattened parameters; torch's Adam steps them."""
    rank, n = dist.get_rank(), dist.get_world_size()
    total = sum(p.numel() for p in params)
    size = -(-total // n)
    flat_g = torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(size * n - total)])
    if "shard" not in state:
        flat_p = torch.cat([p.reshape(-1) for p in params] + [torch.zeros(size * n - total)])
        state["shard"] = flat_p[rank * size:(rank + 1) * size].clone()
        state["adam"] = torch.optim.Adam([state["shard"]], lr=lr)
    state["shard"].grad = flat_g[rank * size:(rank + 1) * size]
    state["adam"].step()
    gathered = torch.empty(size * n)
    dist.all_gather_into_tensor(gathered, state["shard"])
    for p, part in zip(params, gathered[:total].split([p.numel() for p in params])):
        p.copy_(part.view_as(p))


# -- wrong solutions ---------------------------------------------------------------------------------------------
def ring_with_all_reduce(t):
    dist.all_reduce(t)


def ring_without_all_gather(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = t.tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        ops = [dist.P2POp(dist.isend, chunks[(rank - s) % n], (rank + 1) % n),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[(rank - s - 1) % n].add_(incoming)


def gather_to_rank_0(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def whole_tensor_around_the_ring(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    passing, incoming, total = t.clone(), torch.empty_like(t), t.clone()
    for _ in range(n - 1):
        ops = [dist.P2POp(dist.isend, passing, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        total += incoming
        passing.copy_(incoming)
    t.copy_(total)


def ring_that_sends_first(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.send(t, (rank + 1) % n)  # gloo's send waits for its receiver, which is sending too
    dist.recv(t, (rank - 1) % n)


def ddp_without_dividing(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def ddp_doing_nothing(model):
    pass


def adam_everywhere(params, grads, state, lr):
    if "adam" not in state:
        state["adam"] = torch.optim.Adam(params, lr=lr)
    for p, g in zip(params, grads):
        p.grad = g
    state["adam"].step()


def zero1_without_bias_correction(params, grads, state, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    for i in range(rank, len(params), n):
        m, v = state.setdefault(i, (torch.zeros_like(params[i]), torch.zeros_like(params[i])))
        m.mul_(0.9).add_(grads[i], alpha=0.1)
        v.mul_(0.999).addcmul_(grads[i], grads[i], value=0.001)
        params[i].sub_(lr * m / (v.sqrt() + 1e-8))
    for i, p in enumerate(params):
        dist.broadcast(p, src=i % n)


# -- the registry and the result (no processes) ------------------------------------------------------------------
def test_names_list_the_three_exercises_and_each_is_described():
    assert exercises.names() == ("ring_allreduce", "naive_ddp", "zero1_step")
    for name in exercises.names():
        text = exercises.describe(name)
        assert text.startswith("Write fn(") and "\n" not in text and "Checked at world sizes 2, 3 and 4" in text
        assert callable(exercises.solution(name)) and callable(exercises.stub(name))
    with pytest.raises(ValueError, match="ring_allreduce, naive_ddp, zero1_step"):
        exercises.describe("tree_allreduce")
    with pytest.raises(TypeError, match="needs your function"):
        exercises.check("naive_ddp", "not a function")
    with pytest.raises(ValueError, match="world_sizes"):
        exercises.check("naive_ddp", ddp_doing_nothing, world_sizes=(1,))


def test_check_result_reads_as_its_verdict_in_python_and_in_a_notebook():
    good, bad = CheckResult("x", True, "all fine"), CheckResult("x", False, "rank 1 <sent> too much")
    assert good and not bad
    assert repr(good) == "✓ x: all fine" and repr(bad) == "✗ x: rank 1 <sent> too much"
    assert "✗" in bad._repr_html_() and "&lt;sent&gt;" in bad._repr_html_() and "✓" in good._repr_html_()
    with pytest.raises(AttributeError):
        good.passed = False


# -- checks on ranks ---------------------------------------------------------------------------------------------
@launches_ranks
@pytest.mark.parametrize("name,verified", [
    ("ring_allreduce", "6,000/6,000/6,000/6,000 (1.50× the tensor; 2(n - 1)/n = 1.50) in isend ×6, irecv ×6"),
    ("naive_ddp", "the parameters matched one process on the whole batch"),
    ("zero1_step", "n=2: 2,440/2,016; n=3: 1,768/1,360/1,328"),  # of Adam's full 4,456 bytes
], ids=["ring_allreduce", "naive_ddp", "zero1_step"])
def test_the_reference_passes_at_every_world_size(name, verified):
    result = exercises.check(name, exercises.solution(name))
    assert result.passed, result.feedback
    assert "world sizes 2, 3, 4" in result.feedback and verified in result.feedback


@launches_ranks
@pytest.mark.parametrize("name,fn", [("ring_allreduce", ring_with_blocking_calls),
                                     ("naive_ddp", ddp_with_one_flat_all_reduce),
                                     ("zero1_step", zero1_with_a_flat_shard)])
def test_other_correct_designs_pass_too(name, fn):
    result = exercises.check(name, fn)
    assert result.passed, result.feedback


@launches_ranks
@pytest.mark.parametrize("name,says", [("ring_allreduce", "write the ring: split t into n chunks"),
                                       ("naive_ddp", "average the gradients over the ranks"),
                                       ("zero1_step", "write ZeRO-1: rank r owns the parameters i with i % n == r")],
                         ids=["ring_allreduce", "naive_ddp", "zero1_step"])
def test_the_stub_fails_saying_what_to_write(name, says):
    feedback = exercises.check(name, exercises.stub(name)).feedback
    assert feedback.startswith("World size 2: rank ") and "raised NotImplementedError" in feedback and says in feedback
    assert f"describe('{name}')" in exercises.stub(name).__doc__


@launches_ranks
def test_ring_rejects_a_collective():
    feedback = exercises.check("ring_allreduce", ring_with_all_reduce).feedback
    assert "rank 0 called dist.all_reduce with 7 elements" in feedback and "only point-to-point" in feedback


@launches_ranks
def test_ring_rejects_wrong_values_and_points_at_the_missing_all_gather():
    feedback = exercises.check("ring_allreduce", ring_without_all_gather).feedback
    assert feedback.startswith("World size 2: rank 0 holds wrong values with 7 elements: at index 0")
    assert "Only chunk 1 (elements 4 to 6) holds the sum" in feedback and "all-gather phase" in feedback


@launches_ranks
def test_ring_rejects_a_pattern_that_is_not_a_ring():
    feedback = exercises.check("ring_allreduce", gather_to_rank_0).feedback  # a ring at n=2; not at n=3
    assert feedback.startswith("World size 3: rank 0 received from rank 1 in round 1 with 7 elements")
    assert "rank r receives only from r - 1 (here rank 2)" in feedback


@launches_ranks
def test_ring_rejects_sending_more_than_a_ring_needs():
    feedback = exercises.check("ring_allreduce", whole_tensor_around_the_ring, world_sizes=(3,)).feedback
    assert "rank 0 sent 56 bytes for a tensor of 7 elements (28 bytes)" in feedback
    assert "2(n - 1)/n = 1.33 of the tensor" in feedback and "one chunk per round" in feedback


@launches_ranks
def test_a_deadlock_ends_after_the_timeout_naming_the_call_and_its_peer():
    feedback = exercises.check("ring_allreduce", ring_that_sends_first, world_sizes=(2,), timeout_s=2).feedback
    assert "timed out waiting in send to rank" in feedback and "with 7 elements" in feedback
    assert ") after 2 s: every send needs a matching receive" in feedback and "batch_isend_irecv" in feedback


@launches_ranks
def test_naive_ddp_rejects_a_sum_that_is_not_divided():
    feedback = exercises.check("naive_ddp", ddp_without_dividing).feedback
    assert feedback.startswith("World size 2: after step 0 the parameters differ by")
    assert "the gradients are 2× the global batch's" in feedback and "divide by the world size?" in feedback


@launches_ranks
def test_naive_ddp_rejects_doing_nothing():
    feedback = exercises.check("naive_ddp", ddp_doing_nothing).feedback
    assert feedback.startswith("World size 2: ranks disagree after step 0")
    assert "left every rank with its own shard's gradient" in feedback


@launches_ranks
def test_zero1_rejects_full_state_on_every_rank():
    feedback = exercises.check("zero1_step", adam_everywhere).feedback
    assert feedback.startswith("World size 2: rank 0 holds 4,") and "bytes of optimizer state" in feedback
    assert "Adam's full state (m and v for all 13 parameters) is 4,456 bytes" in feedback


@launches_ranks
def test_zero1_rejects_wrong_maths():
    feedback = exercises.check("zero1_step", zero1_without_bias_correction).feedback
    assert feedback.startswith("World size 2: after step 0, parameter 0 (6, 8) differs by")
    assert "from full Adam on one process" in feedback and "bias corrections" in feedback
