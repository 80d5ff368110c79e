"""The moe_dispatch exercise's test cases and its judge: the routing, the experts, and what each rank did with them.

Every rank and the judge make the same tokens and routing from fixed seeds, so the judge knows where every token
should have gone: it names a token by its rank and position, and tells what went wrong by its signature -- an even
split, a wrong expert-to-rank mapping, swapped split sizes, a missing combine, outputs in the order of the experts.
The experts' weights are not among them: each rank draws its own experts' afresh for every check and reports them
to the judge, so that no rank can compute another rank's experts itself (nothing to import, nothing to predict).
The calls that carry tokens are told from the others by what they carry: floating-point rows of at least WIDTH
values (a token, with any extra columns a learner sends along); the counts are integers.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtlab.exercises._check import Call, ops_used
from dtlab.exercises._values import max_abs

# per rank: 12 tokens of 6 values; 8 experts, 4 per rank at n = 2, 2 at n = 4. A row of 6 values is wider than any
# rank's row of counts (m = 4 or 2 experts), so no shape of the counts passes for a token
TOKENS, WIDTH, EXPERTS = 12, 6, 8
WORLD_SIZES = (2, 4)
CASES = ("uneven routing", "every token choosing expert 0")
TOL = 1e-5
_SKEW = torch.tensor([6.0, 1.0, 3.0, 0.5, 2.0, 0.5, 4.0, 1.0])  # a router that prefers some experts


def draw_weights(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and biases of ``m`` experts, drawn from the operating system's randomness: new for every check."""
    gen = torch.Generator().manual_seed(secrets.randbits(63))
    return torch.randn(m, WIDTH, WIDTH, generator=gen), torch.randn(m, WIDTH, generator=gen)


def expert(weights: tuple[torch.Tensor, torch.Tensor], e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (an index into ``weights``) applied to ``rows``: an affine map of its own."""
    w, b = weights
    return rows @ w[e] + b[e]


def expected(weights: tuple[torch.Tensor, torch.Tensor], rank: int, n: int, case: int) -> torch.Tensor:
    """Rank ``rank``'s right output: each of its tokens through the expert it chose (``weights``: every expert's)."""
    x, expert_of = routing(rank, n, case)
    return torch.stack([expert(weights, int(e), x[t:t + 1])[0] for t, e in enumerate(expert_of.tolist())])


def routing(rank: int, n: int, case: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (TOKENS × WIDTH) and the expert each chose, at world size ``n`` in case ``case``."""
    gen = torch.Generator().manual_seed(9178 + 101 * n + rank + 1000 * case)
    x = torch.randn(TOKENS, WIDTH, generator=gen)
    if case == 0:
        return x, torch.multinomial(_SKEW, TOKENS, replacement=True, generator=gen)
    return x, torch.zeros(TOKENS, dtype=torch.int64)


def route_of(rank: int, n: int, case: int) -> tuple[list[int], list[int]]:
    """The rows rank ``rank`` sends to each rank, and receives from each, when every token goes to its expert."""
    m = EXPERTS // n
    send = torch.bincount(routing(rank, n, case)[1] // m, minlength=n).tolist()
    recv = [int((routing(s, n, case)[1] // m == rank).sum()) for s in range(n)]
    return send, recv


def split_words(splits: object) -> str:
    return "evenly (no split sizes given)" if splits is None else str(list(splits))  # type: ignore[call-overload]


@dataclass(frozen=True)
class Record:
    """One rank's run of one case: what fn returned, its calls, each expert call's rows, when and where it first
    held another rank's token routed elsewhere (None: never), and its own experts' weights and biases."""

    out: torch.Tensor | None
    returned: str
    calls: tuple[Call, ...]
    ran: tuple[tuple[int, torch.Tensor], ...]
    foreign: str | None
    weights: tuple[torch.Tensor, torch.Tensor]


def every_expert(ranks: Sequence[Sequence[Record]], case: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's weights and biases, put together from what each rank drew for its own."""
    return (torch.cat([recs[case].weights[0] for recs in ranks]), torch.cat([recs[case].weights[1] for recs in ranks]))


def judge(n: int, ranks: list[list[Record]]) -> str | None:
    for case, name in enumerate(CASES):
        weights = every_expert(ranks, case)
        for r, recs in enumerate(ranks):
            rec = recs[case]
            # the recorded calls name a mistake most precisely; what the rank held catches what no recorder saw
            problem = (_other_ops(r, rec, name) or _token_calls(r, n, case, rec) or _foreign(r, rec, name)
                       or _rows(r, n, case, rec) or _output(r, n, case, rec, weights))
            if problem:
                return problem
    return None


@functools.cache
def _dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _floating(call: Call) -> bool:
    dtype = _dtype(call.dtype)
    return dtype is not None and dtype.is_floating_point


def _other_ops(r: int, rec: Record, name: str) -> str | None:
    """Any call may carry integers (the counts); floating-point values travel only in all_to_all_single."""
    other = next((c for c in rec.calls if c.op != "all_to_all_single" and _floating(c)), None)
    if other is None:
        return None
    # said only where the rank did hold other ranks' tokens: what a gather carried is known by its values
    why = (" It sends every token to every rank: each rank then holds all the tokens, though its experts need "
           "only those that chose them." if other.op.startswith(("all_gather", "broadcast")) and rec.foreign else "")
    return (f"rank {r} called dist.{other.op} on {other.dtype} values with {name}: the tokens travel with "
            "dist.all_to_all_single only, each token to the one rank that holds its expert; another call may carry "
            "the counts (integers), never a token or anything else of floating point." + why)


def _foreign(r: int, rec: Record, name: str) -> str | None:
    if rec.foreign is None:
        return None
    return (f"rank {r} held {rec.foreign} with {name}. An all-to-all sends each token only to the rank of its "
            "expert: a rank never holds another rank's token that chose an expert elsewhere (an all_gather or a "
            "broadcast of the tokens would put every token everywhere).")


def _token_calls(r: int, n: int, case: int, rec: Record) -> str | None:
    """The two all-to-alls that carry tokens: out with the routing's splits, back with them reversed."""
    calls = [c for c in rec.calls if c.op == "all_to_all_single"]
    if any(c.input_splits is None for c in calls):
        return None  # split sizes not recorded: the rows the experts ran on tell the routing instead
    carrying = [c for c in calls if carries_rows(c)]
    name = CASES[case]
    if len(carrying) < 2:
        what = "none of them" if not carrying else "only one, the tokens going out,"
        made = f"made {ops_used(calls)} with {name}, and {what} carried" if calls else (
            f"made no all_to_all_single with {name}, so none carried")
        return (f"rank {r} {made} tokens (floating-point rows of {WIDTH} values or more): the tokens "
                "go out in one all_to_all_single (the dispatch) and their outputs come back in another, with the "
                "split sizes reversed (the combine), before they go back to their tokens' places.")
    if len(carrying) > 2:
        return (f"rank {r} made {len(carrying)} all_to_all_single calls that carried floating-point rows of {WIDTH} "
                f"values or more with {name}: one for the tokens out, one for their outputs back (the counts go as "
                "integers).")
    send, recv = route_of(r, n, case)
    dispatch, combine = carrying
    return (_dispatch_splits(r, n, case, dispatch, send, recv)
            or _splits(r, name, "the combine", combine, recv, send, "back the way its tokens came: the split sizes "
                       "of the dispatch, reversed (what it received it sends back, what it sent comes back)"))


def carries_rows(call: Call) -> bool:
    """Whether an all-to-all carried tokens or their outputs: floating-point rows of WIDTH values or more (a token
    may travel with extra columns, its expert's id say), not the counts, which are integers. A rank that sends
    nothing (every token to its own experts) carries zero rows in zero bytes."""
    dtype = _dtype(call.dtype)
    if dtype is None or not dtype.is_floating_point:
        return False
    rows = sum(call.input_splits or ())
    return call.nbytes == 0 if rows == 0 else call.nbytes >= WIDTH * rows * dtype.itemsize


def _dispatch_splits(r: int, n: int, case: int, call: Call, send: list[int], recv: list[int]) -> str | None:
    name, sent, got = CASES[case], list(call.input_splits or ()), list(call.output_splits or ())
    if (sent, got) == (send, recv):
        return None
    head = (f"rank {r}'s dispatch (the all_to_all_single carrying its tokens) with {name} sent {sent} rows to ranks "
            f"0..{n - 1} and received {got}; its tokens' experts need {send} out and the other ranks send {recv}")
    m = EXPERTS // n
    modulo = torch.bincount(routing(r, n, case)[1] % n, minlength=n).tolist()
    if (sent, got) == (recv, send):
        return f"{head}: input_split_sizes and output_split_sizes are swapped (output_split_sizes comes first)."
    if sent == [TOKENS // n] * n != send:
        return (f"{head}: an even split. Without input_split_sizes and output_split_sizes all_to_all_single cuts "
                "its input into n equal parts; a router's parts are uneven, so pass the sizes (the receiver learns "
                "its own from a first all-to-all of the counts).")
    if sent == modulo != send:
        return (f"{head}: that sends the tokens of expert e to rank e % n. Rank r holds experts r*m to r*m + m - 1 "
                f"(m = {m}), so expert e is on rank e // m.")
    return head + ": input_split_sizes are the rows for each rank, output_split_sizes the rows from each."


def _splits(r: int, name: str, what: str, call: Call, want_sent: list[int], want_got: list[int],
            how: str) -> str | None:
    sent, got = list(call.input_splits or ()), list(call.output_splits or ())
    if (sent, got) == (want_sent, want_got):
        return None
    return (f"rank {r}'s {what} with {name} sent {sent} rows and received {got}, where {want_sent} go out and "
            f"{want_got} come in: {how}.")


def _origins(n: int, case: int) -> dict[tuple[float, ...], tuple[int, int, int]]:
    """Every token by its values: (rank, position, expert)."""
    out = {}
    for s in range(n):
        x, expert_of = routing(s, n, case)
        for t, e in enumerate(expert_of.tolist()):
            out[tuple(x[t].tolist())] = (s, t, e)
    return out


def _rows(r: int, n: int, case: int, rec: Record) -> str | None:
    """Each of this rank's experts must run on exactly the tokens that chose it, from every rank, once each."""
    origins, name, m = _origins(n, case), CASES[case], EXPERTS // n
    seen: dict[tuple[int, int], int] = {}
    for e, rows in rec.ran:
        for row in rows:
            origin = origins.get(tuple(row.tolist()))
            if origin is None:
                return (f"expert {e} on rank {r} ran on a row that is none of the tokens with {name}: rows cut at "
                        "the wrong places, or a buffer that never received a token. Each expert must run on the "
                        "tokens that chose it, as they arrived.")
            s, t, chose = origin
            if chose != e:
                return (f"expert {e} on rank {r} ran on rank {s}'s token {t} with {name}, but that token chose "
                        f"expert {chose}: the rows that arrive from rank s come grouped by expert, as many for each "
                        "as rank s counted; cut them by those counts.")
            seen[(s, t)] = seen.get((s, t), 0) + 1
    for (s, t), times in seen.items():
        if times > 1:
            return f"rank {s}'s token {t} ran {times} times on rank {r} with {name}: once is right."
    for (s, t, e) in sorted(origins.values()):
        if e // m == r and (s, t) not in seen:
            return (f"rank {s}'s token {t} chose expert {e}, on rank {r}, but never reached it with {name}: every "
                    "token must run on its expert.")
    return None


def _output(r: int, n: int, case: int, rec: Record, weights: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    x, expert_of = routing(r, n, case)
    want = expected(weights, r, n, case)
    name, y = CASES[case], rec.out
    if y is None:
        return f"rank {r} returned {rec.returned} with {name}: return y, a tensor shaped like x {tuple(x.shape)}."
    if y.shape != want.shape:
        received = sum(route_of(r, n, case)[1])
        why = (" That is the number of rows its experts ran on: their outputs belong to the tokens' ranks, and go "
               "back with a second all_to_all_single (the combine)." if y.shape[0] == received else "")
        return f"rank {r} returned a tensor of shape {tuple(y.shape)} with {name}, not {tuple(want.shape)}.{why}"
    if max_abs(y, want) <= TOL:
        return None
    order = torch.argsort(expert_of, stable=True)
    if max_abs(y, want[order]) <= TOL or _same_rows(y, want):
        return (f"rank {r}'s outputs are right but in the wrong places with {name}: in the order the tokens were "
                "sent (sorted by expert), not in x's order. Put each output back at its token's position "
                "(y[order] = back).")
    if max_abs(y, x) <= TOL:
        return f"rank {r} returned its tokens unchanged with {name}: y[t] is expert expert_of[t]'s output for x[t]."
    return _only_its_own(r, n, name, y, want, expert_of) or _wrong_row(r, name, y, want, expert_of)


def _only_its_own(r: int, n: int, name: str, y: torch.Tensor, want: torch.Tensor,
                  expert_of: torch.Tensor) -> str | None:
    """Right for the tokens whose experts are on this rank, wrong for the others: those outputs did not come back."""
    home = expert_of // (EXPERTS // n)
    wrong = (y - want).abs().amax(-1) > TOL
    if not bool(wrong.any()) or bool(wrong[home == r].any()):
        return None
    t = int(wrong.nonzero()[0])
    return (f"rank {r}'s outputs are right for the tokens whose experts it holds, but not for those whose experts "
            f"are on other ranks with {name} (its token {t}, expert {int(expert_of[t])} on rank {int(home[t])}: "
            f"{[round(v, 4) for v in y[t].tolist()]}, where that expert gives "
            f"{[round(v, 4) for v in want[t].tolist()]}). An expert's weights exist on its own rank only, drawn anew "
            "for every check: those outputs can only come back from there, in the combine.")


def _wrong_row(r: int, name: str, y: torch.Tensor, want: torch.Tensor, expert_of: torch.Tensor) -> str:
    bad = int((y - want).abs().amax(-1).argmax())
    return (f"rank {r}'s output for its token {bad} (expert {int(expert_of[bad])}) is wrong with {name}: "
            f"{[round(v, 4) for v in y[bad].tolist()]} where the expert gives "
            f"{[round(v, 4) for v in want[bad].tolist()]}.")


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    key = sorted(map(tuple, a.round(decimals=4).tolist()))
    return key == sorted(map(tuple, b.round(decimals=4).tolist()))


def splits_of(calls: Sequence[Call]) -> str:
    """What the all-to-alls that carried tokens sent and received, for the summary."""
    carried = [c for c in calls if c.op == "all_to_all_single" and c.input_splits is not None and carries_rows(c)]
    return "; ".join(f"its {what} sent {list(c.input_splits or ())} rows and received {list(c.output_splits or ())}"
                     for what, c in zip(("dispatch", "combine"), carried))
