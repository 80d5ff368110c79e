"""Exercise ``ring_attention``: attention over a sequence split across the ranks, K/V blocks passed around a ring.

Context parallelism splits the sequence: rank r holds block r of the queries,
keys and values. Its queries need every rank's keys and values, so the ranks
pass their K/V blocks around a ring (send to r + 1, receive from r - 1): after
n - 1 rounds every block has visited every rank, and no rank ever held more
than two K/V blocks at once (the one it attends to, and the one arriving).

Each rank attends to one block at a time and merges the partial results with
the *online softmax*, as flash attention does: per query row it keeps the
largest score so far ``m``, the sum ``l`` of ``exp(score - m)`` and the output
``acc`` weighted the same way. A block with a larger maximum ``m_new`` rescales
what was kept by ``exp(m - m_new)`` before adding its own share; at the end
``acc / l`` is the softmax over the whole sequence, exactly. Subtracting the
maximum is what keeps ``exp`` finite: float32 overflows above exp(88.7).

The ``cp`` tier runs the same maths (merged by log-sum-exp) inside the model,
causal and with the backward pass; this exercise is the forward, non-causal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtlab.exercises._check import (
    SENDS,
    Call,
    Exercise,
    call_learner,
    first_collective,
    off_ring_call,
    ops_used,
    sent_bytes,
)
from dtlab.exercises._reach import Fingerprints, Found, HeldWatch, fold, held_values, places

HEADS, BLOCK, HEAD_DIM = 2, 6, 8
# (the case's name in feedback, the factor on the queries): scaled queries give scores of 100 and more
CASES = (("random blocks", 1.0), ("large scores (queries ×50)", 50.0))
RTOL, ATOL = 1e-4, 1e-5  # float32 against float64: scores near 150 carry errors of a few 1e-6
TOLERANCE = "rtol 1e-4, atol 1e-5"
MOST_HELD = 3  # K/V blocks a rank may hold at once: the one in use, the one it sends and the one arriving

DESCRIPTION = (
    "Write fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: the forward pass of ring attention "
    "(non-causal). The sequence is split over the n = dist.get_world_size() ranks in rank order: rank r holds block r "
    f"of the queries, keys and values, float32 tensors shaped [heads, block, head_dim] ({HEADS}, {BLOCK}, {HEAD_DIM} "
    "here). Return this rank's block of the attention over the whole sequence, softmax(Q K^T / sqrt(head_dim)) V "
    "with Q this rank's queries and K, V every rank's keys and values in rank order: a tensor shaped like q. The "
    "queries stay where they are; the K and V blocks travel around a ring with point-to-point calls only "
    "(dist.send, dist.recv, dist.isend, dist.irecv, dist.batch_isend_irecv; no collective): rank r sends only to "
    "(r + 1) % n and receives only from (r - 1) % n, in n - 1 rounds, each passing on one K block and one V block "
    "(as two messages, or stacked in one), so that every block reaches every rank while no rank holds all of them: "
    f"a rank may hold at most {MOST_HELD} K/V blocks at once (the one it uses, the one it sends and the one "
    "arriving). gloo's send waits for its receiver: post each round's send and receive together and wait on both. "
    "Checked at world sizes 2 and 4, with random blocks and with large scores (queries ×50, scores of 100 and "
    f"more): the output on every rank against full attention computed in one process in float64 ({TOLERANCE}), "
    "the peer of every transfer, the bytes each rank sends, (n - 1) × its K and V blocks, and how many ranks' K/V "
    "blocks each rank holds at any line of your code (found by their values, in whatever your code can reach)."
)

HINTS = (
    "Keep the queries; let the K/V blocks travel, attending to each as it arrives. A row's softmax can be built "
    "block by block if the row remembers the largest score seen so far, the sum of exp(score - that maximum) and "
    "the output weighted the same way; rescale what you kept when a larger maximum comes.",
    "dist.get_rank(), dist.get_world_size(); torch.stack([k, v]) to send both in one message; "
    "dist.P2POp(dist.isend, kv, (r + 1) % n) and dist.P2POp(dist.irecv, incoming, (r - 1) % n) with "
    "torch.empty_like(kv), dist.batch_isend_irecv(ops) and .wait() on each work it returns; "
    "q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]); s.amax(-1, keepdim=True), torch.maximum, torch.exp, "
    ".sum(-1, keepdim=True); m starts at torch.full(..., -inf), so exp(m - m_new) is 0 on the first block.",
    "kv = stack([k, v]); m = -inf, l = 0, acc = 0 (per query row)\n"
    "for step in range(n):\n"
    "    if step < n - 1: start sending kv to r + 1 and receiving the next kv from r - 1\n"
    "    s = q @ kv[0]^T / sqrt(d)\n"
    "    m_new = max(m, rowmax(s)); p = exp(s - m_new); alpha = exp(m - m_new)\n"
    "    l = alpha * l + rowsum(p); acc = alpha * acc + p @ kv[1]; m = m_new\n"
    "    if step < n - 1: wait for both transfers; kv = what arrived\n"
    "return acc / l",
)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: n - 1 ring rounds of the stacked K/V block, merged with the online softmax."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])  # one message per round instead of two
    m = torch.full((*q.shape[:-1], 1), -math.inf)  # each row's largest score so far
    total = torch.zeros_like(m)  # each row's sum of exp(score - m)
    acc = torch.zeros_like(q)  # the output, weighted like total and not yet divided by it
    for step in range(n):
        # Start passing the block on before using it, so the transfer overlaps this round's compute.
        works, incoming = _shift(kv, rank, n) if step < n - 1 else ([], kv)
        s = q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)  # every exp is at most 1: no overflow however large the scores
        alpha = torch.exp(m - m_new)  # what was kept was relative to the old maximum (0 on the first block)
        total = alpha * total + p.sum(-1, keepdim=True)
        acc = alpha * acc + p @ kv[1]
        m = m_new
        for work in works:
            work.wait()
        kv = incoming
    return acc / total


def _shift(kv: torch.Tensor, rank: int, n: int) -> tuple[list[Any], torch.Tensor]:
    """Start sending ``kv`` to the right while receiving the left neighbour's: (the works, the receive buffer)."""
    incoming = torch.empty_like(kv)
    ops = [dist.P2POp(dist.isend, kv, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
    return dist.batch_isend_irecv(ops), incoming


def stub(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A starting point: replace the body (see ``describe('ring_attention')``)."""
    raise NotImplementedError(
        "write ring attention: attend to your own K/V block, then n - 1 times pass the block you hold to rank r + 1 "
        "while receiving the next from rank r - 1, attend to it and merge it with what you have; return this "
        "rank's block of the output, shaped like q (exercises.hint('ring_attention') when stuck)")


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """What one rank saw in one test case: its q, k and v, the output it returned (None: not a tensor), its calls,
    and the most ranks' K/V blocks it held at once (``held``: whose, ``held_at``: when, ``held_where``: in what)."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None
    returned: str  # the type of what fn returned, for feedback
    calls: tuple[Call, ...]
    held: tuple[int, ...] = ()
    held_at: str = ""
    held_where: tuple[str, ...] = ()


def _inputs(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s q, k and v in case ``i``: any rank can make any other's, to know its blocks by their values."""
    gen = torch.Generator().manual_seed(7919 * i + rank)
    q, k, v = (torch.randn(HEADS, BLOCK, HEAD_DIM, generator=gen) for _ in range(3))
    return q * CASES[i][1], k, v


class _BlockCount:
    """Which ranks' K/V blocks the learner's code holds, at every line it runs (a ``HeldWatch`` probe).

    Why values: a block is in a rank's memory however it got there and whatever Python object holds it -- a
    receive buffer, a list, a torch.cat of several, a view, a .double() copy, a global -- so the probe looks
    for each rank's K and V values (and the keys pre-scaled by 1/sqrt(d)) in everything the code can reach.
    Why every line: the lines that issue a transfer, the ones after it returns or is waited on and the
    function's return are the moments a rank's holding changes; a peak between two transfers counts too.
    Tensors the code cannot reach any more are freed, so what is reachable is what the rank holds (and inside
    the watch a new buffer is NaN until written, so freed memory handed back shows no block). Why not the
    process's memory: CPU allocations have no counter to read, and a count of bytes would blur a 768-byte
    block among gloo's buffers and torch's own scratch; values say whose block it is."""

    def __init__(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.parts = Fingerprints([t for k, v in blocks for t in (k, v, k / math.sqrt(HEAD_DIM))])  # K, V, K/√d
        self.ranks = len(blocks)
        self.most: tuple[int, ...] = ()
        self.at, self.where = "", ()

    def held(self, found: list[Found]) -> tuple[int, ...]:
        shares = self.parts.shares(held_values(found))
        return tuple(r for r in range(self.ranks) if shares[3 * r:3 * r + 3].max() > 0.99)

    def __call__(self, found: list[Found], moment: str) -> None:
        held = self.held(found)
        if len(held) > len(self.most):
            self.most, self.at = held, moment
            # the places that hold the most blocks first: a list of kept blocks before a receive buffer
            by_place: dict[str, list[Found]] = {}
            for f in found:
                by_place.setdefault(fold(f.where), []).append(f)
            each = {place: len(self.held(group)) for place, group in by_place.items()}
            self.where = tuple(p for p in sorted(each, key=lambda p: -each[p]) if each[p])


def on_rank(info: Any, fn: Any) -> list[Case]:
    """Every test case, in the same order on every rank; the learner gets copies, so the inputs stay as given."""
    cases = []
    for i, (name, _) in enumerate(CASES):
        q, k, v = _inputs(i, info.rank)
        count = _BlockCount([_inputs(i, r)[1:] for r in range(info.world_size)])
        with HeldWatch(count, fn):
            value, calls = call_learner(fn, q.clone(), k.clone(), v.clone(), where=f"with {name}")
        out = value.detach().clone() if isinstance(value, torch.Tensor) else None
        cases.append(Case(name, q, k, v, out, type(value).__name__, calls, count.most, count.at, count.where))
    return cases


def judge(n: int, ranks: list[list[Case]]) -> str | None:
    for i in range(len(CASES)):
        case = [cases[i] for cases in ranks]
        problem = (_collective(case) or _wrong_output(case, i) or _not_a_ring(case, n) or _wrong_bytes(case, n)
                   or _held_too_many(case, n))
        if problem:
            return problem
    return None


def _collective(case: list[Case]) -> str | None:
    found = first_collective([c.calls for c in case])
    if found is None:
        return None
    r, call = found
    why = (" all_gather moves every block to every rank at once, so each rank holds the whole sequence's keys and "
           "values: the memory that splitting the sequence was meant to save." if call.op.startswith("all_gather")
           else "")
    return (f"rank {r} called dist.{call.op} with {case[r].name}: collectives are not allowed here. Ring attention "
            "passes K/V blocks around the ring with point-to-point calls (send, recv, isend, irecv, "
            "batch_isend_irecv), one neighbour's block per round." + why)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q keys^T * scale) values in float64 (scale 1/sqrt(d) unless given): full attention, in one process."""
    s = q.double() @ keys.double().transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return torch.softmax(s, dim=-1) @ values.double()


def _wrong_output(case: list[Case], i: int) -> str | None:
    keys, values = torch.cat([c.k for c in case], -2), torch.cat([c.v for c in case], -2)
    for r, c in enumerate(case):
        if c.out is None:
            return (f"rank {r} returned {c.returned} with {c.name}: return this rank's block of the output, a "
                    f"tensor shaped like q {tuple(c.q.shape)}.")
        expected = attention(c.q, keys, values)
        if c.out.shape != expected.shape:
            return (f"rank {r} returned a tensor of shape {tuple(c.out.shape)} with {c.name}, not "
                    f"{tuple(expected.shape)}: this rank's block of the output is shaped like q.")
        out = c.out.double()
        right = torch.isclose(out, expected, rtol=RTOL, atol=ATOL)
        if bool(right.all()):
            continue
        h, row, col = (int(x) for x in (~right).nonzero()[0])
        return (f"rank {r}'s output is wrong with {c.name}: at [{h}, {row}, {col}] it is {float(out[h, row, col]):.6g} "
                f"where full attention gives {float(expected[h, row, col]):.6g} ({int(right.sum())} of "
                f"{right.numel()} values right). " + (_signature(r, c, out, case) or _output_hint(i, c, out, case)))
    return None


def _scales() -> tuple[tuple[float, str], ...]:
    d = HEAD_DIM
    return ((1.0, "1 (not scaled at all)"), (1 / d, f"1/head_dim = 1/{d}"), (math.sqrt(d), f"√head_dim = √{d}"),
            (float(d), f"head_dim = {d}"), (1 / math.sqrt(BLOCK), f"1/√{BLOCK}, one over the root of the block length"))


def _signature(r: int, c: Case, out: torch.Tensor, case: list[Case]) -> str | None:
    """A common wrong result, told by its values: a wrong scale, K and V swapped, a block left out."""
    keys, values = torch.cat([b.k for b in case], -2), torch.cat([b.v for b in case], -2)
    for scale, label in _scales():
        if _close(out, attention(c.q, keys, values, scale)):
            return (f"The scores are scaled by {label}, not 1/√head_dim = 1/√{HEAD_DIM}: "
                    f"softmax(Q K^T / sqrt(head_dim)) V, with head_dim = q.shape[-1] = {HEAD_DIM}.")
    if _close(out, attention(c.q, values, keys)):
        return "It is attention with K and V swapped: the scores come from the keys, the output weighs the values."
    n = len(case)
    for j in range(n) if n > 1 else ():
        rest = [b for s, b in enumerate(case) if s != j]
        if _close(out, attention(c.q, torch.cat([b.k for b in rest], -2), torch.cat([b.v for b in rest], -2))):
            what = ("its own block (the first it holds)" if j == r else
                    f"rank {j}'s block, the one that arrives in round {(r - j) % n} of {n - 1}")
            return (f"It is attention to every block but {what}: each rank's queries must see all n = {n} blocks, "
                    "its own included.")
    return None

def _output_hint(i: int, c: Case, out: torch.Tensor, case: list[Case]) -> str:
    """What the wrong output looks like: overflow, one block only, blocks normalised apart, or a wrong merge."""
    if i > 0:  # the random blocks passed, so the merge is right but for the size of the scores
        broke = "gives inf or NaN" if not bool(out.isfinite().all()) else "loses precision"
        return (f"Your merge works on random blocks but {broke} once scores are large: exp of a score above 88.7 "
                "overflows float32 (exp(100) is inf, and inf / inf is NaN). Subtract each row's running maximum "
                "(the largest score seen so far) before exp, so that no exp exceeds 1, and rescale what you "
                "accumulated whenever that maximum grows.")
    if not bool(out.isfinite().all()):
        return ("It holds inf or NaN although these scores are small: look for exp(-inf - (-inf)) (a maximum that "
                "starts at -inf subtracted from itself) or a division by a sum that is still 0.")
    if _close(out, attention(c.q, c.k, c.v)):
        return ("It is attention to this rank's own keys only: the queries must see every rank's keys and values, "
                "which arrive around the ring in n - 1 rounds.")
    per_block = torch.stack([attention(c.q, b.k, b.v) for b in case])
    if _close(out, per_block.sum(0)) or _close(out, per_block.mean(0)):
        return ("It is the attention to each block separately, each softmax normalised over its own block's keys, "
                "then summed or averaged. The weights must sum to 1 over the whole sequence: a block's partial "
                "result counts by its share of the row's total sum, and partial results must be rescaled to the "
                "new running maximum before they are added up.")
    return ("Each row must be one softmax over all keys: when a block brings a larger maximum, the sum and the "
            "output accumulated so far (relative to the old maximum) must be rescaled to the new running maximum, "
            "by exp(m_old - m_new), before the block's own share is added; divide by the total sum at the end.")


def _close(out: torch.Tensor, candidate: torch.Tensor) -> bool:
    return bool(torch.allclose(out, candidate, rtol=RTOL, atol=ATOL))


def _not_a_ring(case: list[Case], n: int) -> str | None:
    for r, c in enumerate(case):
        found = off_ring_call(r, n, c.calls)
        if found is None:
            continue
        (call, _), right, left = found, (r + 1) % n, (r - 1) % n
        if call.op in SENDS:
            return (f"rank {r} sent to rank {call.peer} with {c.name}; in a ring, rank r sends only to r + 1 "
                    f"(here rank {right}).")
        whom = "any rank (src=None)" if call.peer is None else f"rank {call.peer}"
        return (f"rank {r} received from {whom} with {c.name}; in a ring, rank r receives only from r - 1 "
                f"(here rank {left}).")
    return None


def _wrong_bytes(case: list[Case], n: int) -> str | None:
    half = case[0].k.nbytes  # one K or V block; K and V stacked are twice that
    block, expected = 2 * half, (n - 1) * 2 * half
    for r, c in enumerate(case):
        odd = next((call.nbytes for call in c.calls if call.op in SENDS and call.nbytes not in (half, block)), None)
        if odd is not None:
            return (f"rank {r} sent a message of {odd:,} bytes with {c.name}; a K or V block is {half:,} bytes "
                    f"(float32), both stacked {block:,}: pass on the K and V blocks as they came, in their dtype; "
                    "the queries stay where they are.")
        sent = sent_bytes(c.calls)
        if sent == expected:
            continue
        if sent == n * block:
            hint = " An n-th round only brings every block back to its owner, which has it already."
        elif sent > expected:
            hint = " Pass on only the K and V block you hold, once per round; the queries stay where they are."
        else:
            hint = " Every round passes on both blocks, K and V, so that each block reaches all n - 1 other ranks."
        return (f"rank {r} sent {sent:,} bytes with {c.name}; ring attention passes its K and V blocks ({block:,} "
                f"bytes together) once in each of the n - 1 = {n - 1} rounds: {expected:,} bytes." + hint)
    return None


def _held_too_many(case: list[Case], n: int) -> str | None:
    for r, c in enumerate(case):
        if len(c.held) <= MOST_HELD:
            continue
        whose = "all" if len(c.held) == n else f"{len(c.held)} of the"
        return (f"rank {r} held {whose} {n} ranks' K/V blocks at once with {c.name} ({c.held_at}, in "
                f"{places(list(c.held_where))}), although its output was right. Ring attention "
                f"holds at most {MOST_HELD} blocks at a time, whatever n: the one it attends to, the one it passes on "
                "and the one arriving; that is what lets a sequence n times longer than one rank's memory fit. "
                "Attend to each block as it arrives and merge it into a running result, then let it go (the next "
                "round's receive replaces it), instead of keeping the blocks for one softmax at the end.")
    return None


def summary(records: dict[int, list[list[Case]]]) -> str:
    block = records[min(records)][0][0].k.nbytes * 2
    per_n = [f"n={n}: {sent_bytes(ranks[0][0].calls):,} in {ops_used(ranks[0][0].calls)}"
             for n, ranks in records.items()]
    return (f"every rank's output matched full attention in one process (float64; {TOLERANCE}) at world sizes "
            f"{', '.join(map(str, records))}, with random blocks and with large scores (queries ×{CASES[-1][1]:g}, "
            f"scores up to {_largest_score(records):.0f}), using point-to-point calls only, each rank sending only "
            f"to r + 1 and receiving only from r - 1 and holding at most {_most_held(records)} ranks' K/V blocks at "
            f"once (at n = {max(records)}). Bytes each rank sent, (n - 1) × its K and V blocks "
            f"({block:,} bytes together): " + "; ".join(per_n) + ".")


def _most_held(records: dict[int, list[list[Case]]]) -> int:
    return max(len(c.held) for c in (case for cases in records[max(records)] for case in cases))


def _largest_score(records: dict[int, list[list[Case]]]) -> float:
    ranks = records[max(records)]
    keys = torch.cat([cases[-1].k for cases in ranks], -2)
    return max(float((cases[-1].q @ keys.transpose(-2, -1)).amax()) / math.sqrt(HEAD_DIM) for cases in ranks)


EXERCISE = Exercise("ring_attention", DESCRIPTION, on_rank, judge, summary, ring_attention, stub,
                    world_sizes=(2, 4), hints=HINTS)
