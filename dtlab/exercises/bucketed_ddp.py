"""Exercise ``bucketed_ddp``: DDP's gradient buckets, each all-reduced while backward is still running.

``naive_ddp`` waits for backward to end, then runs one all_reduce per
parameter: the network is idle during backward, and every small gradient pays
a collective's fixed cost. DistributedDataParallel does better on both counts:

1. **Buckets.** Before training it packs the gradients into buckets of at most
   a few megabytes (``bucket_cap_mb``), in the reverse order of
   ``model.parameters()``: the order backward produces them, last layer
   first. One all_reduce per bucket, not per parameter.
2. **Overlap.** A hook on every parameter runs once its gradient is
   accumulated (``p.register_post_accumulate_grad_hook``). When a bucket's last
   gradient is in, the hook starts the bucket's all_reduce *asynchronously*
   (``async_op=True`` returns a work at once) and backward goes on computing the
   earlier layers' gradients while the bucket travels.
3. **Finish.** After backward, wait on every bucket's work, divide by the world
   size (all_reduce sums) and copy the averages back into each ``p.grad``.

Bigger buckets mean fewer collectives but less overlap (the last bucket can only
start when backward ends); smaller ones, more overlap but more fixed costs. That
is the trade-off ``bucket_cap_mb`` tunes in the ``ddp`` tier.

Packing, precisely: walk the gradients in backward's order and put each into the
current bucket unless that would take the bucket past ``bucket_bytes``; then it
opens a new bucket. A gradient bigger than ``bucket_bytes`` gets a bucket of its
own. (DDP itself closes a bucket only once it *reaches* its cap, so its buckets
may overshoot by one gradient.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.exercises._check import Call, Exercise, ExerciseError, call_learner, ordinal, recorder_now
from dtlab.exercises._values import flat_grads, flat_params, max_abs, sgd_reference

WIDTHS = (16, 32, 24, 12, 4)  # Linear layers 16 -> 32 -> 24 -> 12 -> 4: gradients of very different sizes
GLOBAL_BATCH = 24  # divisible by 2, 3 and 4: every rank gets an equal shard
BUCKET_BYTES = {2: 2048, 3: 1024, 4: 4096}  # a different limit at each world size
STEPS = 10
LR = 0.1
TOL = 1e-5


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same start everywhere, without touching the caller's seed
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
            layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
        return nn.Sequential(*layers)


def ready_order_bytes() -> list[int]:
    """The gradients' sizes in bytes in the order backward produces them: the reverse of model.parameters()."""
    return [p.numel() * p.element_size() for p in reversed(list(_model().parameters()))]


def pack(sizes: Sequence[int], bucket_bytes: int, ddp_rule: bool = False) -> list[int]:
    """Greedy packing in order: each bucket's bytes. A size that would overflow the current bucket opens a new one;
    under ``ddp_rule`` (DDP's own) a bucket stays open until it has reached bucket_bytes, so it may overshoot."""
    buckets: list[int] = []
    for size in sizes:
        if buckets and (buckets[-1] < bucket_bytes if ddp_rule else buckets[-1] + size <= bucket_bytes):
            buckets[-1] += size
        else:
            buckets.append(size)
    return buckets


DESCRIPTION = (
    "Write fn(model: torch.nn.Module, bucket_bytes: int) -> Callable[[], None]: DistributedDataParallel's bucketed "
    "gradient averaging, overlapped with backward. The checker calls fn once per rank, before training, and keeps "
    "what it returns, finish, a function of no arguments. Then, each step, it runs loss.backward() on this rank's "
    "shard of the global batch (equal shards), calls finish() and takes a plain SGD step. After finish() every "
    "p.grad must be the global batch's gradient (the mean of the ranks' gradients) on every rank, the parameters "
    "untouched, step after step. The buckets are fixed: walk the gradients in the order backward produces them, "
    "the reverse of model.parameters(); each joins the current bucket unless that would take it past bucket_bytes "
    "bytes, in which case it opens a new bucket (a gradient bigger than bucket_bytes gets a bucket of its own). "
    "Rules: in every step exactly one dist.all_reduce per bucket, carrying that bucket's bytes (its gradients as "
    "one flat tensor), and no other call; each one asynchronous (async_op=True) and issued while loss.backward() "
    "is still running, not after it returns, and not before backward has computed every gradient it carries. "
    "Checked at world sizes 2 and 3 (bucket_bytes "
    f"{BUCKET_BYTES[2]:,} and {BUCKET_BYTES[3]:,}) over {STEPS} steps of an MLP with layers "
    f"{' -> '.join(map(str, WIDTHS))}: every rank's gradients after finish() and the parameters after every step "
    f"against one process training on the whole batch (within {TOL:g}); the all_reduces of every step, one per "
    "bucket with the bucket's bytes, nothing else; and the overlap: asynchronous, issued before loss.backward() "
    "returned, each after its gradients were computed."
)

HINTS = (
    "Let backward tell you when each gradient is ready. The moment a bucket's last gradient is in, start that "
    "bucket's all_reduce without waiting for it: backward goes on computing the earlier layers' gradients while "
    "the bucket travels. fn sets this up once; finish() only waits for the buckets and writes the averages back, "
    "then makes everything ready for the next step.",

    "p.register_post_accumulate_grad_hook(hook) on every parameter: autograd calls hook(p) once p.grad holds this "
    "step's gradient. Count, per bucket, how many of its gradients are in; when the bucket is complete: flat = "
    "torch.cat([q.grad.reshape(-1) for q in bucket]) and work = dist.all_reduce(flat, async_op=True), which "
    "returns at once; keep (bucket, flat, work). In finish(): work.wait() for each, flat.div_(dist.get_world_size()), "
    "then flat.split([q.numel() for q in bucket]) and q.grad.copy_(part.view_as(q.grad)) for each parameter; clear "
    "the kept works and reset the counts.",

    "fn(model, bucket_bytes):\n"
    "    buckets = []\n"
    "    for p in reversed(list(model.parameters())):    # backward's order\n"
    "        add p to the last bucket if its bytes still fit under bucket_bytes, else open a new bucket [p]\n"
    "    bucket_of[p] = its bucket's index;  ready = [0] * len(buckets);  pending = []\n"
    "    on_ready(p):                                     # registered on every p as its post-accumulate-grad hook\n"
    "        b = bucket_of[p];  ready[b] += 1\n"
    "        if ready[b] == len(buckets[b]):\n"
    "            flat = the bucket's gradients, flattened and concatenated\n"
    "            pending.append((b, flat, all_reduce(flat, async_op=True)))\n"
    "    finish():\n"
    "        for b, flat, work in pending:\n"
    "            work.wait();  flat /= world size\n"
    "            copy flat's pieces back into the p.grad of each parameter of bucket b\n"
    "        pending.clear();  ready = [0] * len(buckets)\n"
    "    return finish",
)


def bucketed_ddp(model: nn.Module, bucket_bytes: int) -> Callable[[], None]:
    """The reference: greedy buckets, last parameter first; each all-reduced (async) by the hook that fills it."""
    world = dist.get_world_size()
    buckets: list[list[nn.Parameter]] = []
    filled = 0  # bytes in the last bucket
    for p in reversed(list(model.parameters())):  # backward's order: the last layer's gradients come first
        nbytes = p.numel() * p.element_size()
        if buckets and filled + nbytes <= bucket_bytes:
            buckets[-1].append(p)
            filled += nbytes
        else:  # it would overflow the bucket (or there is none yet): open a new one
            buckets.append([p])
            filled = nbytes
    bucket_of = {id(p): b for b, params in enumerate(buckets) for p in params}
    ready = [0] * len(buckets)  # gradients in, per bucket, this step
    pending: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []  # (its parameters, flat buffer, work)

    def on_grad_ready(p: torch.Tensor) -> None:  # autograd calls this once p.grad is accumulated
        b = bucket_of[id(p)]
        ready[b] += 1
        if ready[b] == len(buckets[b]):  # the bucket is complete: send it off; backward continues meanwhile
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[b]])
            pending.append((buckets[b], flat, dist.all_reduce(flat, async_op=True)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_grad_ready)

    def finish() -> None:  # after loss.backward(): wait, average, copy back; then reset for the next step
        for params, flat, work in pending:
            work.wait()
            flat.div_(world)  # the sum over ranks / world = the mean over the global batch
            for q, part in zip(params, flat.split([q.numel() for q in params])):
                q.grad.copy_(part.view_as(q.grad))
        pending.clear()
        ready[:] = [0] * len(buckets)

    return finish


def stub(model: nn.Module, bucket_bytes: int) -> Callable[[], None]:
    """A starting point: replace the body (see ``describe('bucketed_ddp')``)."""
    raise NotImplementedError(
        "pack the parameters into buckets of at most bucket_bytes, communicate each bucket while backward still "
        "runs, and return finish(), after which every p.grad is the global batch's gradient "
        "(exercises.hint('bucketed_ddp') when stuck)")


# -- the run both sides share ------------------------------------------------------------------------------------
def _batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of step ``step``'s global batch (the whole batch for world 1)."""
    gen = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(GLOBAL_BATCH, WIDTHS[0], generator=gen)
    y = torch.randint(0, WIDTHS[-1], (GLOBAL_BATCH,), generator=gen)
    shard = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[shard], y[shard]


@functools.lru_cache(maxsize=1)
def reference() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """One process on the whole batch: (the gradient at each step, the parameters after each step)."""
    return sgd_reference(_model(), _batch, STEPS, LR)


# -- on a rank ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One rank's step: the gradients after finish(), the parameters after SGD, the calls, when backward returned."""

    synced: torch.Tensor
    params: torch.Tensor
    calls: tuple[Call, ...]
    backward_end: float
    computed: tuple[float, ...]  # when backward computed each gradient, in the order of model.parameters()


def _backward_then_finish(loss: torch.Tensor, finish: Callable[[], None]) -> float:
    loss.backward()  # the learner's hooks run in here
    backward_end = recorder_now()
    finish()
    return backward_end


def on_rank(info: Any, fn: Any) -> list[Step]:
    model = _model()
    computed: dict[int, float] = {}
    for i, p in enumerate(model.parameters()):  # registered before the learner's hooks, so these run first
        p.register_hook(functools.partial(_stamp, computed, i))
    finish, _ = call_learner(fn, model, BUCKET_BYTES[info.world_size], where="when setting up")
    if not callable(finish):
        raise ExerciseError(f"rank {info.rank}: your function returned {finish!r}; it must return finish, a function "
                            "of no arguments that the checker calls after each loss.backward()")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        computed.clear()
        x, y = _batch(step, info.rank, info.world_size)
        loss = F.cross_entropy(model(x), y)
        backward_end, calls = call_learner(_backward_then_finish, loss, finish, where=f"in step {step}")
        synced = flat_grads(model)
        opt.step()
        stamps = tuple(computed.get(i, math.inf) for i in range(len(list(model.parameters()))))
        steps.append(Step(synced, flat_params(model), calls, backward_end, stamps))
    return steps


def _stamp(computed: dict[int, float], i: int, grad: torch.Tensor) -> None:
    """A tensor hook: backward has just computed parameter i's gradient (before it is accumulated into p.grad)."""
    computed[i] = recorder_now()


# -- judging -----------------------------------------------------------------------------------------------------
def judge(n: int, ranks: list[list[Step]]) -> str | None:
    ref_grads, ref_params = reference()
    for s in range(STEPS):
        steps = [r[s] for r in ranks]
        problem = (_forbidden(s, steps) or _after_backward(s, steps) or _not_reset(s, steps, [r[0] for r in ranks])
                   or _too_early(s, steps) or _parity(s, n, steps, ref_grads[s], ref_params[s])
                   or _bucketing(s, n, steps) or _blocking(s, steps))
        if problem:
            return problem
    return None


def _forbidden(s: int, steps: list[Step]) -> str | None:
    for r, st in enumerate(steps):
        for call in st.calls:
            if call.op != "all_reduce":
                return (f"rank {r} called dist.{call.op} in step {s}: averaging the gradients takes one all_reduce "
                        "(async_op=True) per bucket and nothing else.")
    return None


def _parity(s: int, n: int, steps: list[Step], ref_grad: torch.Tensor, ref_params: torch.Tensor) -> str | None:
    for r, st in enumerate(steps[1:], 1):
        if (diff := max_abs(st.synced, steps[0].synced)) > TOL:
            return (f"ranks disagree after step {s}: after finish() rank {r}'s gradients differ from rank 0's by "
                    f"{diff:.1e}; every rank must end with the same gradients, the global batch's (every bucket "
                    "all-reduced, every p.grad overwritten with its bucket's average).")
    synced = steps[0].synced
    if (err := max_abs(synced, ref_grad)) > TOL:
        if max_abs(synced, ref_grad * n) <= TOL * n:
            hint = (f"they are {n}× the global batch's: summed, not averaged. finish() must divide each bucket's sum "
                    "by the world size.")
        else:
            hint = (f"they differ by {err:.1e} from the whole batch's gradient (the mean of the ranks' gradients): "
                    "finish() must wait on every bucket's work, divide it by the world size and copy each part back "
                    "into the p.grad it came from.")
        return f"after step {s} the gradients left by finish() are wrong: {hint}"
    if (diff := max_abs(steps[0].params, ref_params)) > TOL:
        return (f"after step {s} the parameters differ by {diff:.1e} from one process on the whole batch although "
                "the gradients match: change only the gradients (p.grad), not the parameters.")
    return None


def bucket_list(sizes: Sequence[int]) -> str:
    """'3 buckets (1,504, 3,072 and 128 bytes)'."""
    listed = [f"{b:,}" for b in sizes]
    joined = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
    return f"{len(sizes)} bucket{'s' * (len(sizes) != 1)} ({joined} bytes)"


def _bucketing(s: int, n: int, steps: list[Step]) -> str | None:
    cap, sizes = BUCKET_BYTES[n], ready_order_bytes()
    expected = pack(sizes, cap)
    for r, st in enumerate(steps):
        got = [call.nbytes for call in st.calls]
        if got == expected:
            continue
        head = (f"rank {r} all-reduced {bucket_list(got) if got else 'nothing'} in step {s}; with bucket_bytes="
                f"{cap:,} the gradients, in the order backward produces them (the reverse of model.parameters(): "
                f"{', '.join(f'{b:,}' for b in sizes)} bytes), pack into {bucket_list(expected)}.")
        if got == [sum(sizes)]:
            hint = (" One bucket holds everything, so nothing travels until the last gradient is in: open a new "
                    "bucket whenever the next gradient would take the current one past bucket_bytes.")
        elif got == sizes:
            hint = " That is one all_reduce per parameter: pack the gradients into buckets first."
        elif got == pack(sizes, cap, ddp_rule=True):
            hint = (" That is DDP's own rule, a bucket closing once it has reached its cap (so it overshoots); here a "
                    "bucket never goes past bucket_bytes: the gradient that would take it past opens the next one.")
        elif sorted(got) == sorted(expected):
            hint = " The right buckets in another order: all-reduce each one as soon as its last gradient is in."
        else:
            hint = (" Each gradient joins the current bucket unless that takes it past bucket_bytes; then it opens "
                    "a new one (a gradient bigger than bucket_bytes gets a bucket of its own).")
        return head + hint
    return None


def _after_backward(s: int, steps: list[Step]) -> str | None:
    for r, st in enumerate(steps):
        late = [call for call in st.calls if call.start >= st.backward_end]
        if not late:
            continue
        if len(late) == len(st.calls):
            return (f"your buckets are reduced after backward: nothing overlaps. In step {s} rank {r} issued all "
                    f"{len(st.calls)} of its all_reduces after loss.backward() had returned. Issue each bucket's "
                    "all_reduce (async_op=True) from the hook that completes the bucket "
                    "(p.register_post_accumulate_grad_hook), while backward still runs, and only wait in finish().")
        sizes = ", ".join(f"{call.nbytes:,}" for call in late)
        return (f"in step {s} rank {r} issued {len(late)} of its {len(st.calls)} all_reduces ({sizes} bytes) after "
                "loss.backward() had returned, in finish(): every all_reduce starts from the hook that completes "
                "its bucket, while backward runs; finish() only waits on them and writes the averages back.")
    return None


def _not_reset(s: int, steps: list[Step], firsts: list[Step]) -> str | None:
    for r, (st, first) in enumerate(zip(steps, firsts)):
        if s and first.calls and not st.calls:
            return (f"in step {s} rank {r} issued no all_reduce (in step 0 it issued {len(first.calls)}): no bucket "
                    "was complete again. finish() must reset what counts the gradients in (and clear the pending "
                    "works) for the next step.")
    return None


def _too_early(s: int, steps: list[Step]) -> str | None:
    """Each all_reduce may carry only gradients that backward had computed when it was issued."""
    sizes = [p.numel() * p.element_size() for p in _model().parameters()]
    for r, st in enumerate(steps):
        carried = 0
        for k, call in enumerate(sorted(st.calls, key=lambda c: c.start)):
            carried += call.nbytes
            ready = sum(size for size, t in zip(sizes, st.computed) if t <= call.start)
            if carried > ready:
                return (f"in step {s} rank {r} issued its {ordinal(k + 1)} all_reduce ({call.nbytes:,} bytes) when "
                        f"backward had computed only {ready:,} bytes of gradients, fewer than its all_reduces had "
                        f"carried by then ({carried:,}): it sent a bucket before all of its gradients were ready. "
                        "Count each bucket's gradients in, and issue its all_reduce from the hook of its last one.")
    return None


def _blocking(s: int, steps: list[Step]) -> str | None:
    for r, st in enumerate(steps):
        for k, call in enumerate(st.calls):
            if not call.is_async:
                return (f"rank {r}'s all_reduce of bucket {k + 1} ({call.nbytes:,} bytes) in step {s} was blocking: "
                        "backward stood still until it had finished. Pass async_op=True, keep the work it returns, "
                        "and wait on it in finish().")
    return None


def summary(records: dict[int, list[list[Step]]]) -> str:
    _, ref_params = reference()
    worst = max(max_abs(st.params, ref_params[s]) for ranks in records.values() for steps in ranks
                for s, st in enumerate(steps))
    per_n = [f"n={n} (bucket_bytes={BUCKET_BYTES[n]:,}): {bucket_list(pack(ready_order_bytes(), BUCKET_BYTES[n]))}"
             for n in records]
    lead = min(st.backward_end - min(c.start for c in st.calls) for ranks in records.values() for steps in ranks
               for st in steps)
    return (f"after each of {STEPS} SGD steps at world sizes {', '.join(map(str, records))}, every rank's gradients "
            "after finish() were the global batch's and the parameters matched one process on the whole batch "
            f"(largest difference {worst:.1g}). All-reduces per step, one per bucket, asynchronous, the first "
            f"issued at least {lead * 1e3:.1f} ms before backward returned: " + "; ".join(per_n) + ".")


EXERCISE = Exercise("bucketed_ddp", DESCRIPTION, on_rank, judge, summary, bucketed_ddp, stub, world_sizes=(2, 3),
                    allowed_world_sizes=(2, 3, 4), hints=HINTS)
