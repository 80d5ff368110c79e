"""Exercise ``fsdp_unit``: one training step of one FSDP unit, its flat parameter sharded over the ranks.

Fully sharded data parallelism (ZeRO-3; the ``fsdp`` tier) keeps a unit's
parameters as one flat vector, zero-padded to a multiple of the world size n and
cut into n equal shards: between steps a rank holds only its shard. For a step
it all-gathers the whole parameter, runs forward and backward on its part of
the batch, and reduce-scatters the whole gradient -- rank r receives shard r of
the sum, which divided by n is the global batch's gradient -- then steps its
shard and frees the whole parameter and gradient (FSDP resizes their storage to
0). A reduce-scatter moves half an all-reduce's bytes and leaves a shard, not a
whole gradient, on each rank. Gathering once per step, as here, is FSDP with
``reshard_after_forward=False``; by default it frees the parameter after forward
and gathers it again for backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.exercises._check import Call, Exercise, ExerciseError, call_learner, ceil_div
from dtlab.exercises._fsdp_kept import GATHERS, SCATTERS, Seen, kept_whole, padding_problem
from dtlab.exercises._reach import places, tensors_made
from dtlab.exercises._values import max_abs, sgd_reference

GLOBAL_BATCH = 24  # divisible by 2 and 4: every rank gets an equal part
FEATURES, WIDTH, CLASSES = 7, 10, 3  # 113 parameters, a prime: padded at every world size
SHAPES = ((WIDTH, FEATURES), (WIDTH,), (CLASSES, WIDTH), (CLASSES,))  # nn.Sequential(Linear, ReLU, Linear)
NUMEL = sum(math.prod(s) for s in SHAPES)
WORLD_SIZES = (2, 4)
STEPS = 4
LR = 0.5
TOL = 1e-5

DESCRIPTION = (
    "Write fn(unit, x: torch.Tensor, y: torch.Tensor, lr: float) -> float: one plain-SGD training step of one FSDP "
    f"unit, a small MLP whose {NUMEL} parameters form one flat float32 vector, zero-padded to unit.padded_numel (a "
    "multiple of the world size n) and sharded over the ranks: between steps a rank holds only unit.shard, elements "
    "rank*s to (rank+1)*s - 1 of it (s = unit.padded_numel // n). unit.forward(full, x) returns the logits of the "
    "MLP whose whole flat parameter is full (unit.padded_numel elements, requiring grad). x and y are this rank's "
    "equal part of the global batch; its loss is F.cross_entropy(logits, y). After fn, unit.shard must hold what "
    "one process's SGD step (p -= lr * p.grad) on the whole global batch's mean loss leaves in those elements; "
    f"return this rank's loss (not judged). Checked at world sizes 2 and 4 over {STEPS} steps: the shards, put "
    f"together, against one process training on the whole batch (within {TOL:g}); each step's communication: one "
    "all-gather of the whole flat parameter (all_gather_into_tensor or all_gather) before unit.forward and one "
    "reduce-scatter of its whole gradient (reduce_scatter_tensor or reduce_scatter) after backward, nothing else; "
    "and that nothing of the whole parameter's size (it, or its gradient) is still alive after the step."
)

HINTS = (
    "Between steps a rank owns 1/n of the parameter; for one step it borrows the rest. Hand the gradient back the "
    "way the parameter came: each rank keeps only its own shard's part, summed over the ranks (the global batch's "
    "gradient is the ranks' mean), and lets the whole parameter go when the step ends.",
    "dist.all_gather_into_tensor(full, unit.shard) into full = torch.empty(unit.padded_numel); "
    "full.requires_grad_(); backward fills full.grad; dist.reduce_scatter_tensor(out, full.grad) leaves shard r of "
    "the sum in out on rank r; unit.shard.sub_(...). Locals die when fn returns; FSDP frees a tensor it keeps with "
    "t.untyped_storage().resize_(0).",
    "def fn(unit, x, y, lr):\n"
    "    full = empty(unit.padded_numel); all_gather_into_tensor(full, unit.shard)\n"
    "    loss = cross_entropy(unit.forward(full.requires_grad_(), x), y); loss.backward()\n"
    "    grad = empty_like(unit.shard); reduce_scatter_tensor(grad, full.grad)\n"
    "    unit.shard -= lr * grad / world_size\n"
    "    return loss.item()  # full and full.grad die with fn's frame",
)


def fsdp_step(unit: FlatUnit, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
    """The reference: gather, forward and backward, reduce-scatter the gradient, SGD on the shard."""
    full = torch.empty(unit.padded_numel)
    dist.all_gather_into_tensor(full, unit.shard)  # shard r lands at [r * s, (r + 1) * s)
    loss = F.cross_entropy(unit.forward(full.requires_grad_(), x), y)
    loss.backward()
    grad = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(grad, full.grad)  # shard r of the sum over the ranks' gradients
    with torch.no_grad():
        unit.shard.sub_(grad, alpha=lr / dist.get_world_size())  # / n: the mean, the global batch's gradient
    return loss.item()  # full and full.grad go with this frame: only the shard outlives the step


def stub(unit: FlatUnit, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
    """A starting point: replace the body (see ``describe('fsdp_unit')``)."""
    raise NotImplementedError(
        "write the FSDP step: gather the whole flat parameter from every rank's unit.shard, run "
        "unit.forward(full, x), the loss and backward, give each rank its shard of the global batch's gradient, "
        "and take an SGD step on unit.shard (exercises.hint('fsdp_unit') when stuck)")


# -- the unit and what it watches --------------------------------------------------------------------------------
class FlatUnit:
    """One FSDP unit on one rank: ``shard`` (its part of the padded flat parameter), ``numel``, ``padded_numel``,
    and ``forward(full, x)``, the MLP run with the whole flat parameter."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.numel = NUMEL
        self.padded_numel = ceil_div(NUMEL, world_size) * world_size
        size = self.padded_numel // world_size
        padded = torch.cat([initial(), torch.zeros(self.padded_numel - NUMEL)])
        self.shard = padded[rank * size:(rank + 1) * size].clone()
        self._seen = Seen(NUMEL)

    def forward(self, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The logits of the MLP whose flat parameter is ``full`` (padded; it must require grad)."""
        if not isinstance(full, torch.Tensor) or full.shape != (self.padded_numel,):
            got = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
            raise ValueError(f"unit.forward(full, x) takes the whole flat parameter gathered from every rank's "
                             f"shard: a 1-D tensor of unit.padded_numel = {self.padded_numel} elements (the "
                             f"{NUMEL} parameters padded to a multiple of the world size); got {got}")
        if not full.requires_grad:
            raise ValueError("unit.forward(full, x): full does not require grad, so backward would not compute its "
                             "gradient: call full.requires_grad_() first")
        self._seen.forward(full)
        full.register_hook(self._seen.gradient)
        w1, b1, w2, b2 = (p.view(s) for p, s in zip(full[:NUMEL].split([math.prod(s) for s in SHAPES]), SHAPES))
        return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


# -- the run both sides share ------------------------------------------------------------------------------------
def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same start everywhere, without touching the caller's seed
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def initial() -> torch.Tensor:
    """The flat parameter before the first step (unpadded), in the order of model.parameters()."""
    return torch.cat([p.detach().reshape(-1) for p in _model().parameters()])


def _batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of step ``step``'s global batch (the whole batch for world 1)."""
    gen = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(GLOBAL_BATCH, FEATURES, generator=gen), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[part], y[part]


@functools.lru_cache(maxsize=1)
def reference() -> tuple[torch.Tensor, ...]:
    """One process on the whole batch with SGD: the flat parameters after each step."""
    return sgd_reference(_model(), _batch, STEPS, LR)[1]


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One rank's step: its shard after, its calls, when it called unit.forward, when backward reached the
    tensor passed to it, and what of the whole parameter's size was still alive after it (where, what, bytes)."""

    shard: torch.Tensor
    calls: tuple[Call, ...]
    forwards: tuple[float, ...]
    grad_at: float | None
    kept: tuple[tuple[str, str, int], ...]


def on_rank(info: Any, fn: Any) -> list[Step]:
    unit, steps = FlatUnit(info.rank, info.world_size), []
    with tensors_made() as made:  # what a step keeps is what it made and left alive
        for s in range(STEPS):
            unit._seen = Seen(NUMEL)
            x, y = (t.clone() for t in _batch(s, info.rank, info.world_size))  # not views of the whole batch
            try:
                value, calls = call_learner(fn, unit, x, y, LR, where=f"in step {s}")
            except ExerciseError as err:
                padding = padding_problem(err.__cause__ or err, unit, info.rank, info.world_size, s)
                if padding is None:
                    raise
                raise ExerciseError(padding) from err
            del value  # a loss tensor would keep its graph, and with it the full parameter, alive
            shard = unit.shard.detach().reshape(-1).clone() if isinstance(unit.shard, torch.Tensor) else torch.empty(0)
            seen = unit._seen  # (the last step's notes go now: its copies are not this step's)
            kept = kept_whole(unit, fn, made, info.rank, info.world_size)
            steps.append(Step(shard, calls, tuple(seen.forwards), seen.grad_at, kept))
    return steps


def judge(n: int, ranks: list[list[Step]]) -> str | None:
    for s in range(STEPS):
        for r, steps in enumerate(ranks):
            problem = _calls(r, s, n, steps[s].calls) or _order(r, s, steps[s])
            if problem:
                return problem
        problem = _parity(s, n, [steps[s].shard for steps in ranks]) or _kept(s, n, [steps[s] for steps in ranks])
        if problem:
            return problem
    return None


def _order(r: int, s: int, st: Step) -> str | None:  # after _calls: one gather and one scatter were made
    if len(st.forwards) != 1:
        return (f"rank {r} called unit.forward {len(st.forwards)} times in step {s}: once per step, then backward, "
                "as one process training on the whole batch does.")
    gather = next(c for c in st.calls if c.op in GATHERS)
    scatter = next(c for c in st.calls if c.op in SCATTERS)
    if gather.start > st.forwards[0]:
        return f"rank {r} all-gathered after calling unit.forward in step {s}: forward needs the gathered parameter."
    if st.grad_at is None or scatter.start < st.grad_at:
        return (f"rank {r} reduce-scattered in step {s} before backward had computed the gradient of the tensor it "
                "passed to unit.forward: that gradient is the one to reduce-scatter, after loss.backward().")
    return None


def _calls(r: int, s: int, n: int, calls: tuple[Call, ...]) -> str | None:
    whole = 4 * ceil_div(NUMEL, n) * n
    for c in calls:
        if c.op == "all_reduce" and c.nbytes >= 4 * NUMEL:
            return (f"rank {r} all-reduced {c.nbytes:,} bytes in step {s}, the whole flat gradient: every rank then "
                    f"receives and holds the whole summed gradient, although it updates only its shard ({whole // n:,} "
                    "bytes), and an all-reduce moves twice the bytes of a reduce-scatter. Reduce-scatter it: each "
                    "rank receives just its shard of the sum.")
        if c.op not in GATHERS | SCATTERS | {"barrier"}:
            return (f"rank {r} called dist.{c.op} in step {s}: an FSDP unit's step needs one all-gather of the "
                    "parameter and one reduce-scatter of its gradient, nothing else.")
    for ops, kind, what in ((GATHERS, "all-gather", "parameter"), (SCATTERS, "reduce-scatter", "gradient")):
        found = [c for c in calls if c.op in ops]
        if len(found) != 1 or found[0].nbytes != whole:
            seen = " and ".join(f"{c.op} of {c.nbytes:,} bytes" for c in found) or f"no {kind}"
            return (f"rank {r} made {seen} in step {s}; expected one {kind} of the whole padded flat {what}, "
                    f"{whole:,} bytes ({whole // 4} float32 elements: {NUMEL} padded to a multiple of {n}). Between "
                    "steps each rank holds only its shard; the global batch's gradient is the mean of the ranks'.")
    return None


def _parity(s: int, n: int, shards: list[torch.Tensor]) -> str | None:
    ref = reference()
    got = torch.cat(shards)[:NUMEL]
    err = max_abs(got, ref[s])
    if err <= TOL:
        return None
    if got.numel() != NUMEL:
        return (f"after step {s} the ranks' unit.shard hold {got.numel()} elements in all; keep each rank's shard "
                f"its {ceil_div(NUMEL, n)} elements.")
    before = ref[s - 1] if s else initial()
    moved, ref_moved = got - before, ref[s] - before
    head = f"after step {s} the shards, put together, differ by {err:.1e} from one process on the whole batch"
    if max_abs(moved, n * ref_moved) <= n * TOL:
        return (f"{head}: they moved {n}× as far, so the gradient is {n}× the global batch's (the sum over the ranks "
                "of each rank's mean-loss gradient): divide by the world size.")
    if max_abs(moved, ref_moved / n) <= TOL:
        return f"{head}: they moved 1/{n} as far: did you divide by the world size twice?"
    if float(moved.abs().max()) == 0:
        return f"{head}: unit.shard did not change; take the SGD step on it (unit.shard -= lr * its gradient)."
    return f"{head}: check the gradient each rank keeps (its shard of the mean over the ranks) and the SGD step."


def _kept(s: int, n: int, steps: list[Step]) -> str | None:
    shard_bytes = 4 * ceil_div(NUMEL, n)
    for r, st in enumerate(steps):
        if not st.kept:
            continue
        what = "; ".join(f"{label} ({nbytes:,} bytes) in {places([where])}" for where, label, nbytes in st.kept[:3])
        return (f"after step {s} rank {r} still holds {what}: the full parameter is kept between steps. An FSDP "
                f"unit keeps only its shard ({shard_bytes:,} bytes here) between steps -- that is its memory saving. "
                "Let the whole parameter and its gradient go when the step ends: keep no reference to them, to a "
                "view, .detach() or .data of them (those share their storage), to a copy of any part of them but "
                "your shard, nor to a loss whose graph reaches them; or free a buffer you keep as FSDP does: "
                "t.untyped_storage().resize_(0).")
    return None


def summary(records: dict[int, list[list[Step]]]) -> str:
    ref = reference()
    worst = max(max_abs(torch.cat([steps[s].shard for steps in ranks])[:NUMEL], ref[s])
                for ranks in records.values() for s in range(STEPS))
    per_n = "; ".join(f"n={n}: {' and '.join(c.op for c in ranks[0][0].calls)} of {4 * ceil_div(NUMEL, n) * n:,} "
                      f"bytes each, a shard of {4 * ceil_div(NUMEL, n):,} bytes" for n, ranks in records.items())
    return (f"over {STEPS} SGD steps at world sizes {', '.join(map(str, records))}, the shards put together matched "
            f"one process training on the whole batch (largest difference {worst:.1g}), and no rank kept the whole "
            f"{NUMEL}-element flat parameter or its gradient between steps. Rank 0's step (the parameter padded to a "
            f"multiple of n, and what a rank holds between steps): {per_n}.")


EXERCISE = Exercise("fsdp_unit", DESCRIPTION, on_rank, judge, summary, fsdp_step, stub, world_sizes=WORLD_SIZES,
                    allowed_world_sizes=WORLD_SIZES, hints=HINTS)
