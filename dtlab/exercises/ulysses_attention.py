"""Exercise ``ulysses_attention``: causal attention over a sequence split across the ranks, by trading the sequence
split for a head split with an all-to-all, and back.

Rank r holds block r of the positions, every head. Attention per head needs every
position, but the heads are independent: one all-to-all sends head group g of this
rank's block to rank g, so that each rank then holds h/n heads over the whole sequence
(its blocks arriving in rank order, which is position order). There ordinary causal
attention runs, no merging of partial softmaxes; a second all-to-all, the inverse,
brings each block's output back to its rank. DeepSpeed-Ulysses (Jacobs et al. 2023).

The ``cp`` tier's ``method="ulysses"`` runs the same exchange inside the model, with its
backward (``dtlab.tiers.cp_ulysses``); this exercise is the forward.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises._check import Call, Exercise, call_learner, ops_used

HEADS, BLOCK, HEAD_DIM = 4, 4, 8
WORLD_SIZES = (2, 4)  # the 4 heads split evenly: 2 heads per rank, then 1
CASES = (("random blocks", 1.0), ("large scores (queries ×50)", 50.0))
RTOL, ATOL = 1e-4, 1e-5
TOLERANCE = "rtol 1e-4, atol 1e-5"
ALL_TO_ALLS = frozenset({"all_to_all_single", "all_to_all"})

DESCRIPTION = (
    "Write fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: causal self-attention over a "
    "sequence split across the n = dist.get_world_size() ranks, Ulysses' way. Rank r holds block r of the positions "
    "(the blocks in rank order make the sequence) of the queries, keys and values of every head: float32 tensors "
    f"shaped [heads, block, head_dim] ({HEADS}, {BLOCK}, {HEAD_DIM} here). Return this rank's block of the causal "
    "attention over the whole sequence, every head: per head softmax(Q K^T / sqrt(head_dim)) V, where the query at "
    "position i sees the keys at positions 0..i of the whole sequence; a tensor shaped like q. Communicate with "
    "all-to-alls only (dist.all_to_all_single or dist.all_to_all; no other call), so that each rank attends with "
    "heads / n whole heads: its all-to-alls move q, k and v once and the output once, adding up to 4 × q's bytes "
    f"per rank. Checked at world sizes 2 and 4 ({HEADS // 2} heads, then 1, per rank), with random blocks and with "
    f"large scores (queries ×50): the output on every rank against causal attention computed in one process in "
    f"float64 ({TOLERANCE}), which calls each rank made and the bytes they carried."
)

HINTS = (
    "The heads are independent of each other, the positions are not. Trade one split for the other: send each rank "
    "the heads it is to look after, from your block of the sequence; then a rank holds a few heads over the whole "
    "sequence and ordinary causal attention works there. The same exchange in reverse brings every block's output "
    "home.",
    "dist.all_to_all_single(output, input) cuts input's dim 0 into n equal parts, part s to rank s, and fills "
    "output's dim 0 part s with what rank s sent: put the destination first, e.g. q.reshape(n, heads // n, block, "
    "head_dim) gives head group g to rank g. To send q, k and v in one call, torch.stack([q, k, v]), .reshape(3, n, "
    "...) and .transpose(0, 1) to bring the rank first (.contiguous() before sending). What arrives, [n, ...], is in "
    "rank order, which is position order: .permute and .reshape it to [heads // n, n * block, head_dim]. "
    "F.scaled_dot_product_attention(q, k, v, is_causal=True). Back: cut the output's positions into n blocks and "
    "put the block first; what returns from rank g is head group g.",
    "n = world size; h, t, d = q.shape\n"
    "send = stack([q, k, v]).reshape(3, n, h // n, t, d).transpose(0, 1).contiguous()   # head group g -> rank g\n"
    "got = empty_like(send); all_to_all_single(got, send)     # got[s]: rank s's block of my heads\n"
    "full = got.permute(1, 2, 0, 3, 4).reshape(3, h // n, n * t, d)\n"
    "y = scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)\n"
    "back = y.reshape(h // n, n, t, d).transpose(0, 1).contiguous()   # block s -> rank s\n"
    "mine = empty_like(back); all_to_all_single(mine, back)   # mine[g]: head group g of my block\n"
    "return mine.reshape(h, t, d)",
)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: one all-to-all to head groups over the whole sequence, causal SDPA, one all-to-all back."""
    n = dist.get_world_size()
    h, t, d = q.shape
    # dim 0: the rank that takes head group g (contiguous: the all-to-all cuts the memory as it lies)
    send = torch.stack([q, k, v]).reshape(3, n, h // n, t, d).transpose(0, 1).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send)  # got[s]: rank s's block of this rank's heads
    full = got.permute(1, 2, 0, 3, 4).reshape(3, h // n, n * t, d)  # rank order is position order
    y = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)
    back = y.reshape(h // n, n, t, d).transpose(0, 1).contiguous()  # dim 0: the rank whose block it is
    mine = torch.empty_like(back)
    dist.all_to_all_single(mine, back)  # mine[g]: head group g of this rank's block
    return mine.reshape(h, t, d)


def stub(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A starting point: replace the body (see ``describe('ulysses_attention')``)."""
    raise NotImplementedError(
        "write Ulysses attention: with one all-to-all give each rank a group of heads over the whole sequence, run "
        "causal attention there, and with a second all-to-all bring every block's output back to its rank; return "
        "this rank's block, every head, shaped like q (exercises.hint('ulysses_attention') when stuck)")


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """What one rank saw in one test case: its q, k and v, the output it returned (None: not a tensor), its calls."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None
    returned: str
    calls: tuple[Call, ...]


def _inputs(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(6113 * i + rank)
    q, k, v = (torch.randn(HEADS, BLOCK, HEAD_DIM, generator=gen) for _ in range(3))
    return q * CASES[i][1], k, v


def on_rank(info: Any, fn: Any) -> list[Case]:
    """Every test case, in the same order on every rank; the learner gets copies, so the inputs stay as given."""
    cases = []
    for i, (name, _) in enumerate(CASES):
        q, k, v = _inputs(i, info.rank)
        value, calls = call_learner(fn, q.clone(), k.clone(), v.clone(), where=f"with {name}")
        out = value.detach().clone() if isinstance(value, torch.Tensor) else None
        cases.append(Case(name, q, k, v, out, type(value).__name__, calls))
    return cases


def judge(n: int, ranks: list[list[Case]]) -> str | None:
    for i in range(len(CASES)):
        case = [cases[i] for cases in ranks]
        problem = _other_calls(case) or _wrong_output(case) or _wrong_bytes(case, n)
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
    c, q, k, v = case[r], *_whole(case)
    if _close(out, causal_attention(c.q, c.k, c.v)):
        return ("It is attention within this rank's own block only: each query must see every earlier position of "
                "the whole sequence, which the all-to-all brings (for a group of heads).")
    if _close(out, _block(causal_attention(q, k, v, causal=False), r)):
        return ("It is attention without the causal mask: the query at position i may see the keys at positions "
                "0..i only, of the whole sequence (once the blocks are put together in position order).")
    for scale, label in ((1.0, "1 (not scaled at all)"), (1 / HEAD_DIM, f"1/head_dim = 1/{HEAD_DIM}")):
        if _close(out, _block(causal_attention(q, k, v, scale), r)):
            return f"The scores are scaled by {label}, not 1/√head_dim = 1/√{HEAD_DIM}."
    heads = _heads_moved(out, expected)
    if heads:
        return heads
    order = _block_order(case)
    if order is not None:
        return (f"It is causal attention over the blocks put together in the order {list(order)}, not in rank "
                "order: what arrives from rank s is block s of the sequence, and the causal mask needs the "
                "positions in order.")
    return ("Each head's output must be softmax(Q K^T / sqrt(head_dim)) V over the whole sequence with the causal "
            "mask, for the queries of this rank's block: look at which heads and which positions each rank attends "
            "with, and where the outputs go on the way back.")


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


def summary(records: dict[int, list[list[Case]]]) -> str:
    per_n = [f"n={n}: {sum(c.nbytes for c in ranks[0][0].calls):,} bytes in {ops_used(ranks[0][0].calls)}"
             for n, ranks in records.items()]
    return (f"every rank's output matched causal attention computed in one process (float64; {TOLERANCE}) at world "
            f"sizes {', '.join(map(str, records))}, with random blocks and with large scores (queries "
            f"×{CASES[-1][1]:g}), using all-to-alls only, each moving q, k, v and the output once. Rank 0's calls: "
            + "; ".join(per_n) + f" (4 × q's {records[min(records)][0][0].q.nbytes:,} bytes, whatever n).")


EXERCISE = Exercise("ulysses_attention", DESCRIPTION, on_rank, judge, summary, ulysses_attention, stub,
                    world_sizes=WORLD_SIZES, allowed_world_sizes=WORLD_SIZES, hints=HINTS)
