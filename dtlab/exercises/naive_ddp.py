"""Exercise ``naive_ddp``: make every rank's gradients the global batch's, as DistributedDataParallel does.

Data parallelism: every rank holds the same model and computes gradients on
its own shard of the global batch. After ``loss.backward()`` rank r's ``p.grad``
is the gradient of the mean loss over *its* shard only. With equal shards, the
global batch's mean-loss gradient is the mean of the ranks' gradients: sum them
over the ranks (``dist.all_reduce``, a sum) and divide by the world size. Then
every rank takes the same optimizer step and the replicas stay identical: the
run matches one process on the whole batch (parity), which is what the checker
compares.

This is the ``ddp-naive`` tier (``dtlab.tiers.ddp_naive``): one all_reduce per
parameter, after backward. DistributedDataParallel does the same maths with the
gradients packed into buckets, all-reduced while backward still runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.core.models import mlp
from dtlab.exercises._check import Call, Exercise, call_learner, ops_used
from dtlab.exercises._values import flat_grads, flat_params, max_abs, sgd_reference

GLOBAL_BATCH = 24  # divisible by 2, 3 and 4: every rank gets an equal shard
FEATURES, CLASSES, WIDTH = 8, 4, 16
STEPS = 10
LR = 0.1
TOL = 1e-5

DESCRIPTION = (
    "Write fn(model: torch.nn.Module) -> None that makes every rank's gradients the global batch's, as "
    "DistributedDataParallel does. Every rank holds the same model; the checker calls fn on every rank right after "
    "loss.backward() on that rank's shard of the global batch (equal shards, each loss the mean over its own "
    "shard), then takes a plain SGD step. fn must leave every parameter's p.grad equal, on every rank, to the "
    "gradient of the whole global batch's mean loss, as one process on the whole batch would compute it. Rules: "
    "change only the gradients, not the parameters; any torch.distributed calls may be used. Checked at world "
    f"sizes 2, 3 and 4 over {STEPS} steps of a small MLP: every rank's gradients after fn, and the parameters after "
    f"every step, against one process training on the whole batch (within {TOL:g}); and that the ranks "
    "communicated."
)

HINTS = (
    "With equal shards, the global batch's mean-loss gradient is the mean of the ranks' own gradients. So combine "
    "each parameter's gradient across the ranks, and turn the total into a mean.",

    "dist.all_reduce(p.grad) sums p.grad over all ranks, in place, and leaves the sum on every rank (a sum is its "
    "default op, dist.ReduceOp.SUM). Divide by dist.get_world_size() afterwards, in place (p.grad.div_(...)). "
    "Skip any parameter whose p.grad is None.",

    "n = dist.get_world_size()\n"
    "for p in model.parameters():\n"
    "    if p.grad is None: continue\n"
    "    all_reduce p.grad          # now the sum of the n ranks' gradients, on every rank\n"
    "    p.grad /= n                # the sum becomes the mean: the global batch's gradient",
)


def naive_ddp(model: nn.Module) -> None:
    """The reference: one all_reduce (sum) per gradient, then divide by the world size."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # SUM over ranks ...
            p.grad.div_(world)  # ... / world = the mean over the global batch


def stub(model: nn.Module) -> None:
    """A starting point: replace the body (see ``describe('naive_ddp')``)."""
    raise NotImplementedError(
        "average the gradients over the ranks: after this call every p.grad must be the global batch's gradient, "
        "the same on every rank (exercises.hint('naive_ddp') when stuck)")


# -- the run both sides share ------------------------------------------------------------------------------------
def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same start everywhere, without touching the caller's seed
        torch.manual_seed(0)
        return mlp((FEATURES,), CLASSES, width=WIDTH, depth=1)


def _batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of step ``step``'s global batch (the whole batch for world 1)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, FEATURES, generator=gen), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)
    shard = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[shard], y[shard]


@functools.lru_cache(maxsize=1)
def reference() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """One process on the whole batch: (the gradient at each step, the parameters after each step)."""
    return sgd_reference(_model(), _batch, STEPS, LR)


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One rank's step: its shard's gradient, the gradient after the learner's function, the parameters after."""

    local: torch.Tensor
    synced: torch.Tensor
    params: torch.Tensor
    calls: tuple[Call, ...]


def on_rank(info: Any, fn: Any) -> list[Step]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step, info.rank, info.world_size)
        F.cross_entropy(model(x), y).backward()
        local = flat_grads(model)
        _, calls = call_learner(fn, model, where=f"in step {step}")
        synced = flat_grads(model)
        opt.step()
        steps.append(Step(local, synced, flat_params(model), calls))
    return steps


def judge(n: int, ranks: list[list[Step]]) -> str | None:
    ref_grads, ref_params = reference()
    for s in range(STEPS):
        steps = [r[s] for r in ranks]
        problem = _gradients(s, n, steps, ref_grads[s], ref_params[s]) or _params_moved(s, steps[0], ref_params[s])
        if problem:
            return problem
    for r, steps in enumerate(ranks):
        if not any(call.nbytes for st in steps for call in st.calls):
            return f"rank {r} communicated nothing: the ranks' gradients can only be averaged by communicating."
    return None


@functools.lru_cache(maxsize=1)
def _parameters() -> tuple[tuple[str, int], ...]:
    """Each parameter's name and number of elements, in the order of model.parameters() (and of the flat grads)."""
    return tuple((name, p.numel()) for name, p in _model().named_parameters())


def _what(got: torch.Tensor, ref: torch.Tensor, locals_: list[torch.Tensor], r: int, n: int) -> str | None:
    """What rank r's gradient (all of it, or one parameter's) is when it is not the global batch's; None: it is."""
    if max_abs(got, ref) <= TOL:
        return None
    if max_abs(got, ref * n) <= TOL * n:
        return f"{n}× the global batch's: summed, not averaged (divide the sum by the world size)"
    if max_abs(got, ref / n) <= TOL:
        return (f"1/{n} of the global batch's: divided by the world size twice (all_reduce sums; divide once, after "
                "it)")
    if max_abs(got, locals_[r]) <= TOL:
        return "this rank's own shard's gradient: not averaged over the ranks"
    for k, local in enumerate(locals_):
        if max_abs(got, local) <= TOL:
            return (f"rank {k}'s own shard's gradient: one rank's gradient copied to the others (a broadcast?), not "
                    "the mean of every rank's")
    stacked = torch.stack(locals_)
    for name, combined in (("maximum", stacked.amax(0)), ("minimum", stacked.amin(0))):
        for divisor, words in ((1, ""), (n, ", divided by the world size")):
            if max_abs(got, combined / divisor) <= TOL:
                return (f"the elementwise {name} of the ranks' gradients{words}: reduce with a sum (ReduceOp.SUM, "
                        "all_reduce's default), then divide by the world size")
    return f"off by {max_abs(got, ref):.1e} from the global batch's gradient (the mean of the ranks' gradients)"


def _verdict(r: int, n: int, steps: list[Step], ref: torch.Tensor) -> str | None:
    """Rank r's gradients in words, parameter by parameter where only some are wrong; None when all are right."""
    locals_ = [st.local for st in steps]
    whole = _what(steps[r].synced, ref, locals_, r, n)
    if whole is None or not whole.startswith("off by"):
        return whole
    params, bounds = _parameters(), [0]
    for _, numel in params:
        bounds.append(bounds[-1] + numel)
    wrong: dict[str, list[str]] = {}
    for i, (name, numel) in enumerate(params):
        part = slice(bounds[i], bounds[i + 1])
        what = _what(steps[r].synced[part], ref[part], [x[part] for x in locals_], r, n)
        if what is not None:
            wrong.setdefault(what, []).append(f"{name} ({numel} elements)")
    if len(wrong) != 1 or len(next(iter(wrong.values()))) == len(params):
        return whole
    what, names = next(iter(wrong.items()))
    return (f"right for some parameters only: the gradients of {' and '.join(names)} are {what}; the other "
            "parameters' are right (every parameter's gradient must be averaged)")


def _gradients(s: int, n: int, steps: list[Step], ref_grad: torch.Tensor, ref_params: torch.Tensor) -> str | None:
    verdicts = [_verdict(r, n, steps, ref_grad) for r in range(n)]
    wrong = [r for r, v in enumerate(verdicts) if v is not None]
    if not wrong:
        return None
    r = wrong[0]
    if all(max_abs(st.synced, steps[0].synced) <= TOL for st in steps):
        # the same wrong gradient everywhere: a rank that holds another rank's own says more than that rank
        r = next((k for k in wrong if not verdicts[k].startswith("this rank's own")), r)
        return (f"after step {s} the parameters differ by {max_abs(steps[0].params, ref_params):.1e} from one "
                f"process on the whole batch: the gradients after your function are {verdicts[r]}.")
    if all(torch.equal(st.synced, st.local) for st in steps):
        diff = max_abs(steps[1].synced, steps[0].synced)
        return (f"ranks disagree after step {s}: your function left every rank with its own shard's gradient "
                f"(rank 1's differs from rank 0's by {diff:.1e}). Average them over the ranks: all_reduce each "
                "p.grad (a sum), then divide by the world size.")
    others = [k for k in range(n) if k not in wrong]
    also = f", while rank {others[0]}'s are right" if others else ""
    return (f"ranks disagree after step {s}: after your function rank {r}'s gradients are {verdicts[r]}{also}. "
            "Every rank must end with the same gradient, the global batch's.")


def _params_moved(s: int, st: Step, ref_params: torch.Tensor) -> str | None:
    diff = max_abs(st.params, ref_params)
    if diff <= TOL:
        return None
    return (f"after step {s} the parameters differ by {diff:.1e} from one process on the whole batch although the "
            "gradients match: your function should change only the gradients (p.grad), not the parameters.")


def summary(records: dict[int, list[list[Step]]]) -> str:
    _, ref_params = reference()
    worst = max(max_abs(st.params, ref_params[s]) for ranks in records.values() for steps in ranks
                for s, st in enumerate(steps))
    grad_bytes = ref_params[0].nbytes
    per_n = [f"n={n}: {sum(c.nbytes for c in ranks[0][0].calls):,} bytes in {ops_used(ranks[0][0].calls)}"
             for n, ranks in records.items()]
    return (f"after each of {STEPS} SGD steps at world sizes {', '.join(map(str, records))}, every rank's gradients "
            "were the global batch's and the parameters matched one process on the whole batch (largest difference "
            f"{worst:.1g}). What rank 0's calls carried in a step (the gradients are {grad_bytes:,} bytes): "
            + "; ".join(per_n) + ".")


EXERCISE = Exercise("naive_ddp", DESCRIPTION, on_rank, judge, summary, naive_ddp, stub, hints=HINTS)
