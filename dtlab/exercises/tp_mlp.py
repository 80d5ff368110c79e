"""Exercise ``tp_mlp``: Megatron's tensor-parallel MLP, two linear layers split over the ranks by hand.

Tensor parallelism splits each weight matrix instead of the batch. Megatron-LM
(Shoeybi et al., 2019) pairs the two linear layers of an MLP so that the pair
needs one all-reduce in forward and one in backward:

1. The first layer is split by its *output* features (rows of the nn.Linear
   weight): rank r holds whole hidden units, so ``gelu(x @ w1.T + b1)`` needs no
   communication -- GELU acts on each unit alone.
2. The second layer is split by its *input* features (columns of its weight),
   the same hidden units: ``h @ w2.T`` is rank r's share of the output, and the
   output is the sum of the shares over the ranks (b2 added once, after).

Autograd does not differentiate through ``dist`` calls, so the communication is
written as two ``torch.autograd.Function``\\ s, each the other's mirror image:
g at the output sums in forward and passes the gradient through in backward
(every rank already holds the whole output gradient); f at the input passes x
through in forward and sums in backward (each rank's x.grad is only the share
flowing back through its own hidden units). Applying g's sum in backward too
counts the output gradient n times. The ``tp`` tier runs the same split with
``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises._check import Call, Exercise, call_learner, ops_used
from dtlab.exercises._reach import Fingerprints, Found, HeldWatch, held_values, places
from dtlab.exercises._values import max_abs, scale_factor, world_factor

BATCH, D_IN, HIDDEN, D_OUT = 8, 12, 40, 6  # every size a call could carry differs at n = 2 and 4 (see _sized)
WORLD_SIZES = (2, 4)  # HIDDEN splits evenly
TOL = 2e-5
GRADS = ("x", "w1", "b1", "w2", "b2")
OUT_BYTES, IN_BYTES = 4 * BATCH * D_OUT, 4 * BATCH * D_IN

DESCRIPTION = (
    "Write fn(x, w1, b1, w2, b2) -> torch.Tensor: the forward of an MLP y = gelu(x @ W1.T + b1) @ W2.T + b2 (exact "
    "F.gelu), its weights split over the n ranks as Megatron-LM's tensor parallelism splits them, and differentiable: "
    "the checker calls y.backward() on your output. x (batch × d_in) is the same on every rank and requires grad. "
    "Rank r holds the hidden units r*H/n to (r+1)*H/n - 1: w1 is those rows of W1 (H × d_in, nn.Linear's out × in "
    "layout), b1 the same entries of b1, w2 the same columns of W2 (d_out × H); b2 is whole on every rank. Every "
    "rank must return the whole output, and no rank may hold another rank's part of W1 or W2. Autograd does not see "
    "dist calls: write the communication as torch.autograd.Function subclasses (a static forward and backward "
    f"each). Checked at world sizes 2 and 4 with batch {BATCH}, d_in {D_IN}, H {HIDDEN}, d_out {D_OUT}: every "
    "rank's output and its gradients (x.grad, and the gradients of w1, b1, w2 and b2) against the unsplit MLP's, "
    f"sliced as the shards are (within {TOL:g}); the communication: exactly one all_reduce in the forward and "
    "exactly one in the backward, nothing else; and, at every line of your code, that the values of no other "
    "rank's rows of W1 or columns of W2 are within its reach."
)

HINTS = (
    "Rank r owns whole hidden units, so its first layer and GELU need no communication; its second layer yields "
    "only a share of the output, and in backward only a share of x's gradient reaches x. Decide where each sum over "
    "the ranks belongs: in forward, or in backward.",
    "A sum in forward needs none in backward (every rank holds the same output gradient), and the other way round. "
    "class Sum(torch.autograd.Function) with @staticmethod forward(ctx, t) and backward(ctx, grad), used as "
    "Sum.apply(t); dist.all_reduce(t) sums in place, so all-reduce a clone (t.clone()); F.linear(x, w, b) is x @ "
    "w.T + b; F.gelu.",
    "class SumForward(Function): forward: out = t.clone(); all_reduce(out); return out. backward: return grad.\n"
    "class SumBackward(Function): forward: return t. backward: g = grad.clone(); all_reduce(g); return g.\n"
    "def fn(x, w1, b1, w2, b2):\n"
    "    h = gelu(linear(SumBackward.apply(x), w1, b1))\n"
    "    return SumForward.apply(linear(h, w2)) + b2",
)


class _CopyToRanks(torch.autograd.Function):
    """Megatron's f: x as it is in forward; in backward, the sum over the ranks of their shares of x's gradient."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()  # the engine may reuse grad elsewhere: sum a copy
        dist.all_reduce(total)
        return total


class _SumOverRanks(torch.autograd.Function):
    """Megatron's g: the sum over the ranks in forward; in backward the gradient as it is (each rank has all of it)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        total = t.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def tp_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """The reference: this rank's hidden units, its share of the output, summed over the ranks, plus b2 once."""
    h = F.gelu(F.linear(_CopyToRanks.apply(x), w1, b1))
    return _SumOverRanks.apply(F.linear(h, w2)) + b2


def stub(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """A starting point: replace the body (see ``describe('tp_mlp')``)."""
    raise NotImplementedError(
        "write the tensor-parallel MLP: compute with this rank's shards, and put the communication in "
        "torch.autograd.Function subclasses so that every rank returns the whole output and x.grad is the unsplit "
        "MLP's (exercises.hint('tp_mlp') when stuck)")


# -- the run both sides share ------------------------------------------------------------------------------------
def _full() -> dict[str, torch.Tensor]:
    """The unsplit MLP's weights, the input and the output's gradient (the same on every rank)."""
    gen = torch.Generator().manual_seed(11)
    return {"x": torch.randn(BATCH, D_IN, generator=gen), "w1": torch.randn(HIDDEN, D_IN, generator=gen) * 0.3,
            "b1": torch.randn(HIDDEN, generator=gen) * 0.1, "w2": torch.randn(D_OUT, HIDDEN, generator=gen) * 0.3,
            "b2": torch.randn(D_OUT, generator=gen) * 0.1, "gy": torch.randn(BATCH, D_OUT, generator=gen)}


def _shard(full: dict[str, torch.Tensor], rank: int, n: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s arguments: copies of its slices, every one a leaf that requires grad."""
    units = slice(rank * HIDDEN // n, (rank + 1) * HIDDEN // n)
    parts = {"x": full["x"], "w1": full["w1"][units], "b1": full["b1"][units], "w2": full["w2"][:, units],
             "b2": full["b2"]}
    return {k: v.clone().requires_grad_() for k, v in parts.items()}


def _mlp(a: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(a["x"], a["w1"], a["b1"])), a["w2"])


@functools.lru_cache(maxsize=4)
def reference(n: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """The unsplit MLP at n ranks: (its output, each rank's slices of its gradients, each rank's share of x.grad)."""
    full = _full()
    whole = {k: v.clone().requires_grad_() for k, v in full.items() if k != "gy"}
    y = _mlp(whole) + whole["b2"]
    y.backward(full["gy"])
    grads = [_shard({k: v.grad for k, v in whole.items()}, r, n) for r in range(n)]
    shares = []
    for r in range(n):  # the part of x's gradient that flows back through rank r's hidden units alone
        mine = _shard(full, r, n)
        _mlp(mine).backward(full["gy"])
        shares.append(mine["x"].grad)
    return y.detach(), [{k: v.detach() for k, v in g.items()} for g in grads], shares


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One rank's run: its output and gradients, the calls of forward and of backward, or what stopped the run;
    ``foreign``: when and where it first held another rank's part of W1 or W2 (None: never)."""

    y: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    forward: tuple[Call, ...]
    backward: tuple[Call, ...]
    problem: str | None = None
    foreign: str | None = None


class _ForeignShards:
    """Whether the learner's code holds another rank's rows of W1 or columns of W2, found by their values at every
    line it runs (a ``HeldWatch`` probe): a rank that gathered the weights to compute the whole MLP holds them,
    whatever it called the gather and however it stored them."""

    def __init__(self, full: dict[str, torch.Tensor], rank: int, n: int) -> None:
        self.names, parts = [], []
        for s in range(n):
            units = slice(s * HIDDEN // n, (s + 1) * HIDDEN // n)
            if s != rank:
                self.names += [f"rank {s}'s rows of W1", f"rank {s}'s columns of W2"]
                parts += [full["w1"][units], full["w2"][:, units]]
        self.prints = Fingerprints(parts)
        self.first: str | None = None

    def __call__(self, found: list[Found], moment: str) -> None:
        if self.first is not None:
            return
        held = [name for name, share in zip(self.names, self.prints.shares(held_values(found))) if share > 0.99]
        if held:
            where = [f.where for f in found if self.prints.shares(held_values([f])).max() > 0.99]
            self.first = f"{' and '.join(held[:2])} {moment} (in {places(where, 3)})"


def on_rank(info: Any, fn: Any) -> Record:
    full = _full()
    args = _shard(full, info.rank, info.world_size)
    foreign = _ForeignShards(full, info.rank, info.world_size)
    with HeldWatch(foreign, fn):
        y, forward = call_learner(fn, *args.values(), where="in forward")
    problem = _not_an_output(y)
    if problem:
        return Record(None, {}, forward, (), f"rank {info.rank}'s {problem}", foreign.first)
    with HeldWatch(foreign, fn):
        _, backward = call_learner(y.backward, full["gy"], where="in backward (y.backward)")
    grads = {k: None if v.grad is None else v.grad.detach().clone() for k, v in args.items()}
    return Record(y.detach().clone(), grads, forward, backward, None, foreign.first)


def _not_an_output(y: Any) -> str | None:
    if not isinstance(y, torch.Tensor):
        return f"function returned {type(y).__name__}, not a tensor: return the MLP's whole output y"
    if tuple(y.shape) != (BATCH, D_OUT):
        return (f"output has shape {tuple(y.shape)}; the MLP's whole output is ({BATCH}, {D_OUT}), on every rank "
                "(batch × d_out)")
    if not y.requires_grad:
        return ("output does not require grad: the checker calls y.backward(), so y must come from x and the "
                "shards through autograd (no torch.no_grad, no .detach())")
    return None


def judge(n: int, ranks: list[Record]) -> str | None:
    for r, rec in enumerate(ranks):
        if rec.foreign:
            return (f"rank {r} held {rec.foreign}. In tensor parallelism each rank holds only its 1/n of W1 and W2 "
                    "-- that is what lets a layer too large for one device fit -- and never gathers the others': "
                    "compute with your shards, then sum the ranks' shares of the output (one all_reduce).")
    problem = next((rec.problem for rec in ranks if rec.problem), None)
    if problem:
        return problem
    for r, rec in enumerate(ranks):
        problem = _forward_calls(r, n, rec.forward) or _output(r, n, rec.y)
        if problem:
            return problem
    for r, rec in enumerate(ranks):
        problem = _gradients(r, n, rec.grads) or _backward_calls(r, n, rec.backward)
        if problem:
            return problem
    return None


def _sized(nbytes: int, n: int) -> str:
    """What a call of ``nbytes`` bytes carried, in this MLP's terms."""
    names = {OUT_BYTES: f"the output's size, {BATCH} × {D_OUT}", IN_BYTES: f"the input's size, {BATCH} × {D_IN}",
             4 * BATCH * HIDDEN // n: f"this rank's hidden activation, {BATCH} × {HIDDEN // n}",
             4 * BATCH * HIDDEN: f"the whole hidden activation, {BATCH} × {HIDDEN}"}
    return f"{nbytes:,} bytes ({names[nbytes]} float32)" if nbytes in names else f"{nbytes:,} bytes"


def _forward_calls(r: int, n: int, calls: tuple[Call, ...]) -> str | None:
    other = next((c for c in calls if c.op != "all_reduce"), None)
    if other:
        return f"rank {r} called dist.{other.op} in forward: this MLP needs one all_reduce there, nothing else."
    if not calls:
        return (f"rank {r} made no all_reduce in forward, so its output can only be its own share of the unsplit "
                "output: the part computed from its hidden units. The whole output is the sum of every rank's share "
                "(plus b2, once).")
    expected = f"one all_reduce of {_sized(OUT_BYTES, n)}"
    if len(calls) > 1:
        sizes = ", ".join(_sized(c.nbytes, n) for c in calls)
        return f"rank {r} made {len(calls)} all_reduces in forward ({sizes}); the forward needs {expected}."
    if calls[0].nbytes != OUT_BYTES:
        why = ""
        if calls[0].nbytes == 4 * BATCH * HIDDEN // n:
            why = (" Each rank's hidden activation holds different hidden units, so summing it over the ranks adds "
                   "unrelated units together; the ranks' results are shares of the same thing only after the second "
                   "layer.")
        return f"rank {r} all-reduced {_sized(calls[0].nbytes, n)} in forward; expected {expected}.{why}"
    return None


def _output(r: int, n: int, y: torch.Tensor) -> str | None:
    ref = reference(n)[0]
    err = max_abs(y, ref)
    if err <= TOL:
        return None
    b2 = _full()["b2"]
    if max_abs(y, ref + (n - 1) * b2) <= TOL:
        return (f"rank {r}'s output is the unsplit MLP's plus {n - 1} × b2: every rank added b2 before the sum, so "
                f"it was counted {n} times. Add b2 once, to the summed output.")
    for got, want, what in ((y - b2, ref - b2, "b2 aside"), (y, ref, "b2 included")):
        words = world_factor(scale_factor(got, want, TOL), n)
        if words is None:
            continue
        if words.startswith("1/"):
            return (f"rank {r}'s output ({what}) is {words} the unsplit MLP's: it was divided by the world size "
                    f"in forward. The ranks' shares of the output are parts of one sum, not {n} estimates of it "
                    "to average: the all_reduce's sum is the whole output.")
        return (f"rank {r}'s output ({what}) is {words} the unsplit MLP's: the forward summed {n} copies of the "
                "whole output where it should sum each rank's share, the part computed from its own hidden units.")
    return (f"rank {r}'s output differs by {err:.1e} from the unsplit MLP's, gelu(x @ W1.T + b1) @ W2.T + b2 (exact "
            "F.gelu), although the forward's communication was right: check the layers and the bias.")


def _gradients(r: int, n: int, grads: dict[str, torch.Tensor | None]) -> str | None:
    _, ref_grads, shares = reference(n)
    ref = ref_grads[r]
    missing = [k for k in GRADS if grads.get(k) is None]
    if missing:
        return (f"after backward, {', '.join(missing)} on rank {r} had no gradient: the output must come from x and "
                "every shard through autograd (don't detach them; a Function's backward returns one gradient per "
                "input of its forward).")
    errs = {k: max_abs(grads[k], ref[k]) for k in GRADS}
    if all(e <= TOL for e in errs.values()):
        return None
    factors = {k: world_factor(scale_factor(grads[k], ref[k], TOL), n) for k in GRADS}
    scaled = ("x", "w1", "b1", "w2")
    if len({factors[k] for k in scaled}) == 1 and factors["x"] and errs["b2"] <= TOL:
        if factors["x"].startswith("1/"):
            return (f"on rank {r} the gradients of x, w1, b1 and w2 are {factors['x']} the unsplit MLP's: the output's "
                    "gradient was divided by the world size in backward. Every rank holds the whole output "
                    "gradient (each computes the same loss from the same output): pass it on as it is.")
        return (f"on rank {r} the gradients of x, w1, b1 and w2 are {factors['x']} the unsplit MLP's: the output's "
                "gradient was summed over the ranks in backward. Every rank already holds the whole output gradient "
                f"(each computes the same loss from the same output), so summing it counts it {n} times.")
    if errs["x"] > TOL and max_abs(grads["x"], shares[r]) <= TOL:
        return (f"x.grad on rank {r} is only this rank's partial sum: the share of x's gradient that flows back "
                "through its own hidden units. The unsplit MLP's input gradient is the sum of every rank's share, "
                "and nothing in your backward summed them over the ranks (the gradients of the shards were right).")
    if errs["x"] > TOL and all(errs[k] <= TOL for k in GRADS if k != "x"):
        words = world_factor(scale_factor(grads["x"], ref["x"], TOL), n)
        if words and words.startswith("1/"):
            return (f"x.grad on rank {r} is {words} the unsplit MLP's: the sum of the ranks' shares of x's gradient "
                    "was divided by the world size in backward. x's gradient is the sum of the shares, not their "
                    "mean.")
    name = next(k for k in GRADS if errs[k] > TOL)
    ratio = float(grads[name].double().norm() / ref[name].double().norm().clamp_min(1e-12))
    return (f"the gradient of {name} on rank {r} differs by {errs[name]:.1e} from the unsplit MLP's (sliced as the "
            f"shard is); its norm is {ratio:.2f}× the expected one.")


def _backward_calls(r: int, n: int, calls: tuple[Call, ...]) -> str | None:
    if len(calls) == 1 and calls[0].op == "all_reduce" and calls[0].nbytes == IN_BYTES:
        return None
    seen = ", ".join(f"{c.op} of {_sized(c.nbytes, n)}" for c in calls) or "no calls"
    return (f"rank {r}'s backward made {seen}; the gradients were right, but the backward needs exactly one "
            f"all_reduce, of {_sized(IN_BYTES, n)}, and nothing else.")


def summary(records: dict[int, list[Record]]) -> str:
    worst = 0.0
    for n, ranks in records.items():
        y, ref_grads, _ = reference(n)
        for r, rec in enumerate(ranks):
            assert rec.y is not None
            worst = max(worst, max_abs(rec.y, y), *(max_abs(rec.grads[k], ref_grads[r][k]) for k in GRADS))
    first = records[min(records)][0]
    return (f"at world sizes {', '.join(map(str, records))} every rank's output, x.grad and shard gradients matched "
            f"the unsplit MLP's (largest difference {worst:.1g}). Rank 0's forward: {ops_used(first.forward)} of "
            f"{OUT_BYTES:,} bytes (the output); its backward: {ops_used(first.backward)} of {IN_BYTES:,} bytes (the "
            f"input). No rank held another's part of W1 or W2 at any line: each held 1/n of them "
            f"({4 * HIDDEN * (D_IN + D_OUT):,} bytes unsplit).")


EXERCISE = Exercise("tp_mlp", DESCRIPTION, on_rank, judge, summary, tp_mlp, stub, world_sizes=WORLD_SIZES,
                    allowed_world_sizes=WORLD_SIZES, hints=HINTS)
