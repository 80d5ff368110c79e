"""Exercise ``zero1_step``: one Adam step under ZeRO stage 1, the optimizer state sharded over the ranks.

Adam keeps two tensors per parameter (m and v, the moments): twice the
parameters' memory, on every rank in plain data parallelism. ZeRO stage 1
(Rajbhandari et al., 2020; ``torch.distributed.optim.ZeroRedundancyOptimizer``,
the ``zero`` tier) shards that state instead:

1. Rank r *owns* some parameters -- here parameter i when i % n == r
   (round-robin) -- and keeps m and v for those only: about 1/n of the state.
2. Every rank holds the same averaged gradients (data parallelism already
   all-reduced them), so each owner updates its own parameters with Adam.
3. The owners send the updated parameters to everyone: ``dist.broadcast(params[i],
   src=i % n)`` for each i (or an all_gather of the updated shards). Every rank
   then has every parameter updated, exactly as if each had run full Adam.

Adam, as ``torch.optim.Adam`` computes it: with t the step count from 1,
m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g², m̂ = m / (1 - b1^t),
v̂ = v / (1 - b2^t), p -= lr m̂ / (sqrt(v̂) + eps); b1 = 0.9, b2 = 0.999, eps = 1e-8.

The saving costs one broadcast of the parameters per step: each rank takes part
in broadcasts carrying the parameters' bytes.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtlab.exercises._check import Call, Exercise, call_learner, ceil_div, ops_used
from dtlab.exercises._values import max_abs
from dtlab.exercises._weigh import Kept, kept, live_tensors

# 13 parameters of about 40 elements (557 in all, a prime): round-robin shares stay near 1/n of the state
SHAPES = ((6, 8), (40,), (5, 9), (7, 7), (48,), (6, 6), (4, 11), (43,), (8, 5), (39,), (3, 13), (45,), (41,))
PARAM_BYTES = 4 * sum(math.prod(s) for s in SHAPES)  # float32
LARGEST_BYTES = 4 * max(math.prod(s) for s in SHAPES)
OFFSETS = tuple(itertools.accumulate((math.prod(s) for s in SHAPES), initial=0))  # parameter i: OFFSETS[i:i + 2]
STEPS = 5
LR = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-8
TOL = 1e-6
# A rank's state may hold, for the parameters it owns, m, v and a copy of the parameter (an optimizer stepping a
# flat shard needs one), plus a step count per parameter (torch.optim.Adam keeps it as a tensor).
STATE_COPIES = 3
SCALAR_BYTES = 8
SHARING = frozenset({"broadcast", "all_gather", "all_gather_into_tensor"})
ALLOWED = SHARING | {"barrier"}
MAX_TRAFFIC = 1.25  # times the parameters' bytes, per rank and step (padding an all_gather costs a little)

DESCRIPTION = (
    "Write fn(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: float) -> None: one Adam "
    "step under ZeRO stage 1, the optimizer state sharded over the ranks. Every rank gets the same parameters "
    "(update them in place) and the same, already averaged, gradients; state is this rank's own dict, empty at "
    "the first call and the same object at every later one: keep all optimizer state in it (the checker weighs "
    "it, and every other tensor the rank still holds after its last call). After fn, every rank's parameters "
    "must be what torch.optim.Adam (betas (0.9, 0.999), eps 1e-8) gives on one process: with t the step count "
    "from 1, m = b1*m + (1 - b1)*g, v = b2*v + (1 - b2)*g*g, m_hat = m / (1 - b1**t), v_hat = v / (1 - b2**t), "
    "p -= lr * m_hat / (sqrt(v_hat) + eps). Rules: a rank's state holds only its share, about 1/n of Adam's m and "
    "v (n = dist.get_world_size(); how the state is split is up to you), so no rank can run full Adam on every "
    "parameter; the only calls are broadcasts and all-gathers (dist.broadcast, dist.all_gather, "
    "dist.all_gather_into_tensor; a barrier is allowed too), carrying about the parameters' bytes per step, at "
    f"most {MAX_TRAFFIC:g}× them. Checked at world sizes 2, 3 and 4 over {STEPS} steps with {len(SHAPES)} "
    "parameters of about 40 elements: the parameters on every rank against torch.optim.Adam on one process "
    f"(within {TOL:g}); what each rank keeps between calls, its state dict and any other tensor, gradients left in "
    "a .grad included (at most 1/n of m, v and a copy of the parameters, plus one largest parameter's); and the "
    "communication (its kind, and its bytes per step)."
)

HINTS = (
    "Give every parameter one owner rank. Each rank runs Adam only on the parameters it owns, keeping their m and v "
    "and nothing else; then every owner hands its freshly updated parameters to all the other ranks, so that every "
    "rank ends the step with every parameter updated.",

    "rank, n = dist.get_rank(), dist.get_world_size(). A simple split is round-robin: rank r owns parameter i when "
    "i % n == r, that is range(rank, len(params), n). Keep a step count in state (state['t']) and, per owned "
    "parameter, state[i] = {'m': torch.zeros_like(p), 'v': torch.zeros_like(p)}, created at the first call. "
    "Update in place: m.mul_(b1).add_(g, alpha=1 - b1), v.mul_(b2).addcmul_(g, g, value=1 - b2), "
    "params[i].sub_(lr * m_hat / (v_hat.sqrt() + eps)). Then, for every i, dist.broadcast(params[i], src=i % n): "
    "the owner sends, every other rank receives into its own copy. (Another design: each rank owns a contiguous "
    "slice of the flattened parameters and dist.all_gather_into_tensor collects the updated slices.)",

    "r, n = dist.get_rank(), dist.get_world_size()\n"
    "t = state['t'] = state.get('t', 0) + 1\n"
    "for i in range(r, len(params), n):          # the parameters rank r owns\n"
    "    m, v = state[i] (zeros like params[i] at the first step)\n"
    "    m = b1*m + (1 - b1)*grads[i];  v = b2*v + (1 - b2)*grads[i]**2      (in place)\n"
    "    params[i] -= lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)\n"
    "for i, p in enumerate(params):\n"
    "    broadcast p from its owner, rank i % n, to every rank",
)


def zero1_step(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: float) -> None:
    """The reference: Adam on the parameters this rank owns (i % n == rank), then a broadcast from each owner."""
    rank, n = dist.get_rank(), dist.get_world_size()
    b1, b2 = BETAS
    t = state["t"] = state.get("t", 0) + 1
    for i in range(rank, len(params), n):  # the parameters this rank owns
        if i not in state:
            state[i] = {"m": torch.zeros_like(params[i]), "v": torch.zeros_like(params[i])}
        m, v, g = state[i]["m"], state[i]["v"], grads[i]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        params[i].sub_(lr * m_hat / (v_hat.sqrt() + EPS))
    for i, p in enumerate(params):  # each parameter, from its owner, to every rank
        dist.broadcast(p, src=i % n)


def stub(params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: float) -> None:
    """A starting point: replace the body (see ``describe('zero1_step')``)."""
    raise NotImplementedError(
        "write ZeRO-1: one Adam step in which each rank keeps Adam's state for its share of the parameters only, "
        "and every rank ends with all the updated parameters (exercises.hint('zero1_step') when stuck)")


# -- the run both sides share ------------------------------------------------------------------------------------
def _initial() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=gen) * 0.5 for shape in SHAPES]


def _gradients(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


@functools.lru_cache(maxsize=1)
def reference() -> tuple[torch.Tensor, ...]:
    """torch.optim.Adam on one process: the flat parameters after each step."""
    params = _initial()
    opt = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS)
    out = []
    for step in range(STEPS):
        for p, g in zip(params, _gradients(step)):
            p.grad = g
        opt.step()
        out.append(_flat(params))
    return tuple(out)


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One rank's run: its flat parameters and its calls at each step, and what it kept at the end."""

    params: tuple[torch.Tensor, ...]
    calls: tuple[tuple[Call, ...], ...]
    kept: Kept


def on_rank(info: Any, fn: Any) -> Record:
    params, state = _initial(), {}
    before = live_tensors()
    flats, calls = [], []
    for step in range(STEPS):
        _, made = call_learner(fn, params, _gradients(step), state, LR, where=f"in step {step}")
        flats.append(_flat(params))
        calls.append(made)
    return Record(tuple(flats), tuple(calls), kept(state, before, [*params, *flats]))


def judge(n: int, ranks: list[Record]) -> str | None:
    return _forbidden(ranks) or _parity(ranks) or _state(n, ranks) or _traffic(ranks)


def _forbidden(ranks: list[Record]) -> str | None:
    for r, rec in enumerate(ranks):
        for s, calls in enumerate(rec.calls):
            for call in calls:
                if call.op not in ALLOWED:
                    return (f"rank {r} called dist.{call.op} in step {s}: ZeRO-1 shares the updated parameters with "
                            "broadcast (each from its owner) or all_gather; the gradients come already averaged, "
                            "so nothing else needs communicating.")
    return None


def _first_off(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float] | None:
    """The first parameter (index, difference) where two flat parameter vectors differ by more than TOL."""
    for i in range(len(SHAPES)):
        lo, hi = OFFSETS[i], OFFSETS[i + 1]
        diff = max_abs(a[lo:hi], b[lo:hi])
        if diff > TOL:
            return i, diff
    return None


def _parity(ranks: list[Record]) -> str | None:
    ref = reference()
    for s in range(STEPS):
        for r, rec in enumerate(ranks[1:], 1):
            if off := _first_off(rec.params[s], ranks[0].params[s]):
                return (f"after step {s}, rank {r}'s copy of parameter {off[0]} differs from rank 0's by "
                        f"{off[1]:.1e}: every rank must end each step with every parameter updated. Its owner "
                        "updates it and sends it to all (dist.broadcast(params[i], src=owner), or all_gather the "
                        "updated shards).")
        if off := _first_off(ranks[0].params[s], ref[s]):
            i, diff = off
            before = ranks[0].params[s - 1] if s else _flat(_initial())
            if max_abs(ranks[0].params[s][OFFSETS[i]:OFFSETS[i + 1]], before[OFFSETS[i]:OFFSETS[i + 1]]) == 0:
                return (f"parameter {i} was not updated in step {s}: its owner (rank i % n) must update it with "
                        f"Adam and send it to every rank.{_one_source(s, ranks)}")
            return (f"after step {s}, parameter {i} {tuple(SHAPES[i])} differs by {diff:.1e} from full Adam on one "
                    f"process (torch.optim.Adam, lr={LR}, betas={BETAS}, eps={EPS:g}): check the updates of m and "
                    "v, the bias corrections 1 - b1**t and 1 - b2**t with t counting steps from 1, and eps added "
                    "after the square root.")
    return None


def _one_source(s: int, ranks: list[Record]) -> str:
    """When every broadcast of a step came from one rank: what that means."""
    sources = {call.peer for call in ranks[0].calls[s] if call.op == "broadcast"}
    if len(ranks) < 2 or len(sources) != 1:
        return ""
    src = sources.pop()
    return (f" Every broadcast in step {s} came from rank {src}, which sent its own copies, updated or not: each "
            "parameter must come from the rank that updated it.")


def state_limit(n: int) -> int:
    """The most state bytes a rank may hold at world size n: its share, plus one largest parameter's."""
    return ceil_div(STATE_COPIES * PARAM_BYTES, n) + STATE_COPIES * LARGEST_BYTES + SCALAR_BYTES * len(SHAPES)


def _state(n: int, ranks: list[Record]) -> str | None:
    full, limit = 2 * PARAM_BYTES, state_limit(n)
    for r, rec in enumerate(ranks):
        k = rec.kept
        if k.total <= limit:
            continue
        where = (f", {k.outside:,} of them outside the state dict (in a global, a closure or an attribute)"
                 if k.outside else "")
        return (f"rank {r} keeps {k.total:,} bytes between steps{where}; Adam's full state (m and v for all "
                f"{len(SHAPES)} parameters) is {full:,} bytes.{_what_is_kept(k)} Under ZeRO-1 a rank keeps state "
                f"only for the parameters it owns, about 1/{n} of it: at most {limit:,} bytes here (1/{n} of m, v and "
                "a copy of the parameters, plus one largest parameter's).")
    total = sum(rec.kept.in_state for rec in ranks)
    if total < full:
        elsewhere = sum(rec.kept.outside for rec in ranks)
        aside = f" ({elsewhere:,} bytes were kept outside it)" if elsewhere else ""
        return (f"the state dicts of all ranks together hold {total:,} bytes{aside}, less than the {full:,} bytes of m "
                "and v that Adam needs: keep each owned parameter's m and v in the state dict your function receives "
                "(the checker weighs it).")
    return None


def _what_is_kept(k: Kept) -> str:
    """What the kept tensors' shapes and .grads say: state for every parameter, a flat copy of them all, gradients."""
    per = min(sum(shape == s for shape in k.shapes) for s in SHAPES)
    total = sum(math.prod(s) for s in SHAPES)
    if per:
        said = (f" It keeps {per} tensor{'s' * (per > 1)} shaped like each of the {len(SHAPES)} parameters: state "
                "(or a copy) for every parameter, not only for its share.")
    elif flat := max((math.prod(s) for s in k.shapes if math.prod(s) >= total), default=0):
        said = f" It keeps a tensor of {flat} elements, as many as all {len(SHAPES)} parameters together ({total})."
    else:
        said = ""
    if k.in_grads:
        said += (f" {k.in_grads:,} of these bytes are gradients left in a tensor's .grad: set it to None once the "
                 "step is done.")
    return said


def _traffic(ranks: list[Record]) -> str | None:
    for r, rec in enumerate(ranks):
        for s, calls in enumerate(rec.calls):
            moved = sum(call.nbytes for call in calls if call.op in SHARING)
            if moved < PARAM_BYTES:
                return (f"rank {r}'s broadcasts and all-gathers in step {s} carried {moved:,} bytes, less than the "
                        f"{PARAM_BYTES:,} bytes of parameters: every updated parameter must reach every rank.")
            if moved > MAX_TRAFFIC * PARAM_BYTES:
                return (f"rank {r}'s broadcasts and all-gathers in step {s} carried {moved:,} bytes, "
                        f"{moved / PARAM_BYTES:.1f}× the parameters' {PARAM_BYTES:,} bytes: each parameter needs to "
                        "leave its owner once per step.")
    return None


def summary(records: dict[int, list[Record]]) -> str:
    ref = reference()
    worst = max(max_abs(p, ref[s]) for ranks in records.values() for rec in ranks for s, p in enumerate(rec.params))
    held = "; ".join(f"n={n}: {'/'.join(f'{rec.kept.total:,}' for rec in ranks)}" for n, ranks in records.items())
    first = records[max(records)][0].calls[0]
    moved = sum(call.nbytes for call in first if call.op in SHARING)
    return (f"over {STEPS} Adam steps at world sizes {', '.join(map(str, records))}, every rank's parameters matched "
            f"torch.optim.Adam on one process (largest difference {worst:.1g}). What each rank kept between steps "
            f"(its state dict and any other tensor), in bytes, of Adam's full {2 * PARAM_BYTES:,}: {held}. At "
            f"n={max(records)} rank 0's {ops_used(first)} carried {moved:,} bytes per step "
            f"({moved / PARAM_BYTES:.2f}× the parameters' {PARAM_BYTES:,} bytes).")


EXERCISE = Exercise("zero1_step", DESCRIPTION, on_rank, judge, summary, zero1_step, stub, hints=HINTS)
