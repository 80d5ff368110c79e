"""Exercise ``gpipe_schedule``: GPipe's schedule, M micro-batches through S pipeline stages with point-to-point.

Pipeline parallelism cuts the model into S consecutive slices (*stages*), one
per rank: rank 0 holds the first layers, rank S - 1 the last ones and the
loss. Activations go forward from rank s to s + 1; in backward, the gradient of
those activations comes back from s + 1 to s. A whole batch at a time would
leave all stages but one idle, so GPipe (Huang et al., 2019) splits the batch
into M *micro-batches* and runs

1. **all M forwards**: stage s runs micro-batch m as soon as it has it, and
   passes the output on while the previous stage already works on m + 1;
2. **all M backwards**, last micro-batch first: each stage calls
   ``output.backward(gradient)`` with the gradient received from the next stage
   and sends its input's gradient to the previous one.

The parameters' gradients accumulate over the micro-batches. Scaling each
micro-batch's mean loss by 1/M makes their sum the whole batch's mean loss, so
the gradients equal one process running the whole model on the whole batch.
Every stage keeps all M micro-batches' activations until their backward: that
memory is GPipe's cost (1F1B interleaves the backwards to free them sooner). The
``pipeline`` tier runs these schedules with ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.exercises._check import SENDS, Call, Exercise, call_learner, first_collective, ops_used
from dtlab.exercises._values import flat_grads, max_abs

WIDTHS = (8, 16, 12, 10, 4)  # Linear 8 -> 16, Tanh, 16 -> 12, Tanh, 12 -> 10, Tanh, 10 -> 4
SPLITS = {2: (0, 4, 7), 3: (0, 2, 4, 7), 4: (0, 2, 4, 6, 7)}  # stage r runs modules SPLITS[n][r]:SPLITS[n][r + 1]
BATCH = 12  # divisible by 3 and 4
CASES = ((4, 0), (3, 1))  # (M micro-batches, the batch's seed)
TOL = 1e-5

DESCRIPTION = (
    "Write fn(stage: torch.nn.Module, micro_batches: list[torch.Tensor], targets: list[torch.Tensor] | None, "
    "loss_fn) -> torch.Tensor | None: one training step of a GPipe pipeline, with point-to-point calls. Rank r runs "
    "stage r of n = dist.get_world_size(), a slice of one model (rank 0 the first layers, rank n - 1 the last), and "
    "M = len(micro_batches). On rank 0 micro_batches holds the M micro-batches of the input; on every other rank, M "
    "empty tensors shaped like the activations it gets from rank r - 1, to receive them into. targets holds the M "
    "targets on the last rank, None elsewhere; loss_fn(output, target) gives a micro-batch's mean loss. The checker "
    "zeroed the stage's gradients; after fn every parameter's .grad must be what one process running the whole "
    "model on the whole batch's mean loss gives it, and the last rank returns that loss (a one-element tensor), "
    "the others None. Rules: only "
    "point-to-point calls (send, recv, isend, irecv, batch_isend_irecv; no collective, not even a barrier), each "
    "with a neighbouring rank, and GPipe's order: on every rank, all its forward transfers (activations) before any "
    "backward transfer (gradients). Checked at world sizes 2 and 3 "
    f"with M = {CASES[0][0]} and M = {CASES[1][0]} ({BATCH} samples): every stage's gradients and the returned loss "
    f"against one process running the whole model on the whole batch (within {TOL:g}); point-to-point calls only, "
    "between neighbours; M activations forward and M gradients back across every boundary; and GPipe's order."
)

HINTS = (
    "First all M forwards: each stage takes micro-batch m from the stage before, runs it and passes the output on. "
    "Then all M backwards, last micro-batch first: each stage gets the gradient of its output from the stage after, "
    "backpropagates it through its slice and passes the gradient of its input back. Keep every micro-batch's input "
    "and output until its backward, let the parameters' gradients add up over the micro-batches, and weigh each "
    "micro-batch's loss so that together they make the whole batch's mean loss.",

    "Forward, on rank r: unless r is 0, dist.recv(x, src=r - 1) into micro_batches[m], then x.requires_grad_() so "
    "that backward leaves its gradient in x.grad; y = stage(x); on the last rank loss = loss_fn(y, targets[m]) / M "
    "(the batch's mean loss is the mean of the M micro-batch means), elsewhere dist.send(y.detach(), dst=r + 1). "
    "Backward, m from M - 1 down to 0: on the last rank loss.backward(); elsewhere grad = torch.empty_like(y), "
    "dist.recv(grad, src=r + 1), y.backward(grad); then, unless r is 0, dist.send(x.grad, dst=r - 1). Blocking send "
    "and recv are fine: in this order every send meets its receive. Return the sum of the M scaled losses, "
    ".detach()ed, on the last rank.",

    "r, n, M = dist.get_rank(), dist.get_world_size(), len(micro_batches)\n"
    "inputs, outputs = [], []\n"
    "for m in range(M):                                   # all forwards\n"
    "    x = micro_batches[m]\n"
    "    if r > 0: recv x from rank r - 1; x.requires_grad_()\n"
    "    y = stage(x)\n"
    "    if r == n - 1: y = loss_fn(y, targets[m]) / M\n"
    "    else: send y.detach() to rank r + 1\n"
    "    inputs.append(x); outputs.append(y)\n"
    "for m in reversed(range(M)):                         # all backwards, last micro-batch first\n"
    "    if r == n - 1: outputs[m].backward()\n"
    "    else: grad = empty like outputs[m]; recv grad from rank r + 1; outputs[m].backward(grad)\n"
    "    if r > 0: send inputs[m].grad to rank r - 1\n"
    "return sum(outputs).detach() if r == n - 1 else None",
)


def gpipe_schedule(stage: nn.Module, micro_batches: list[torch.Tensor], targets: list[torch.Tensor] | None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """The reference: all forwards (activations to rank + 1), then all backwards in reverse (gradients to rank - 1)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    first, last, m_count = rank == 0, rank == n - 1, len(micro_batches)
    inputs, outputs = [], []
    for m, x in enumerate(micro_batches):  # forward, micro-batch by micro-batch
        if not first:
            dist.recv(x, src=rank - 1)
            x.requires_grad_()  # so that backward leaves the gradient for rank - 1 in x.grad
        y = stage(x)
        if last:
            y = loss_fn(y, targets[m]) / m_count  # the batch's mean loss is the mean of the micro-batches' means
        else:
            dist.send(y.detach(), dst=rank + 1)
        inputs.append(x)
        outputs.append(y)
    for m in reversed(range(m_count)):  # backward, last micro-batch first; the parameters' gradients accumulate
        if last:
            outputs[m].backward()
        else:
            grad = torch.empty_like(outputs[m])
            dist.recv(grad, src=rank + 1)
            outputs[m].backward(grad)
        if not first:
            dist.send(inputs[m].grad, dst=rank - 1)
    return torch.stack(outputs).sum().detach() if last else None


def stub(stage: nn.Module, micro_batches: list[torch.Tensor], targets: list[torch.Tensor] | None,
         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """A starting point: replace the body (see ``describe('gpipe_schedule')``)."""
    raise NotImplementedError(
        "write GPipe: run this rank's stage on the M micro-batches, forwards and backwards, passing activations and "
        "their gradients between neighbouring stages, so that the stage's gradients are the whole batch's "
        "(exercises.hint('gpipe_schedule') when stuck)")


# -- the run both sides share ------------------------------------------------------------------------------------
def _model() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
            layers += [nn.Linear(n_in, n_out)] + ([nn.Tanh()] if i < len(WIDTHS) - 2 else [])
        return nn.Sequential(*layers)


def _stage(model: nn.Sequential, n: int, r: int) -> nn.Sequential:
    return nn.Sequential(*list(model)[SPLITS[n][r]:SPLITS[n][r + 1]])


def _in_width(n: int, r: int) -> int:
    """How many features stage r of n receives per sample."""
    return _model()[SPLITS[n][r]].in_features


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3000 + seed)
    return torch.randn(BATCH, WIDTHS[0], generator=gen), torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen)


@functools.cache
def reference(n: int, seed: int) -> tuple[tuple[torch.Tensor, ...], float]:
    """One process, the whole model on the whole batch: (each stage's flat gradients, the mean loss)."""
    model = _model()
    x, y = _batch(seed)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return tuple(flat_grads(_stage(model, n, r)) for r in range(n)), float(loss.detach())


@functools.cache
def micro_reference(n: int, seed: int, m: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per micro-batch k of m: (each stage's flat gradients of micro-batch k's loss / m alone, one tensor per stage
    stacking the k's; the activations entering each stage, stacked the same way)."""
    x, y = _batch(seed)
    grads, inputs = [], []
    for xk, yk in zip(x.tensor_split(m), y.tensor_split(m)):
        model = _model()
        (F.cross_entropy(model(xk), yk) / m).backward()
        grads.append([flat_grads(_stage(model, n, r)) for r in range(n)])
        with torch.no_grad():
            inputs.append([model[:SPLITS[n][r]](xk) for r in range(n)])
    return (tuple(torch.stack([g[r] for g in grads]) for r in range(n)),
            tuple(torch.stack([a[r] for a in inputs]) for r in range(n)))


# -- on a rank ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One rank's step with M micro-batches: its stage's gradients, the loss it returned (or what), its calls."""

    micro: int
    grads: torch.Tensor
    loss: float | None
    returned: str
    calls: tuple[Call, ...]
    received: torch.Tensor | None  # on ranks > 0: the M buffers handed to fn, stacked, after it


def on_rank(info: Any, fn: Any) -> list[Case]:
    rank, n = info.rank, info.world_size
    cases = []
    for m, seed in CASES:
        stage = _stage(_model(), n, rank)
        x, y = _batch(seed)
        if rank == 0:
            micro_batches = [part.clone() for part in x.tensor_split(m)]
        else:
            micro_batches = [torch.empty(BATCH // m, _in_width(n, rank)) for _ in range(m)]
        targets = [part.clone() for part in y.tensor_split(m)] if rank == n - 1 else None
        returned, calls = call_learner(fn, stage, micro_batches, targets, F.cross_entropy,
                                       where=f"with {m} micro-batches")
        scalar = isinstance(returned, torch.Tensor) and returned.numel() == 1
        received = torch.stack([b.detach() for b in micro_batches]) if rank else None
        cases.append(Case(m, flat_grads(stage), float(returned.detach()) if scalar else None,
                          repr(returned) if returned is None else type(returned).__name__, calls, received))
    return cases


# -- judging -----------------------------------------------------------------------------------------------------
def judge(n: int, ranks: list[list[Case]]) -> str | None:
    for i, (m, seed) in enumerate(CASES):
        case = [cases[i] for cases in ranks]
        problem = (_collective(m, case) or _neighbours(m, case) or _transfers(n, m, case) or _schedule(m, case)
                   or _order(n, m, seed, case) or _gradients(n, m, seed, case) or _loss(n, m, seed, case))
        if problem:
            return problem
    return None


def _collective(m: int, case: list[Case]) -> str | None:
    found = first_collective([c.calls for c in case])
    if found is None:
        return None
    r, call = found
    return (f"rank {r} called dist.{call.op} with {m} micro-batches: a pipeline passes activations "
            "forward and gradients back between neighbouring stages with point-to-point calls only "
            "(send, recv, isend, irecv, batch_isend_irecv); no collective, not even a barrier.")


def _neighbours(m: int, case: list[Case]) -> str | None:
    for r, c in enumerate(case):
        for call in c.calls:
            verb = "sent to" if call.op in SENDS else "received from"
            if call.peer is None:
                return (f"rank {r} received from any rank (src=None) with {m} micro-batches: name the neighbour "
                        f"(rank {r - 1} for activations, rank {r + 1} for gradients).")
            if call.peer not in (r - 1, r + 1):
                return (f"rank {r} {verb} rank {call.peer} with {m} micro-batches: a stage talks only to its "
                        "neighbours, activations going from rank r to r + 1 and gradients from r + 1 back to r.")
    return None


def _transfers(n: int, m: int, case: list[Case]) -> str | None:
    rows = BATCH // m
    for s in range(n - 1):  # the boundary between stage s and s + 1
        width = _in_width(n, s + 1)
        nbytes = rows * width * 4
        for src, dst, what in ((s, s + 1, "activations forward"), (s + 1, s, "gradients back")):
            sent = [call.nbytes for call in case[src].calls if call.op in SENDS and call.peer == dst]
            if len(sent) == m and all(b == nbytes for b in sent):
                continue
            carried = f" carrying {', '.join(f'{b:,}' for b in sent)} bytes" if sent else ""
            return (f"rank {src} sent {len(sent)} tensor{'s' * (len(sent) != 1)} to rank {dst} with {m} "
                    f"micro-batches{carried}; the {what} cross every boundary once per micro-batch: {m} sends of "
                    f"{nbytes:,} bytes ({rows} samples × {width} features, float32) from rank {src} to rank {dst}.")
    return None


def _kind(call: Call, r: int) -> str:
    """'forward' (activations: sent to r + 1, received from r - 1) or 'backward' (gradients, the other way)."""
    return "forward" if (call.peer == r + 1) == (call.op in SENDS) else "backward"


def _when(call: Call) -> float:
    """When a transfer happened on its rank: a send when issued, a receive when it completed (its data was there)."""
    return call.start if call.op in SENDS or call.end is None else call.end


def _says(call: Call, r: int, k: int = 0) -> str:
    """What a transfer of rank r was, in words; ``k``: which micro-batch (for activations)."""
    if _kind(call, r) == "forward":
        return (f"sent micro-batch {k}'s activations to rank {r + 1}" if call.op in SENDS
                else f"received micro-batch {k}'s activations from rank {r - 1}")
    return f"sent a gradient to rank {r - 1}" if call.op in SENDS else f"received a gradient from rank {r + 1}"


def _schedule(m: int, case: list[Case]) -> str | None:
    for r, c in enumerate(case):
        backward = [call for call in c.calls if _kind(call, r) == "backward"]
        if not backward:
            continue
        first_back = min(backward, key=_when)
        for call in c.calls:
            if _kind(call, r) == "forward" and _when(call) > _when(first_back):
                same = [x for x in c.calls if (x.op in SENDS) == (call.op in SENDS) and x.peer == call.peer]
                k = next(i for i, x in enumerate(same) if x is call)
                return (f"rank {r} {_says(first_back, r)} before it {_says(call, r, k)}, with {m} micro-batches: "
                        f"that is not GPipe's schedule. GPipe runs the forwards of all {m} micro-batches first, each "
                        "stage passing its activations on, and only then their backwards, last micro-batch first: "
                        "a stage starts its first backward once its last forward is done.")
    return None


def _order(n: int, m: int, seed: int, case: list[Case]) -> str | None:
    """The activations each rank received into its buffers: another micro-batch's in buffer k says the
    micro-batches went forward out of order (buffers the function did not receive into say nothing)."""
    expected = micro_reference(n, seed, m)[1]
    for r, c in enumerate(case[1:], 1):
        if c.received is None or c.received.shape != expected[r].shape:
            continue
        got = [next((j for j in range(m) if max_abs(c.received[k], expected[r][j]) <= TOL), None) for k in range(m)]
        wrong = [k for k in range(m) if got[k] is not None and got[k] != k]
        if wrong:
            k = wrong[0]
            return (f"rank {r} received micro-batch {got[k]}'s activations as micro-batch {k} (into "
                    f"micro_batches[{k}]), with {m} micro-batches: the micro-batches went forward out of order. "
                    "Every stage handles them in the same order, 0 to M - 1, so that the last stage pairs each with "
                    "its own target.")
    return None


def _gradients(n: int, m: int, seed: int, case: list[Case]) -> str | None:
    ref, _ = reference(n, seed)
    for r, c in enumerate(case):
        err = max_abs(c.grads, ref[r])
        if err <= TOL:
            continue
        if max_abs(c.grads, ref[r] * m) <= TOL * m:
            return (f"stage {r}'s gradients are {m}× the whole batch's with {m} micro-batches: scale each "
                    f"micro-batch's loss by 1/M (1/{m}) before its backward. loss_fn gives a micro-batch's mean "
                    "loss, and the batch's mean loss is the mean of the M of them.")
        per_micro = micro_reference(n, seed, m)[0][r]
        alone = [k for k in range(m) if max_abs(c.grads, per_micro[k]) <= TOL]
        if alone:
            return (f"stage {r}'s gradients are those of micro-batch {alone[0]} alone, with {m} micro-batches: the "
                    "gradients of all the micro-batches must add up in .grad, so nothing may zero them (no "
                    "zero_grad) between one micro-batch's backward and the next.")
        if not bool(c.grads.any()):
            return (f"stage {r}'s parameters got no gradient with {m} micro-batches: every stage runs backward for "
                    "every micro-batch (the last from its scaled loss, the others from the gradient received from "
                    "the next stage).")
        return (f"stage {r}'s gradients differ by {err:.1e} from one process running the whole model on the whole "
                f"batch, with {m} micro-batches: each micro-batch's backward must start from the gradient of the "
                "very activations that went forward (keep every micro-batch's input and output until its "
                "backward), and the gradients accumulate over the micro-batches (no zero_grad in between).")
    return None


def _loss(n: int, m: int, seed: int, case: list[Case]) -> str | None:
    _, ref_loss = reference(n, seed)
    last = case[n - 1]
    if last.loss is None:
        return (f"the last stage (rank {n - 1}) returned {last.returned} with {m} micro-batches: return the "
                "batch's loss, the sum of the M scaled micro-batch losses (a tensor with one element).")
    if abs(last.loss - ref_loss) > TOL:
        return (f"the last stage returned a loss of {last.loss:.6g} with {m} micro-batches; the whole batch's mean "
                f"loss is {ref_loss:.6g}: return the sum of the M micro-batch losses, each divided by M.")
    return None


def summary(records: dict[int, list[list[Case]]]) -> str:
    worst = max(max_abs(c.grads, reference(n, CASES[i][1])[0][r]) for n, ranks in records.items()
                for r, cases in enumerate(ranks) for i, c in enumerate(cases))
    m, n = CASES[0][0], min(records)
    per_rank = "; ".join(f"rank {r}: {ops_used(cases[0].calls)}" for r, cases in enumerate(records[n]))
    return (f"with {' and '.join(str(m) for m, _ in CASES)} micro-batches at world sizes "
            f"{', '.join(map(str, records))}, every stage's gradients matched one process running the whole model on "
            f"the whole batch (largest difference {worst:.1g}) and the last stage returned the batch's loss. Every "
            "rank used point-to-point calls with its neighbours only, M activations forward and M gradients back "
            "across every boundary, all forward transfers before any backward transfer. The calls at "
            f"n={n} with M={m}: {per_rank}.")


EXERCISE = Exercise("gpipe_schedule", DESCRIPTION, on_rank, judge, summary, gpipe_schedule, stub, world_sizes=(2, 3),
                    allowed_world_sizes=(2, 3, 4), hints=HINTS)
