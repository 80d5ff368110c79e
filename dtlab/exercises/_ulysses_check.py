"""The ulysses_attention exercise's test cases and its judge: what each rank returned, called, sent and held.

A wrong output is named by its signature where it has one: attention within the rank's own block, without the
causal mask, with another scale (fitted, then named where it is a common one), NaN from a softmax whose
exponentials overflowed, the right heads in the wrong places, the blocks put together out of order, or the heads
this rank attended with, returned as they are (no inverse all-to-all). A right output can still be no Ulysses: its
all-to-alls must carry 4 × q's bytes in even splits, and no rank may hold other ranks' keys or values of more
heads than its own heads / n (a probe looks for them by their values at every line of the learner's code).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from dtlab.exercises._check import Call

HEADS, BLOCK, HEAD_DIM = 4, 4, 8
WORLD_SIZES = (2, 4)  # the 4 heads split evenly: 2 heads per rank, then 1
CASES = (("random blocks", 1.0), ("large scores (queries ×50)", 50.0))
RTOL, ATOL = 1e-4, 1e-5
TOLERANCE = "rtol 1e-4, atol 1e-5"
ALL_TO_ALLS = frozenset({"all_to_all_single", "all_to_all"})


@dataclass(frozen=True)
class Case:
    """What one rank saw in one test case: its q, k and v, the output it returned (None: not a tensor), its calls,
    and when and where it first held other ranks' keys or values of more heads than its share (None: never)."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None
    returned: str
    calls: tuple[Call, ...]
    held: str | None = None


def judge(n: int, ranks: list[list[Case]]) -> str | None:
    for i in range(len(CASES)):
        case = [cases[i] for cases in ranks]
        # a wrong output first; then how a right one was reached: the bytes, the splits, what a rank held
        problem = (_other_calls(case) or _wrong_output(case) or _wrong_bytes(case, n) or _uneven(case, n)
                   or _held(case, n))
        if problem:
            return problem
    return None


def _other_calls(case: list[Case]) -> str | None:
    for r, c in enumerate(case):
        call = next((call for call in c.calls if call.op not in ALL_TO_ALLS), None)
        if call is None:
            continue
        if call.op.startswith("all_gather"):
            why = (" An all-gather gives every rank every head over the whole sequence: n times the keys and values "
                   "that Ulysses leaves on a rank, and every head's attention computed again on every rank.")
        elif call.op in ("send", "recv", "isend", "irecv"):
            why = (" Point-to-point calls pass blocks from rank to rank, as ring attention does; Ulysses moves "
                   "everything a rank needs in one all-to-all each way.")
        else:
            why = ""
        return (f"rank {r} called dist.{call.op} with {c.name}: only all-to-alls are allowed here "
                "(dist.all_to_all_single or dist.all_to_all)." + why)
    return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     causal: bool = True) -> torch.Tensor:
    """Per head, softmax(q k^T * scale + causal mask) v in float64 (scale 1/sqrt(d) unless given), in one process."""
    s = q.double() @ k.double().transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v.double()


def _whole(case: list[Case], order: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v, its blocks in ``order`` (rank order unless given)."""
    order = tuple(range(len(case))) if order is None else order
    return tuple(torch.cat([getattr(case[s], name) for s in order], -2) for name in ("q", "k", "v"))


def _block(full: torch.Tensor, r: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank r's block out of an attention over the sequence put together in ``order``."""
    at = r if order is None else order.index(r)
    return full[:, at * BLOCK:(at + 1) * BLOCK]


def _wrong_output(case: list[Case]) -> str | None:
    n = len(case)
    expected_all = causal_attention(*_whole(case))
    for r, c in enumerate(case):
        if c.out is None:
            return (f"rank {r} returned {c.returned} with {c.name}: return this rank's block of the output, every "
                    f"head, a tensor shaped like q {tuple(c.q.shape)}.")
        expected = _block(expected_all, r)
        if c.out.shape != expected.shape:
            back = (" That is this rank's heads over the whole sequence: the second all-to-all must bring every "
                    "block's output back to the rank that holds the block, every head of it."
                    if tuple(c.out.shape) == (HEADS // n, n * BLOCK, HEAD_DIM) else "")
            return (f"rank {r} returned a tensor of shape {tuple(c.out.shape)} with {c.name}, not "
                    f"{tuple(expected.shape)}: this rank's block of the output, every head, is shaped like q." + back)
        out = c.out.double()
        right = torch.isclose(out, expected, rtol=RTOL, atol=ATOL)
        if bool(right.all()):
            continue
        h, row, col = (int(x) for x in (~right).nonzero()[0])
        return (f"rank {r}'s output is wrong with {c.name}: at [{h}, {row}, {col}] it is {float(out[h, row, col]):.6g} "
                f"where causal attention gives {float(expected[h, row, col]):.6g} ({int(right.sum())} of "
                f"{right.numel()} values right). " + _signature(r, out, case, expected))
    return None


def _close(out: torch.Tensor, candidate: torch.Tensor) -> bool:
    return bool(torch.allclose(out, candidate, rtol=RTOL, atol=ATOL))


def _signature(r: int, out: torch.Tensor, case: list[Case], expected: torch.Tensor) -> str:
    """A common wrong result, told by its values."""
    c, (q, k, v) = case[r], _whole(case)
    if not bool(torch.isfinite(out).all()):
        return _not_finite(out, c)
    if _close(out, causal_attention(c.q, c.k, c.v)):
        return ("It is attention within this rank's own block only: each query must see every earlier position of "
                "the whole sequence, which the all-to-all brings (for a group of heads).")
    if _close(out, _block(causal_attention(q, k, v, causal=False), r)):
        return ("It is attention without the causal mask: the query at position i may see the keys at positions "
                "0..i only, of the whole sequence (once the blocks are put together in position order).")
    found = _scaled(r, out, case) or _heads_moved(out, expected) or _not_sent_back(r, out, case)
    if found:
        return found
    order = _block_order(case)
    if order is not None:
        return (f"It is causal attention over the blocks put together in the order {list(order)}, not in rank "
                "order: what arrives from rank s is block s of the sequence, and the causal mask needs the "
                "positions in order.")
    return ("Each head's output must be softmax(Q K^T / sqrt(head_dim)) V over the whole sequence with the causal "
            "mask, for the queries of this rank's block: look at which heads and which positions each rank attends "
            "with, and where the outputs go on the way back.")


def _not_finite(out: torch.Tensor, c: Case) -> str:
    bad = int((~torch.isfinite(out)).sum())
    if c.name == CASES[-1][0]:
        return (f"It holds {bad} NaN or infinite values, with scores this large: exp() of a score above about 88 "
                "overflows float32 to inf, and inf / inf is NaN. Subtract each row's largest score before exp: "
                "softmax is unchanged by it, and no exponential then exceeds 1.")
    return (f"It holds {bad} NaN or infinite values: a softmax row whose every score is masked divides 0 by 0 (the "
            "query at position i always sees position i itself), or an exponential overflowed.")


def _named_scales(n: int) -> tuple[tuple[float, str], ...]:
    d = HEAD_DIM
    return ((1.0, "1 (not scaled at all)"), (1 / d, f"1/head_dim = 1/{d}"),
            (math.sqrt(d), f"√head_dim = √{d} (a multiplication where a division belongs)"),
            (1 / math.sqrt(HEADS * d), f"1/√(heads × head_dim) = 1/√{HEADS * d} (the model's width, not a head's)"),
            (1 / math.sqrt(HEADS // n * d), f"1/√(heads / n × head_dim) = 1/√{HEADS // n * d} (this rank's heads' "
                                            "width, not a head's)"),
            (1 / math.sqrt(n * BLOCK), f"1/√(sequence length) = 1/√{n * BLOCK}"),
            (1 / math.sqrt(BLOCK), f"1/√(block length) = 1/√{BLOCK}"))


def _scaled(r: int, out: torch.Tensor, case: list[Case]) -> str | None:
    """The scale of the scores under which ``out`` is right, where it is one other than 1/√head_dim."""
    q, k, v = _whole(case)
    right = f"not 1/√head_dim = 1/√{HEAD_DIM}"
    for scale, label in _named_scales(len(case)):
        if _close(out, _block(causal_attention(q, k, v, scale), r)):
            return f"The scores are scaled by {label}, {right}."
    fitted = _fit_scale(r, out, q, k, v)
    if fitted is None:
        return None
    return (f"The scores are scaled by about {fitted:.4g} (your output is right under that scale), {right} ≈ "
            f"{1 / math.sqrt(HEAD_DIM):.4g}.")


def _fit_scale(r: int, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float | None:
    """The scale under which ``out`` is rank r's block of causal attention, if one is: the best of a grid from
    1/1000 to 1000, narrowed by golden-section search (the error has one minimum near the right scale)."""
    def error(log_scale: float) -> float:
        return float((out - _block(causal_attention(q, k, v, math.exp(log_scale)), r)).abs().max())

    grid = torch.linspace(math.log(1e-3), math.log(1e3), 121).tolist()
    step = grid[1] - grid[0]
    best = min(grid, key=error)
    lo, hi, ratio = best - step, best + step, (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if error(a) < error(b) else (a, hi)
    scale = math.exp((lo + hi) / 2)
    return scale if _close(out, _block(causal_attention(q, k, v, scale), r)) else None


def _not_sent_back(r: int, out: torch.Tensor, case: list[Case]) -> str | None:
    """Every row of ``out`` is one of this rank's heads' attention at some position of the whole sequence: the
    heads it attended with, returned as they came out, without the inverse all-to-all."""
    full = causal_attention(*_whole(case))  # [heads, n * block, head_dim]
    rows, span = full.reshape(-1, HEAD_DIM), full.shape[1]
    gap = torch.cdist(out.reshape(-1, HEAD_DIM).double(), rows)
    near, where = gap.min(1)
    if not bool((near <= ATOL + RTOL * rows.abs().max()).all()):
        return None
    heads, positions = sorted({int(i) // span for i in where}), {int(i) % span for i in where}
    if positions <= set(range(r * BLOCK, (r + 1) * BLOCK)):
        return None
    return (f"It holds the attention of head{'s' * (len(heads) > 1)} {', '.join(map(str, heads))} over the whole "
            "sequence: the heads this rank attended with, returned as they came out. The inverse all-to-all sends "
            "each block of those outputs to the rank whose block it is, and brings this rank's block of every "
            "other head home.")


def _block_order(case: list[Case]) -> tuple[int, ...] | None:
    """The order, other than rank order, of the blocks that every rank's output is causal attention over."""
    for order in itertools.permutations(range(len(case))):
        if order == tuple(sorted(order)):
            continue
        full = causal_attention(*_whole(case, order))
        if all(c.out is not None and _close(c.out.double(), _block(full, r, order)) for r, c in enumerate(case)):
            return order
    return None


def _heads_moved(out: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Each head of ``out`` that holds another head's right attention, named, when every head holds one."""
    found = []
    for h in range(out.shape[0]):
        match = next((g for g in range(expected.shape[0]) if _close(out[h], expected[g])), None)
        if match is None:
            return None
        found.append(match)
    moved = [(h, g) for h, g in enumerate(found) if h != g]
    if not moved:
        return None
    h, g = moved[0]
    return (f"Every head's attention is right but in the wrong place: head {h} of your output holds head {g}'s "
            "(and so on). The heads come back from rank g as head group g: put them back where they were taken "
            "from.")


def _wrong_bytes(case: list[Case], n: int) -> str | None:
    x = case[0].q.nbytes
    for r, c in enumerate(case):
        sent = sum(call.nbytes for call in c.calls if call.op in ALL_TO_ALLS)
        if sent == 4 * x:
            continue
        if sent == 8 * x:
            hint = " Twice the bytes: send the tensors in their own dtype, float32."
        elif sent > 4 * x:
            hint = (f" Each rank needs only its own heads from the others (heads / n = {HEADS // n} here): send each "
                    "head group once, to the rank that attends with it, not every head to every rank.")
        else:
            hint = (" All three of q, k and v must reach the rank that attends with their heads, and the output "
                    "must come back.")
        return (f"rank {r}'s all-to-alls carried {sent:,} bytes with {c.name}; Ulysses exchanges q, k and v once and "
                f"the output once: 4 × q's {x:,} bytes = {4 * x:,} bytes per rank." + hint)
    return None




def _uneven(case: list[Case], n: int) -> str | None:
    for r, c in enumerate(case):
        for call in c.calls:
            sent, got = call.input_splits, call.output_splits
            if sent is None or got is None or (len(set(sent)) == 1 and len(set(got)) == 1):
                continue
            return (f"rank {r}'s all_to_all_single with {c.name} sent {list(sent)} rows to ranks 0..{n - 1} and "
                    f"received {list(got)}: uneven. Ulysses' exchanges are even: every rank sends each rank the same "
                    f"share, heads / n = {HEADS // n} heads of its block, and gets as much back; uneven splits move "
                    "something else (the keys and values of every head, to the ranks that attend with them).")
    return None


def _held(case: list[Case], n: int) -> str | None:
    for r, c in enumerate(case):
        if c.held is not None:
            return (f"rank {r} held {c.held} with {c.name}. Ulysses gives each rank heads / n = {HEADS // n} whole "
                    f"heads over the whole sequence: the keys and values it gets from the others are those of its "
                    f"{HEADS // n} heads only. More means the heads were not split: every head's keys and values "
                    "went to the ranks that attend with them.")
    return None
