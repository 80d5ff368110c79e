"""Exercises: every reference passes its checker; wrong solutions and the stubs fail with feedback that says why.

The wrong solutions below are the mistakes a learner makes; each test asserts on
the part of the feedback that names the mistake. A wrong solution usually fails
at the first world size, so it costs one launch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from IPython.lib.pretty import pretty

from dtlab import exercises
from dtlab.exercises import CheckResult, _progress, gpipe_schedule

launches_ranks = pytest.mark.usefixtures("no_survivors")  # (conftest marks these slow)
runs_torchrun = pytest.mark.usefixtures("nothing_left")
FUNCTIONS = ("ring_allreduce", "naive_ddp", "bucketed_ddp", "zero1_step", "gpipe_schedule")
# Per exercise, phrases of its hints that would give the algorithm away: describe() must not contain any of them.
# A new exercise gets its own entry (the test below fails until it has one).
GIVEAWAYS = {
    "ring_allreduce": ("reduce-scatter", "all-gather", "tensor_split", "(r - s) % n", "n - 1 rounds"),
    "naive_ddp": ("all_reduce", "get_world_size", "mean of the ranks'"),
    "bucketed_ddp": ("register_post_accumulate_grad_hook", "hook", "torch.cat", "wait()", "reversed("),
    "zero1_step": ("i % n", "owns", "src=", "round-robin"),
    "gpipe_schedule": ("requires_grad_", "/ M", "detach()", "empty_like", "last micro-batch first"),
    "ddp_script": ("init_process_group", "DistributedSampler", "set_epoch", "model.module", "destroy_process_group"),
    "fsdp_unit": ("full.requires_grad_()", "/ world_size", "the ranks' mean", "resize_(0)"),
    "tp_mlp": ("SumForward", "SumBackward", "A sum in forward needs none in backward", "clone"),
    "ring_attention": ("largest score seen so far", "rescale", "torch.exp", "amax", "acc / l"),
    "ulysses_attention": ("torch.stack", "permute", "transpose", "is_causal=True", "put the destination first"),
    "moe_dispatch": ("argsort", "bincount", "view(n, m)", "y[order] = back"),
    "layer_flops": ("2 m n k", "4 * tokens * seq * hidden", "(T, hidden + 2 kv, hidden)", "m k + k n + m n"),
}
IN_PROCESS = ("layer_flops",)  # judged in the notebook's process: no world sizes


@pytest.fixture(autouse=True)
def progress_log(tmp_path, monkeypatch):
    """Checks record their verdicts in a temporary file, not in the working directory's results/."""
    monkeypatch.setattr(_progress, "PROGRESS_LOG", tmp_path / "progress.jsonl")


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
    state["shard"].grad = None  # a view of the whole flat gradient: kept, it would weigh as much as all of it
    gathered = torch.empty(size * n)
    dist.all_gather_into_tensor(gathered, state["shard"])
    for p, part in zip(params, gathered[:total].split([p.numel() for p in params])):
        p.copy_(part.view_as(p))


def buckets_of(model, bucket_bytes):
    """Greedy buckets of parameters, last parameter first (as the reference packs them)."""
    buckets, filled = [], 0
    for p in reversed(list(model.parameters())):
        nbytes = p.numel() * p.element_size()
        if buckets and filled + nbytes <= bucket_bytes:
            buckets[-1].append(p)
            filled += nbytes
        else:
            buckets.append([p])
            filled = nbytes
    return buckets


def ddp_with_preallocated_buckets(model, bucket_bytes):
    """Each bucket a flat buffer made once; a hook copies its gradient in and sends the buffer when it is full."""
    buckets = buckets_of(model, bucket_bytes)
    flats = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    slot = {id(p): (b, flats[b][o - p.numel():o]) for b, params in enumerate(buckets)
            for p, o in zip(params, torch.tensor([p.numel() for p in params]).cumsum(0).tolist())}
    missing, works = [len(b) for b in buckets], []

    def hook(p):
        b, view = slot[id(p)]
        view.copy_(p.grad.reshape(-1))
        missing[b] -= 1
        if missing[b] == 0:
            works.append(dist.all_reduce(flats[b], async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for work in works:
            work.wait()
        for p in model.parameters():
            p.grad.copy_(slot[id(p)][1].view_as(p) / dist.get_world_size())
        works.clear()
        missing[:] = [len(b) for b in buckets]

    return finish


def gpipe_with_async_transfers(stage, micro_batches, targets, loss_fn):
    """isend/irecv throughout: receives waited on before use, sends waited on at the end."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sends, outputs, m_count = [], [], len(micro_batches)
    for m, x in enumerate(micro_batches):
        if rank > 0:
            dist.irecv(x, rank - 1).wait()
            x.requires_grad_()
        y = stage(x)
        if rank == n - 1:
            y = loss_fn(y, targets[m]) / m_count
        else:
            sends.append(dist.isend(y.detach(), rank + 1))
        outputs.append(y)
    for m in reversed(range(m_count)):
        if rank == n - 1:
            outputs[m].backward()
        else:
            grad = torch.empty_like(outputs[m])
            dist.irecv(grad, rank + 1).wait()
            outputs[m].backward(grad)
        if rank > 0:
            sends.append(dist.isend(micro_batches[m].grad, rank - 1))
    for work in sends:
        work.wait()
    return sum(outputs).detach() if rank == n - 1 else None


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


def ddp_reducing_after_backward(model, bucket_bytes):
    """The right buckets, all-reduced asynchronously, but only once backward has returned."""
    buckets = buckets_of(model, bucket_bytes)

    def finish():
        flats = [torch.cat([p.grad.reshape(-1) for p in b]) for b in buckets]
        works = [dist.all_reduce(flat, async_op=True) for flat in flats]
        for b, flat, work in zip(buckets, flats, works):
            work.wait()
            for p, part in zip(b, flat.div_(dist.get_world_size()).split([p.numel() for p in b])):
                p.grad.copy_(part.view_as(p))

    return finish


def ddp_in_one_bucket(model, bucket_bytes):
    """Overlaps nothing either: the one bucket is sent from the hook of the last gradient."""
    params = list(model.parameters())
    state = {"ready": 0}

    def hook(p):
        state["ready"] += 1
        if state["ready"] == len(params):
            state["flat"] = torch.cat([q.grad.reshape(-1) for q in params])
            state["work"] = dist.all_reduce(state["flat"], async_op=True)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        state["work"].wait()
        for q, part in zip(params, state["flat"].div_(dist.get_world_size()).split([q.numel() for q in params])):
            q.grad.copy_(part.view_as(q))
        state["ready"] = 0

    return finish


def gpipe_one_micro_batch_at_a_time(stage, micro_batches, targets, loss_fn):
    """Forward and backward of each micro-batch before the next one starts: right gradients, wrong schedule."""
    rank, n = dist.get_rank(), dist.get_world_size()
    total = 0.0
    for m, x in enumerate(micro_batches):
        if rank > 0:
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank == n - 1:
            y = loss_fn(y, targets[m]) / len(micro_batches)
            y.backward()
            total = total + y.detach()
        else:
            dist.send(y.detach(), rank + 1)
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 1)
            y.backward(grad)
        if rank > 0:
            dist.send(x.grad, rank - 1)
    return total if rank == n - 1 else None


def gpipe_with_a_broadcast(stage, micro_batches, targets, loss_fn):
    dist.broadcast(micro_batches[0], src=0)  # "every rank gets the input": not how a pipeline moves data
    return gpipe_schedule.gpipe_schedule(stage, micro_batches, targets, loss_fn)


def gpipe_without_scaling(stage, micro_batches, targets, loss_fn):
    """Each micro-batch's loss is its mean, not divided by M: the gradients are M times too big."""
    m_count = len(micro_batches)
    return gpipe_schedule.gpipe_schedule(stage, micro_batches, targets, lambda out, t: loss_fn(out, t) * m_count)


# -- the registry and the result (no processes) ------------------------------------------------------------------
def test_names_list_the_exercises_in_course_order_and_each_is_described():
    assert exercises.names() == ("ring_allreduce", "naive_ddp", "bucketed_ddp", "zero1_step", "fsdp_unit",
                                 "ddp_script", "gpipe_schedule", "tp_mlp", "ring_attention",
                                 "ulysses_attention", "moe_dispatch", "layer_flops")
    for name in exercises.names():
        text = exercises.describe(name)
        checked = "Checked in this process" if name in IN_PROCESS else "Checked at world size"
        assert "\n" not in text and checked in text
        if name in FUNCTIONS:
            assert text.startswith("Write fn(")
            assert callable(exercises.solution(name)) and callable(exercises.stub(name))
    assert "Checked at world sizes 2, 3 and 4" in exercises.describe("ring_allreduce")
    assert "Checked at world sizes 2 and 3" in exercises.describe("gpipe_schedule")
    with pytest.raises(ValueError, match="ring_allreduce, naive_ddp, bucketed_ddp, zero1_step, fsdp_unit, ddp_script"):
        exercises.describe("tree_allreduce")
    with pytest.raises(TypeError, match="needs your function"):
        exercises.check("naive_ddp", "not a function")
    with pytest.raises(ValueError, match="world_sizes"):
        exercises.check("naive_ddp", ddp_doing_nothing, world_sizes=(1,))
    with pytest.raises(ValueError, match="gpipe_schedule runs at world sizes 2, 3, 4"):
        exercises.check("gpipe_schedule", gpipe_schedule.gpipe_schedule, world_sizes=(5,))


def test_ddp_script_takes_the_path_of_a_script_and_its_stub_and_solution_are_scripts(tmp_path):
    text = exercises.describe("ddp_script")
    assert text.startswith("Write a torchrun script") and "--out DIR --epochs 2" in text
    assert "indices_rank{rank}_epoch{epoch}.json" in text and "each epoch's order differs" in text
    for path in (exercises.solution("ddp_script"), exercises.stub("ddp_script")):
        assert isinstance(path, str) and path.endswith(".py") and os.path.isfile(path)
    assert "set_epoch" in Path(exercises.solution("ddp_script")).read_text()
    with pytest.raises(TypeError, match="needs the path of your script file"):
        exercises.check("ddp_script", ddp_doing_nothing)
    with pytest.raises(FileNotFoundError, match="there is no file at .*missing.py"):
        exercises.check("ddp_script", tmp_path / "missing.py")


def hint_text(name, level):
    """The hint itself: hint() adds a heading line and a last line saying what comes next."""
    return "\n".join(exercises.hint(name, level).splitlines()[1:-1])


def test_every_exercise_has_three_hints_each_giving_more_away():
    assert set(GIVEAWAYS) == set(exercises.names())
    for name in exercises.names():
        texts = [hint_text(name, level) for level in (1, 2, 3)]
        assert all(t.strip() for t in texts) and len(set(texts)) == 3, name
        assert len(texts[2]) > len(texts[0]), name
        assert exercises.hint(name).startswith(f"Hint 1 of 3 for {name} (the idea):")
        assert exercises.hint(name, 1).endswith(f"exercises.hint({name!r}, 2) gives the calls to use.")
        assert exercises.hint(name, 2).endswith(f"exercises.hint({name!r}, 3) gives pseudo-code.")
        assert f"exercises.solution({name!r})" in exercises.hint(name, 3).splitlines()[-1]
        assert pretty(exercises.hint(name, 3)) == exercises.hint(name, 3)  # a notebook shows the lines, unquoted


def test_describe_gives_the_task_and_the_hints_give_the_algorithm():
    for name, phrases in GIVEAWAYS.items():
        text, hints = exercises.describe(name), "\n".join(hint_text(name, level) for level in (1, 2, 3))
        assert f"exercises.hint({name!r})" in text
        for phrase in phrases:
            assert phrase in hints, f"{name}: {phrase!r} is not in its hints"
            assert phrase not in text, f"describe({name!r}) gives {phrase!r} away"
    naive = exercises.describe("naive_ddp")
    assert "all_reduce" not in naive and "get_world_size" not in naive
    assert "(r + 1) % n" in exercises.describe("ring_allreduce")  # a rule of the ring, not a step of it


@pytest.mark.parametrize("level", [0, 4, -1, True, False, 2.0, "2", None])
def test_a_hint_level_other_than_1_2_or_3_is_refused(level):
    with pytest.raises(ValueError, match=r"level=.* level is 1 \(the idea\), 2 .* or 3"):
        exercises.hint("naive_ddp", level)


def test_a_hint_for_an_unknown_exercise_names_the_exercises():
    with pytest.raises(ValueError, match="no exercise named 'tree_allreduce': choose one of ring_allreduce"):
        exercises.hint("tree_allreduce")


def test_check_result_reads_as_its_verdict_in_python_and_in_a_notebook():
    good, bad = CheckResult("x", True, "all fine"), CheckResult("x", False, "rank 1 <sent> too much")
    assert good and not bad
    assert repr(good) == "✓ x: all fine" and repr(bad) == "✗ x: rank 1 <sent> too much"
    assert "✗" in bad._repr_html_() and "&lt;sent&gt;" in bad._repr_html_() and "✓" in good._repr_html_()
    with pytest.raises(AttributeError):
        good.passed = False


# -- checks on ranks ---------------------------------------------------------------------------------------------
@launches_ranks
@pytest.mark.parametrize("name,sizes,verified", [
    ("ring_allreduce", "2, 3, 4",
     "6,000/6,000/6,000/6,000 (1.50× the tensor; 2(n - 1)/n = 1.50) in isend ×6, irecv ×6"),
    ("naive_ddp", "2, 3, 4", "the parameters matched one process on the whole batch"),
    ("bucketed_ddp", "2, 3", "n=2 (bucket_bytes=2,048): 4 buckets (1,504, 3,072, 128 and 2,048 bytes); n=3 "
     "(bucket_bytes=1,024): 6 buckets (256, 1,152, 96, 3,072, 128 and 2,048 bytes)"),
    ("zero1_step", "2, 3, 4", "n=2: 2,448/2,024; n=3: 1,776/1,368/1,336"),  # of Adam's full 4,456 bytes
    ("gpipe_schedule", "2, 3", "n=2 with M=4: rank 0: send ×4, recv ×4; rank 1: recv ×4, send ×4"),
], ids=FUNCTIONS)
def test_the_reference_passes_at_every_world_size(name, sizes, verified):
    result = exercises.check(name, exercises.solution(name))
    assert result.passed, result.feedback
    assert f"world sizes {sizes}" in result.feedback and verified in result.feedback


@launches_ranks
@pytest.mark.parametrize("name,fn", [("ring_allreduce", ring_with_blocking_calls),
                                     ("naive_ddp", ddp_with_one_flat_all_reduce),
                                     ("bucketed_ddp", ddp_with_preallocated_buckets),
                                     ("zero1_step", zero1_with_a_flat_shard),
                                     ("gpipe_schedule", gpipe_with_async_transfers)], ids=FUNCTIONS)
def test_other_correct_designs_pass_too(name, fn):
    result = exercises.check(name, fn)
    assert result.passed, result.feedback


@launches_ranks
@pytest.mark.parametrize("name,says", [("ring_allreduce", "write the ring: leave every rank's t holding the sum"),
                                       ("naive_ddp", "average the gradients over the ranks"),
                                       ("bucketed_ddp", "pack the parameters into buckets of at most bucket_bytes"),
                                       ("zero1_step", "write ZeRO-1: one Adam step"),
                                       ("gpipe_schedule", "write GPipe: run this rank's stage")], ids=FUNCTIONS)
def test_the_stub_fails_saying_what_to_write(name, says):
    feedback = exercises.check(name, exercises.stub(name)).feedback
    assert feedback.startswith("World size 2: rank ") and "raised NotImplementedError" in feedback and says in feedback
    assert f"exercises.hint('{name}')" in feedback
    for phrase in GIVEAWAYS[name]:  # a learner's first check shows this message: it must not hand over the algorithm
        assert phrase not in feedback, phrase
    assert f"describe('{name}')" in exercises.stub(name).__doc__


@launches_ranks
def test_ring_rejects_a_collective():
    feedback = exercises.check("ring_allreduce", ring_with_all_reduce).feedback
    assert "rank 0 called dist.all_reduce with 12 elements" in feedback and "only point-to-point" in feedback


@launches_ranks
def test_ring_rejects_wrong_values_and_points_at_the_missing_all_gather():
    feedback = exercises.check("ring_allreduce", ring_without_all_gather).feedback
    assert feedback.startswith("World size 2: rank 0 holds wrong values with 12 elements: at index 0")
    assert "Only chunk 1 (elements 6 to 11) holds the sum" in feedback and "all-gather phase" in feedback


@launches_ranks
def test_ring_rejects_a_pattern_that_is_not_a_ring():
    feedback = exercises.check("ring_allreduce", gather_to_rank_0).feedback  # a ring at n=2; not at n=3
    assert feedback.startswith("World size 3: rank 0 received from rank 1 in round 1 with 12 elements")
    assert "rank r receives only from r - 1 (here rank 2)" in feedback


@launches_ranks
def test_ring_rejects_sending_more_than_a_ring_needs():
    feedback = exercises.check("ring_allreduce", whole_tensor_around_the_ring, world_sizes=(3,)).feedback
    assert "rank 0 sent 96 bytes for a tensor of 12 elements (48 bytes)" in feedback
    assert "2(n - 1)/n = 1.33 of the tensor" in feedback and "one chunk per round" in feedback


@launches_ranks
def test_a_deadlock_ends_after_the_timeout_naming_the_call_and_its_peer():
    feedback = exercises.check("ring_allreduce", ring_that_sends_first, world_sizes=(2,), timeout_s=2).feedback
    assert "timed out waiting in send to rank" in feedback and "with 12 elements" in feedback
    assert ") after 2 s: every send needs a matching receive" in feedback and "batch_isend_irecv" in feedback


@launches_ranks
def test_naive_ddp_rejects_a_sum_that_is_not_divided():
    feedback = exercises.check("naive_ddp", ddp_without_dividing).feedback
    assert feedback.startswith("World size 2: after step 0 the parameters differ by")
    assert "the gradients after your function are 2× the global batch's: summed, not averaged" in feedback


@launches_ranks
def test_naive_ddp_rejects_doing_nothing():
    feedback = exercises.check("naive_ddp", ddp_doing_nothing).feedback
    assert feedback.startswith("World size 2: ranks disagree after step 0")
    assert "left every rank with its own shard's gradient" in feedback


@launches_ranks
def test_zero1_rejects_full_state_on_every_rank():
    feedback = exercises.check("zero1_step", adam_everywhere).feedback
    assert feedback.startswith("World size 2: rank 0 keeps ") and "bytes between steps" in feedback
    assert "Adam's full state (m and v for all 13 parameters) is 4,456 bytes" in feedback
    assert "It keeps 3 tensors shaped like each of the 13 parameters" in feedback  # m, v and the gradient in .grad
    assert "of these bytes are gradients left in a tensor's .grad" in feedback


@launches_ranks
def test_zero1_rejects_wrong_maths():
    feedback = exercises.check("zero1_step", zero1_without_bias_correction).feedback
    assert feedback.startswith("World size 2: after step 0, parameter 0 (6, 8) differs by")
    assert "from full Adam on one process" in feedback and "bias corrections" in feedback


@launches_ranks
def test_bucketed_ddp_rejects_reducing_after_backward():
    feedback = exercises.check("bucketed_ddp", ddp_reducing_after_backward).feedback
    assert feedback.startswith("World size 2: your buckets are reduced after backward: nothing overlaps.")
    assert "rank 0 issued all 4 of its all_reduces after loss.backward() had returned" in feedback
    assert "register_post_accumulate_grad_hook" in feedback


@launches_ranks
def test_bucketed_ddp_rejects_one_bucket_for_everything():
    feedback = exercises.check("bucketed_ddp", ddp_in_one_bucket).feedback
    assert feedback.startswith("World size 2: rank 0 all-reduced 1 bucket (6,752 bytes) in step 0")
    assert "with bucket_bytes=2,048" in feedback
    assert "pack into 4 buckets (1,504, 3,072, 128 and 2,048 bytes)" in feedback
    assert "One bucket holds everything" in feedback


@launches_ranks
def test_gpipe_rejects_one_micro_batch_at_a_time():
    feedback = exercises.check("gpipe_schedule", gpipe_one_micro_batch_at_a_time).feedback
    assert feedback.startswith("World size 2: rank 0 received a gradient from rank 1 before it sent micro-batch 1's "
                               "activations to rank 1, with 4 micro-batches: that is not GPipe's schedule.")
    assert "forwards of all 4 micro-batches first" in feedback


@launches_ranks
def test_gpipe_rejects_a_collective():
    feedback = exercises.check("gpipe_schedule", gpipe_with_a_broadcast).feedback
    assert feedback.startswith("World size 2: rank 0 called dist.broadcast with 4 micro-batches")
    assert "point-to-point calls only" in feedback


@launches_ranks
def test_gpipe_rejects_losses_not_scaled_by_one_over_m():
    feedback = exercises.check("gpipe_schedule", gpipe_without_scaling).feedback
    assert feedback.startswith("World size 2: stage 0's gradients are 4× the whole batch's with 4 micro-batches")
    assert "scale each micro-batch's loss by 1/M (1/4)" in feedback


# -- a whole script under torchrun (each check is one torchrun launch) --------------------------------------------
@runs_torchrun
def test_ddp_script_reference_passes_under_torchrun():
    result = exercises.check("ddp_script", exercises.solution("ddp_script"))
    assert result.passed, result.feedback
    assert "ranks trained on disjoint shares that covered the 48 samples, in a new order every epoch" in result.feedback
    assert "rank 0 alone saved model.pt and every rank waited at a barrier" in result.feedback
    assert "matched one process training on the same global batches" in result.feedback


@runs_torchrun
def test_ddp_script_starter_fails_saying_what_to_do():
    feedback = exercises.check("ddp_script", exercises.stub("ddp_script")).feedback
    assert feedback.startswith("World size 2: rank ")
    assert "'s script raised NotImplementedError at line " in feedback and "of ddp_script_starter.py" in feedback
    assert "TODO 1: call dist.init_process_group('gloo')" in feedback


@runs_torchrun
def test_ddp_script_without_set_epoch_repeats_the_first_epoch(tmp_path):
    reference = Path(exercises.solution("ddp_script")).read_text()
    assert "        sampler.set_epoch(epoch)" in reference
    script = tmp_path / "no_set_epoch.py"
    script.write_text(reference.replace("        sampler.set_epoch(epoch)", "        pass"))
    feedback = exercises.check("ddp_script", script).feedback
    assert feedback.startswith("World size 2: rank 0 trained on the same samples in the same order in epoch 1 as in "
                               "epoch 0")
    assert "without sampler.set_epoch(epoch) at the start of every epoch" in feedback
