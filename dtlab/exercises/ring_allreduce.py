"""Exercise ``ring_allreduce``: all_reduce (a sum) built from point-to-point calls, the way NCCL and gloo run it.

In a ring, rank r sends only to its right neighbour (r + 1) % n and receives
only from its left one (r - 1) % n. Split the tensor into n chunks
(``t.tensor_split(n)``, which also works when n does not divide its length):

1. **Reduce-scatter**, n - 1 rounds: in round s rank r sends chunk (r - s) % n to
   the right and adds the chunk it receives from the left, (r - s - 1) % n, into
   its own. Afterwards rank r holds the full sum of chunk (r + 1) % n.
2. **All-gather**, n - 1 rounds: in round s rank r sends chunk (r + 1 - s) % n,
   which is complete, and overwrites chunk (r - s) % n with the one it receives.

Each rank sends 2(n - 1) chunks, 2(n - 1)/n of the tensor whatever n is: that is
why the ring is bandwidth-optimal, and why nccl-tests' bus bandwidth multiplies
an all_reduce's algorithm bandwidth by 2(n - 1)/n.

gloo's ``send`` waits until its receiver is there: if every rank sends first,
they all wait. Post each round's send and receive together
(``dist.batch_isend_irecv``) and wait on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtlab.exercises._check import (
    SENDS,
    Call,
    Exercise,
    call_learner,
    ceil_div,
    first_collective,
    off_ring_call,
    ops_used,
    sent_bytes,
)

# 12 first: it divides by 2, 3 and 4, so a transfer off the ring still meets a chunk of its size and is named; 7, 10
# and 1001 do not divide by every world size checked, where a chunk of another size would make gloo abort the rank
LENGTHS = (12, 7, 10, 1000, 1001)
SUMMARY_LENGTH = 1000
RTOL = ATOL = 1e-5

DESCRIPTION = (
    "Write fn(t: torch.Tensor) -> None that sums the 1-D float32 tensor t over all ranks, in place: every rank "
    "ends with the sum in t, the way NCCL and gloo run all_reduce. Rules: only point-to-point calls (dist.send, "
    "dist.recv, dist.isend, dist.irecv, dist.batch_isend_irecv; no collective, not even a barrier), in a ring: rank "
    "r sends only to (r + 1) % n and receives only from (r - 1) % n (rank and n from dist.get_rank() and "
    "dist.get_world_size()); and each rank sends 2(n - 1)/n of the tensor's bytes, no more, which is what makes "
    "the ring bandwidth-optimal (passing the whole tensor round the ring is too much). The length of t need not "
    "divide by n. Checked at world sizes 2, 3 and 4 with "
    f"{', '.join(map(str, LENGTHS))} elements: the sums on every rank (within {RTOL:g}), the peer of every "
    "transfer, and the bytes each rank sends (for L elements, between 2(n - 1)·⌊L/n⌋ and 2(n - 1)·⌈L/n⌉ "
    "elements' worth)."
)

HINTS = (
    "Cut t into n chunks and let them travel round the ring. In a first phase (a reduce-scatter) every chunk "
    "collects one rank's contribution per hop, so that after n - 1 rounds each rank holds one chunk fully summed; "
    "in a second phase (an all-gather) the finished chunks go round once more, n - 1 rounds, until every rank has "
    "all of them. In each round every rank sends one chunk and receives one.",

    "chunks = t.tensor_split(n) gives n views into t: writing a chunk writes t, and lengths that do not divide by "
    "n are fine. In each round send one chunk to right = (rank + 1) % n while receiving one from left = "
    "(rank - 1) % n, both at once: dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, right), "
    "dist.P2POp(dist.irecv, incoming, left)]), then .wait() on every work it returns. gloo's send waits until its "
    "receiver is there, so a plain dist.send on every rank at the same time deadlocks. In the reduce-scatter "
    "receive into torch.empty_like(chunk) and .add_() it into your chunk; in the all-gather receive straight into "
    "the chunk it replaces.",

    "r, n = dist.get_rank(), dist.get_world_size()\n"
    "chunks = t.tensor_split(n)\n"
    "right, left = (r + 1) % n, (r - 1) % n\n"
    "for s in range(n - 1):                      # reduce-scatter\n"
    "    incoming = empty like chunks[(r - s - 1) % n]\n"
    "    exchange: send chunks[(r - s) % n] to right, receive incoming from left, wait for both\n"
    "    chunks[(r - s - 1) % n] += incoming\n"
    "# rank r now holds the full sum of chunk (r + 1) % n\n"
    "for s in range(n - 1):                      # all-gather\n"
    "    exchange: send chunks[(r + 1 - s) % n] to right, receive into chunks[(r - s) % n] from left, wait",
)


def ring_allreduce(t: torch.Tensor) -> None:
    """The reference: a ring all-reduce (sum) of ``t`` in place, one chunk per rank per round."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = t.view(-1).tensor_split(n)  # views into t: writing a chunk writes t
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):  # reduce-scatter
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        _exchange(chunks[(rank - s) % n], right, incoming, left)
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):  # all-gather: rank r now holds the sum of chunk (r + 1) % n
        _exchange(chunks[(rank + 1 - s) % n], right, chunks[(rank - s) % n], left)


def _exchange(outgoing: torch.Tensor, dst: int, incoming: torch.Tensor, src: int) -> None:
    """Send ``outgoing`` to ``dst`` while receiving ``incoming`` from ``src``; return when both are done."""
    ops = [dist.P2POp(dist.isend, outgoing, dst), dist.P2POp(dist.irecv, incoming, src)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def stub(t: torch.Tensor) -> None:
    """A starting point: replace the body with the ring (see ``describe('ring_allreduce')``)."""
    raise NotImplementedError(
        "write the ring: leave every rank's t holding the sum of all ranks' t, with point-to-point calls to rank "
        "r + 1 and from rank r - 1 only (exercises.hint('ring_allreduce') when stuck)")


# -- checking ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """What one rank saw in one test case: its input, t afterwards, what the function returned, and its calls."""

    length: int
    given: torch.Tensor
    result: torch.Tensor
    returned: torch.Tensor | None
    calls: tuple[Call, ...]


def _given(length: int, rank: int) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(1009 * length + rank))


def on_rank(info: Any, fn: Any) -> list[Case]:
    """The test cases, in the same order on every rank, until one goes wrong on some rank."""
    cases = []
    for length in LENGTHS:
        given = _given(length, info.rank)
        t = given.clone()
        returned, calls = call_learner(fn, t, where=f"with {length} elements")
        cases.append(Case(length, given, t, returned if isinstance(returned, torch.Tensor) else None, calls))
        if _any_rank(_went_wrong(info.rank, info.world_size, cases[-1])):
            break  # judged from here: the next lengths could put chunks of different sizes face to face
    return cases


def _went_wrong(rank: int, n: int, c: Case) -> bool:
    """What a rank can tell alone: a transfer off the ring, or not the sum (every rank's input is known)."""
    expected = torch.stack([_given(c.length, k).double() for k in range(n)]).sum(0)
    return off_ring_call(rank, n, c.calls) is not None or c.result.shape != expected.shape or not bool(
        torch.allclose(c.result.double(), expected, rtol=RTOL, atol=ATOL))


def _any_rank(flag: bool) -> bool:
    """Whether any rank raised the flag: the checker's own all_reduce, made between the learner's calls."""
    votes = torch.tensor([float(flag)])
    dist.all_reduce(votes)
    return bool(votes.item())


def judge(n: int, ranks: list[list[Case]]) -> str | None:
    for i in range(min(len(cases) for cases in ranks)):
        case = [cases[i] for cases in ranks]
        # a transfer off the ring is named before the values it spoils
        problem = _collective(case) or _not_a_ring(case, n) or _wrong_values(case, n) or _wrong_bytes(case, n)
        if problem:
            return problem
    if any(len(cases) < len(LENGTHS) for cases in ranks):  # the ranks stop early only for what the checks name
        return f"the ranks stopped after {min(len(cases) for cases in ranks)} test cases: a rank held a wrong sum."
    return None


def _collective(case: list[Case]) -> str | None:
    found = first_collective([c.calls for c in case])
    if found is None:
        return None
    r, call = found
    return (f"rank {r} called dist.{call.op} with {case[r].length} elements: this exercise allows only "
            "point-to-point calls (send, recv, isend, irecv, batch_isend_irecv), since the point is "
            "to build all_reduce out of them.")


def _wrong_values(case: list[Case], n: int) -> str | None:
    expected = torch.stack([c.given.double() for c in case]).sum(0)
    for r, c in enumerate(case):
        if c.result.shape != expected.shape:
            return f"rank {r}'s t has shape {tuple(c.result.shape)} afterwards, not {tuple(expected.shape)}."
        right = torch.isclose(c.result.double(), expected, rtol=RTOL, atol=ATOL)
        if bool(right.all()):
            continue
        i = int((~right).nonzero()[0])
        return (f"rank {r} holds wrong values with {c.length} elements: at index {i} it has "
                f"{float(c.result[i]):.6g} where the sum is {float(expected[i]):.6g} ({int(right.sum())} of "
                f"{c.length} elements right).{_value_hint(c, expected, right, n)}")
    return None


def _value_hint(c: Case, expected: torch.Tensor, right: torch.Tensor, n: int) -> str:
    if torch.equal(c.result, c.given):
        returned_sum = c.returned is not None and c.returned.shape == expected.shape and bool(
            torch.allclose(c.returned.double(), expected, rtol=RTOL, atol=ATOL))
        if returned_sum:
            return " Your function returned the sum but left t as it was: write the sum into t itself."
        return " t is unchanged: the sum must land in t itself (add into its chunks, or t.copy_(...))."
    if bool(torch.allclose(c.result.double() * n, expected, rtol=RTOL, atol=ATOL)):
        return (f" t holds the sum divided by the world size ({n}), a mean: all_reduce's default is a sum, so "
                "leave the sum in t.")
    bounds = torch.tensor([0, *[len(x) for x in torch.arange(c.length).tensor_split(n)]]).cumsum(0)
    done = [k for k in range(n) if bool(right[int(bounds[k]):int(bounds[k + 1])].all())]
    rounds = _rounds(c, n)
    if len(done) == 1 and int(right.sum()) == int(bounds[done[0] + 1] - bounds[done[0]]):
        lo, hi = int(bounds[done[0]]), int(bounds[done[0] + 1])
        return (f" Only chunk {done[0]} (elements {lo} to {hi - 1}) holds the sum: that is where reduce-scatter "
                "leaves it on this rank. The all-gather phase (n - 1 more rounds, passing the finished chunks "
                f"to the right) brings every chunk to every rank.{rounds}")
    if done:
        missing = [k for k in range(n) if k not in done]
        return (f" {_chunks(done).capitalize()} of {n} hold{'s' * (len(done) == 1)} the sum, {_chunks(missing)} "
                f"{'does' if len(missing) == 1 else 'do'} not.{rounds}")
    return rounds


def _chunks(ks: list[int]) -> str:
    """'chunk 2', 'chunks 0 and 1'."""
    if len(ks) == 1:
        return f"chunk {ks[0]}"
    return f"chunks {', '.join(map(str, ks[:-1]))} and {ks[-1]}"


def _rounds(c: Case, n: int) -> str:
    """What the number of sends says, when it is not the ring's 2(n - 1): rounds too many or missing."""
    sends, ring = sum(call.op in SENDS for call in c.calls), 2 * (n - 1)
    if sends == ring:
        return ""
    off = abs(sends - ring)
    what = f"{'one' if off == 1 else off} round{'s' * (off > 1)} {'too many' if sends > ring else 'missing'}"
    return (f" This rank made {sends} send{'s' * (sends != 1)} where a ring makes 2(n - 1) = {ring}, one per round: "
            f"{what} (each of the two phases runs n - 1 = {n - 1} round{'s' * (n > 2)}).")


def _not_a_ring(case: list[Case], n: int) -> str | None:
    for r, c in enumerate(case):
        found = off_ring_call(r, n, c.calls)
        if found is None:
            continue
        (call, round_), right, left = found, (r + 1) % n, (r - 1) % n
        if call.op in SENDS:
            return (f"rank {r} sent to rank {call.peer} in round {round_} with {c.length} elements; in a "
                    f"ring, rank r sends only to r + 1 (here rank {right}).")
        if call.peer is None:
            return (f"rank {r} received from any rank (src=None) in round {round_}; in a ring, rank r "
                    f"receives only from r - 1: name it (here rank {left}).")
        return (f"rank {r} received from rank {call.peer} in round {round_} with {c.length} "
                f"elements; in a ring, rank r receives only from r - 1 (here rank {left}).")
    return None


def ring_fraction(n: int) -> str:
    """2(n - 1)/n, the share of the tensor each rank of a ring all-reduce sends."""
    return f"{2 * (n - 1) / n:.2f}"


def _wrong_bytes(case: list[Case], n: int) -> str | None:
    size = case[0].given.element_size()
    low, high = 2 * (n - 1) * (case[0].length // n), 2 * (n - 1) * ceil_div(case[0].length, n)
    for r, c in enumerate(case):
        sent = sent_bytes(c.calls)
        if low * size <= sent <= high * size:
            continue
        largest = max((call.nbytes for call in c.calls if call.op in SENDS), default=0)
        if largest > ceil_div(c.length, n) * size:
            hint = (" Passing whole tensors around the ring gives the right sum, but each rank should send one "
                    "chunk per round.")
        else:
            hint = _rounds(c, n) or " Each of the 2(n - 1) rounds sends one chunk."
        chunk = (f"{c.length // n} elements, {low * size:,} bytes" if low == high else
                 f"{c.length // n} to {ceil_div(c.length, n)} elements, {low * size:,} to {high * size:,} bytes")
        return (f"rank {r} sent {sent:,} bytes for a tensor of {c.length} elements ({c.length * size:,} bytes); a "
                f"ring all-reduce sends 2(n - 1)/n = {ring_fraction(n)} of the tensor: 2(n - 1) = {2 * (n - 1)} chunks "
                f"of {chunk}." + hint)
    return None


def summary(records: dict[int, list[list[Case]]]) -> str:
    i = LENGTHS.index(SUMMARY_LENGTH)
    nbytes = records[min(records)][0][i].given.nbytes
    per_n = []
    for n, ranks in records.items():
        sent = [sent_bytes(cases[i].calls) for cases in ranks]
        per_n.append(f"n={n}: {'/'.join(f'{s:,}' for s in sent)} ({sent[0] / nbytes:.2f}× the tensor; 2(n - 1)/n "
                     f"= {ring_fraction(n)}) in {ops_used(ranks[0][i].calls)}")
    return (f"every rank held the sum at world sizes {', '.join(map(str, records))} with "
            f"{', '.join(map(str, LENGTHS))} elements, using point-to-point calls only, each rank sending only to "
            f"r + 1 and receiving only from r - 1. Bytes each rank sent for {SUMMARY_LENGTH} elements "
            f"({nbytes:,} bytes): " + "; ".join(per_n) + ".")


EXERCISE = Exercise("ring_allreduce", DESCRIPTION, on_rank, judge, summary, ring_allreduce, stub, hints=HINTS)
