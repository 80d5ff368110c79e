"""zero1_step and gpipe_schedule: wrong solutions fail naming their cause; correct ones written with names imported
from torch.distributed pass.

Every function here calls torch.distributed through names imported at the top of this module, bound when a rank
imports it, before that rank's recorder starts: a check must see those calls all the same. Each wrong solution
is checked at one world size; those that return on every rank share one launch per exercise and world size
(``check_each``), and its row names the words its feedback must contain.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed import (
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    irecv,
    isend,
    recv,
    send,
)

from dtlab.exercises import _weigh, gpipe_schedule, zero1_step
from tests.exercise_batch import assert_names_its_cause, check, launches_ranks, verdicts_by_size

# -- zero1_step --------------------------------------------------------------------------------------------------
BETAS, EPS = (0.9, 0.999), 1e-8
KEPT = {}  # a module-level place to hide state in: the rank keeps it between calls all the same


def adam(p, g, m, v, t, lr):
    """One Adam update of ``p`` in place, its moments ``m`` and ``v`` updated in place too."""
    b1, b2 = BETAS
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.sub_(lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + EPS))


def owned_update(params, grads, store, lr):
    """Adam on the parameters this rank owns (i % n == rank), their moments kept in ``store``."""
    rank, n = get_rank(), get_world_size()
    t = store["t"] = store.get("t", 0) + 1
    for i in range(rank, len(params), n):
        m, v = store.setdefault(i, (torch.zeros_like(params[i]), torch.zeros_like(params[i])))
        adam(params[i], grads[i], m, v, t, lr)


def zero1_prebound(params, grads, state, lr):
    owned_update(params, grads, state, lr)
    for i, p in enumerate(params):
        broadcast(p, src=i % get_world_size())


def zero1_with_torch_adam_on_its_share(params, grads, state, lr):
    """torch.optim.Adam over the parameters this rank owns; their gradients stay in .grad between calls (1/n)."""
    rank, n = get_rank(), get_world_size()
    owned = range(rank, len(params), n)
    if "adam" not in state:
        state["adam"] = torch.optim.Adam([params[i] for i in owned], lr=lr)
    for i in owned:
        params[i].grad = grads[i]
    state["adam"].step()
    for i, p in enumerate(params):
        broadcast(p, src=i % n)


def zero1_all_reducing(params, grads, state, lr):
    """Each owner updates its parameters, the others zero theirs, and one all_reduce per parameter sums them."""
    rank, n = get_rank(), get_world_size()
    owned_update(params, grads, state, lr)
    for i, p in enumerate(params):
        if i % n != rank:
            p.zero_()
        all_reduce(p)


def zero1_full_state_in_a_global(params, grads, state, lr):
    """Full Adam on every rank, its moments kept outside the state dict, which gets a decoy share; the broadcasts
    send what every rank already has."""
    t = KEPT["t"] = KEPT.get("t", 0) + 1
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = KEPT.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        adam(p, g, m, v, t, lr)
    owned_update([p.clone() for p in params], grads, state, lr)
    for i, p in enumerate(params):
        broadcast(p, src=i % get_world_size())


def zero1_keeping_a_copy_of_the_parameters(params, grads, state, lr):
    owned_update(params, grads, state, lr)
    state["copy"] = [p.clone() for p in params]  # "in case": a full copy of the parameters, kept
    for i, p in enumerate(params):
        broadcast(p, src=i % get_world_size())


def zero1_sharing_the_whole_state(params, grads, state, lr):
    """Every rank receives every owner's m and v too, so every rank ends with the whole state."""
    n = get_world_size()
    owned_update(params, grads, state, lr)
    for i, p in enumerate(params):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        for x in (p, m, v):
            broadcast(x, src=i % n)


def zero1_from_rank_0(params, grads, state, lr):
    """Broadcasts every parameter from rank 0, which updated only its own."""
    owned_update(params, grads, state, lr)
    for p in params:
        broadcast(p, src=0)


def zero1_rank_0_does_everything(params, grads, state, lr):
    """Rank 0 runs full Adam and broadcasts; the other ranks keep nothing."""
    if get_rank() == 0:
        t = state["t"] = state.get("t", 0) + 1
        for i, (p, g) in enumerate(zip(params, grads)):
            m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
            adam(p, g, m, v, t, lr)
    for p in params:
        broadcast(p, src=0)


def zero1_without_the_step_count(params, grads, state, lr):
    """t is 1 at every step: the bias corrections are always the first step's."""
    rank, n = get_rank(), get_world_size()
    for i in range(rank, len(params), n):
        m, v = state.setdefault(i, (torch.zeros_like(params[i]), torch.zeros_like(params[i])))
        adam(params[i], grads[i], m, v, 1, lr)
    for i, p in enumerate(params):
        broadcast(p, src=i % n)


def zero1_with_a_flat_shard_prebound(params, grads, state, lr):
    """Rank r owns a contiguous slice of the flattened parameters; all_gather_into_tensor collects the slices."""
    rank, n = get_rank(), get_world_size()
    total = sum(p.numel() for p in params)
    size = -(-total // n)
    flat_p = torch.cat([p.reshape(-1) for p in params] + [torch.zeros(size * n - total)])
    flat_g = torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(size * n - total)])
    mine = slice(rank * size, (rank + 1) * size)
    t = state["t"] = state.get("t", 0) + 1
    if "m" not in state:
        state["m"], state["v"] = torch.zeros(size), torch.zeros(size)
    shard = flat_p[mine].clone()
    adam(shard, flat_g[mine], state["m"], state["v"], t, lr)
    gathered = torch.empty(size * n)
    all_gather_into_tensor(gathered, shard)
    for p, part in zip(params, gathered[:total].split([p.numel() for p in params])):
        p.copy_(part.view_as(p))


# -- gpipe_schedule ----------------------------------------------------------------------------------------------
def gpipe(stage, micro_batches, targets, loss_fn, scale=True, accumulate=True, between=None, returned=None):
    """GPipe with blocking transfers, its mistakes as parameters; ``between`` runs between the two phases."""
    rank, n, m_count = get_rank(), get_world_size(), len(micro_batches)
    first, last = rank == 0, rank == n - 1
    inputs, outputs = [], []
    for m, x in enumerate(micro_batches):
        if not first:
            recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[m]) / (m_count if scale else 1)
        else:
            send(y.detach(), rank + 1)
        inputs.append(x)
        outputs.append(y)
    if between:
        between()
    for m in reversed(range(m_count)):
        if not accumulate:
            stage.zero_grad()
        if last:
            outputs[m].backward()
        else:
            grad = torch.empty_like(outputs[m])
            recv(grad, rank + 1)
            outputs[m].backward(grad)
        if not first:
            send(inputs[m].grad, rank - 1)
    if not last:
        return None
    return returned(outputs) if returned else torch.stack(outputs).sum().detach()


def gpipe_prebound(stage, micro_batches, targets, loss_fn):
    return gpipe(stage, micro_batches, targets, loss_fn)


def gpipe_async_prebound(stage, micro_batches, targets, loss_fn):
    """isend/irecv throughout: receives waited on before use, sends waited on at the end."""
    rank, n, m_count = get_rank(), get_world_size(), len(micro_batches)
    sends, outputs = [], []
    for m, x in enumerate(micro_batches):
        if rank > 0:
            irecv(x, rank - 1).wait()
            x.requires_grad_()
        y = stage(x)
        if rank == n - 1:
            y = loss_fn(y, targets[m]) / m_count
        else:
            sends.append(isend(y.detach(), rank + 1))
        outputs.append(y)
    for m in reversed(range(m_count)):
        if rank == n - 1:
            outputs[m].backward()
        else:
            grad = torch.empty_like(outputs[m])
            irecv(grad, rank + 1).wait()
            outputs[m].backward(grad)
        if rank > 0:
            sends.append(isend(micro_batches[m].grad, rank - 1))
    for work in sends:
        work.wait()
    return torch.stack(outputs).sum().detach() if rank == n - 1 else None


def gpipe_with_a_barrier(stage, micro_batches, targets, loss_fn):
    """A barrier between the phases "to be safe": a collective."""
    return gpipe(stage, micro_batches, targets, loss_fn, between=barrier)


def gpipe_not_averaging(stage, micro_batches, targets, loss_fn):
    return gpipe(stage, micro_batches, targets, loss_fn, scale=False)


def gpipe_zeroing_between_micro_batches(stage, micro_batches, targets, loss_fn):
    return gpipe(stage, micro_batches, targets, loss_fn, accumulate=False)


def gpipe_returning_the_last_loss(stage, micro_batches, targets, loss_fn):
    return gpipe(stage, micro_batches, targets, loss_fn, returned=lambda outputs: outputs[-1].detach())


def gpipe_one_micro_batch_at_a_time(stage, micro_batches, targets, loss_fn):
    """Forward and backward of each micro-batch before the next one starts: right gradients, wrong schedule."""
    rank, n, m_count = get_rank(), get_world_size(), len(micro_batches)
    total = 0.0
    for m, x in enumerate(micro_batches):
        if rank > 0:
            recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank == n - 1:
            y = loss_fn(y, targets[m]) / m_count
            y.backward()
            total = total + y.detach()
        else:
            send(y.detach(), rank + 1)
            grad = torch.empty_like(y)
            recv(grad, rank + 1)
            y.backward(grad)
        if rank > 0:
            send(x.grad, rank - 1)
    return total if rank == n - 1 else None


def gpipe_waiting_for_a_gradient_first(stage, micro_batches, targets, loss_fn):
    """Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1, while the last stage runs all its
    forwards first: each waits for the other."""
    if get_rank() == get_world_size() - 1:
        return gpipe(stage, micro_batches, targets, loss_fn)
    return gpipe_one_micro_batch_at_a_time(stage, micro_batches, targets, loss_fn)


def gpipe_micro_batches_reversed(stage, micro_batches, targets, loss_fn):
    """Stage 0 feeds the micro-batches last first; the last stage pairs them with the targets first first."""
    if get_rank() == 0:
        micro_batches = micro_batches[::-1]
    return gpipe(stage, micro_batches, targets, loss_fn)


# -- weighing what a rank keeps (in this process, no launch) -----------------------------------------------------
HIDDEN = []


class Box:
    def __init__(self, t):
        self.t = t


def test_kept_weighs_each_storage_once_wherever_it_is_held():
    params = [torch.zeros(10), torch.zeros(20)]
    before = _weigh.live_tensors()
    m = torch.zeros(100)
    state = {"m": m, "view": m[:50], "detached": m.detach(), "box": Box(torch.zeros(25)), "t": 3,
             "param": params[0].detach()}  # a view of a parameter: its storage is the parameter's
    HIDDEN.append(torch.zeros(40))  # a global, outside the state dict
    params[1].grad = torch.ones(20)  # a gradient left in a .grad
    try:
        kept = _weigh.kept(state, before, params)
    finally:
        HIDDEN.clear()
        params[1].grad = None
    assert kept.in_state == 4 * 100 + 4 * 25 + 8  # m once (its views add nothing), the box's tensor, the int
    assert kept.outside == 4 * 40 + 4 * 20 and kept.in_grads == 4 * 20
    assert (100,) in kept.shapes and (50,) not in kept.shapes  # a storage's largest tensor names it


def test_kept_waits_for_a_backend_thread_to_let_go_of_a_finished_calls_tensor():
    # gloo's worker holds a finished all_gather's output a moment after the call returns (about 1 call in 4 at 3
    # ranks here): what another thread lets go of within the wait is not kept; what stays is
    params, before = [torch.zeros(10)], _weigh.live_tensors()
    HIDDEN.append(torch.zeros(558))
    release = threading.Timer(_weigh.SETTLE_S / 4, HIDDEN.clear)
    release.start()
    try:
        assert _weigh.kept({}, before, params).outside == 0
        HIDDEN.append(torch.zeros(7))
        assert _weigh.kept({}, before, params).outside == 4 * 7
    finally:
        release.cancel()
        HIDDEN.clear()


# -- the correct solutions pass at every world size --------------------------------------------------------------
@launches_ranks
@pytest.mark.parametrize("module,fn", [(zero1_step, zero1_prebound), (zero1_step, zero1_with_a_flat_shard_prebound),
                                       (zero1_step, zero1_with_torch_adam_on_its_share),
                                       (gpipe_schedule, gpipe_prebound), (gpipe_schedule, gpipe_async_prebound)],
                         ids=["zero1_step", "zero1_step-flat_shard", "zero1_step-torch_adam", "gpipe_schedule",
                              "gpipe_schedule-async"])
def test_a_solution_calling_names_imported_from_torch_distributed_passes(module, fn):
    result = check(module, fn, module.EXERCISE.world_sizes)
    assert result.passed, result.feedback


# -- the wrong ones fail, each saying why ------------------------------------------------------------------------
FULL = "Adam's full state (m and v for all 13 parameters) is 4,456 bytes"
EVERY = "shaped like each of the 13 parameters: state (or a copy) for every parameter, not only for its share"
# Each wrong solution, the world size it is checked at, and the words its feedback must contain.
WRONG = {
    zero1_step: {
        zero1_all_reducing: (2, ["World size 2: rank 0 called dist.all_reduce in step 0: ZeRO-1 shares the updated "
                                 "parameters with broadcast"]),
        zero1_full_state_in_a_global: (2, ["rank 0 keeps 6,904 bytes between steps, 4,456 of them outside the state "
                                           "dict (in a global, a closure or an attribute)", FULL,
                                           "It keeps 2 tensors " + EVERY]),
        zero1_keeping_a_copy_of_the_parameters: (4, ["World size 4: rank 0 keeps 3,652 bytes between steps", FULL,
                                                     "It keeps 1 tensor " + EVERY, "at most 2,363 bytes here"]),
        zero1_sharing_the_whole_state: (2, ["rank 0 keeps 4,464 bytes between steps", "It keeps 2 tensors " + EVERY]),
        zero1_rank_0_does_everything: (2, ["rank 0 keeps 4,464 bytes between steps", "It keeps 2 tensors " + EVERY]),
        zero1_from_rank_0: (2, ["parameter 1 was not updated in step 0", "Every broadcast in step 0 came from rank "
                                "0, which sent its own copies, updated or not"]),
        zero1_without_the_step_count: (2, ["after step 1, parameter 0 (6, 8) differs by", "the bias corrections 1 - "
                                           "b1**t and 1 - b2**t with t counting steps from 1"]),
    },
    gpipe_schedule: {
        gpipe_with_a_barrier: (2, ["World size 2: rank 0 called dist.barrier with 4 micro-batches", "no collective, "
                                   "not even a barrier"]),
        gpipe_not_averaging: (2, ["stage 0's gradients are 4× the whole batch's with 4 micro-batches", "scale each "
                                  "micro-batch's loss by 1/M (1/4)"]),
        gpipe_zeroing_between_micro_batches: (2, ["stage 0's gradients are those of micro-batch 0 alone, with 4 "
                                                  "micro-batches", "no zero_grad"]),
        gpipe_returning_the_last_loss: (2, ["the last stage returned a loss of", "return the sum of the M micro-batch "
                                            "losses, each divided by M"]),
        gpipe_one_micro_batch_at_a_time: (2, ["rank 0 received a gradient from rank 1 before it sent micro-batch 1's "
                                              "activations to rank 1, with 4 micro-batches: that is not GPipe's "
                                              "schedule"]),
        gpipe_micro_batches_reversed: (3, ["World size 3: rank 1 received micro-batch 3's activations as micro-batch "
                                           "0 (into micro_batches[0]), with 4 micro-batches", "went forward out of "
                                           "order"]),
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
def test_a_kept_state_fails_the_same_through_check():
    """The shared launch judges as check() does: state hidden in a global, through run_check at 2, 3 and 4."""
    feedback = check(zero1_step, zero1_full_state_in_a_global, zero1_step.EXERCISE.world_sizes).feedback
    assert feedback.startswith("World size 2: rank 0 keeps 6,904 bytes between steps, 4,456 of them outside")


@launches_ranks
def test_stages_waiting_for_each_other_hang_and_the_report_names_the_call_and_its_peer():
    feedback = check(gpipe_schedule, gpipe_waiting_for_a_gradient_first, timeout_s=2).feedback
    # both wait in a receive, stage 0 for a gradient and stage 1 for micro-batch 1's activations: whichever timed
    # out first is named
    named = ("rank 0 timed out waiting in recv from rank 1 (its 2nd call, with 4 micro-batches",
             "rank 1 timed out waiting in recv from rank 0 (its 2nd call, with 4 micro-batches")
    assert feedback.startswith(tuple(f"World size 2: {words}" for words in named)), feedback
    assert "after 2 s: every send needs a matching receive" in feedback
