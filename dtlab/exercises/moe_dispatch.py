"""Exercise ``moe_dispatch``: send each token to the rank of its expert with an all-to-all, and its output back.

Expert parallelism (the ``ep`` tier; GShard, Lepikhin et al. 2020) shares a mixture
of experts' E experts out over the n ranks: rank r holds experts r*m to r*m + m - 1
(m = E / n). Each rank routes its own tokens, so every rank has tokens for every
other rank's experts. One ``all_to_all_single`` moves them all at once: each rank
cuts its tokens, grouped by expert, into n parts -- part s goes to rank s -- and
receives one part from each rank. The parts are uneven (a router does not share
tokens out evenly), so the call needs their sizes: ``input_split_sizes`` (the rows
this rank sends to each rank) and ``output_split_sizes`` (the rows it receives from
each). Those a rank learns from the others first: a small all-to-all of the counts
of tokens per expert. After its experts ran, a second all-to-all with the splits
reversed (the *combine*) brings every output home, where each goes back to its
token's position.

``dtlab.tiers.ep.Exchange`` runs the same steps inside the ``moe`` model, with the
backward pass; this exercise is one layer's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtlab.exercises._agree import SizesDisagree, sizes_agreed
from dtlab.exercises._check import Exercise, ExerciseError, call_learner, ops_used, torch_call
from dtlab.exercises._moe_check import (
    CASES,
    EXPERTS,
    TOKENS,
    TOL,
    WIDTH,
    WORLD_SIZES,
    Record,
    draw_weights,
    every_expert,
    expected,
    expert,
    judge,
    route_of,
    routing,
    split_words,
    splits_of,
)
from dtlab.exercises._reach import Fingerprints, Found, HeldWatch, held_values, places
from dtlab.exercises._values import max_abs

DESCRIPTION = (
    "Write fn(x: torch.Tensor, expert_of: torch.Tensor, experts) -> torch.Tensor: one mixture-of-experts layer's "
    "forward under expert parallelism. The n ranks share out experts.count experts, experts.per_rank = m each: rank r "
    "holds experts r*m to r*m + m - 1, and only it can run them: experts(e, rows) runs expert e on rows (k × width, k "
    "may be 0) and returns its outputs, on the rank that holds e (anywhere else it raises; an expert's weights exist "
    "on its own rank only, drawn anew for every check). x (tokens × width, float32) are this rank's tokens and "
    "expert_of (int64) the expert each one chose. Return y shaped like x, y[t] = expert expert_of[t]'s output for "
    "x[t], in x's order. Every token must travel to the rank of its expert and its output back, with "
    "dist.all_to_all_single only (uneven split sizes, as many tokens go to some ranks as the router sends there): one "
    "call carries the tokens out (a token may take extra columns along, its expert's id say), one brings the outputs "
    "back, and any other call, of any kind, carries integers only (the counts each rank needs to size its buffers); "
    "no rank may ever hold a token of another rank that chose an expert it does not hold. Checked at world sizes 2 "
    f"and 4 ({EXPERTS} experts, {TOKENS} tokens of width {WIDTH} per rank), with uneven routing and with every token "
    f"choosing expert 0: every rank's output against each expert applied to its tokens in one process (within "
    f"{TOL:g}); which rows each expert ran on; the split sizes of the two all-to-alls that carry tokens (told by "
    "their floating-point rows); and, at every line of your code, the other ranks' tokens within its reach (found "
    "by their values). A rank's split sizes are compared with its peers' before each all-to-all is issued."
)

HINTS = (
    "Sort your tokens by expert: then the tokens for each rank lie side by side, and one all-to-all can send each "
    "rank its block. Its blocks have different sizes, which the receiver cannot guess: first tell every rank how "
    "many tokens you have for each of its experts. What comes back from the experts returns the same way, the "
    "sizes reversed, and goes back into the tokens' places.",
    "torch.argsort(expert_of, stable=True) groups the tokens by expert; torch.bincount(expert_of, "
    "minlength=experts.count) counts them; dist.all_to_all_single(got, counts) swaps the counts (an even split: m "
    "per rank), so got[s * m + j] is how many tokens rank s has for your j-th expert; counts.view(n, m).sum(1) and "
    "got.view(n, m).sum(1) are the rows to send to and receive from each rank: dist.all_to_all_single(output, input, "
    "output_split_sizes, input_split_sizes) with lists of ints; arrived.split(got.tolist()) cuts what arrived into "
    "(rank, expert) blocks; y[order] = back undoes the sort.",
    "order = argsort(expert_of, stable); counts = bincount(expert_of, minlength=E)\n"
    "got = empty_like(counts); all_to_all_single(got, counts)\n"
    "send = counts.view(n, m).sum(1).tolist(); recv = got.view(n, m).sum(1).tolist()\n"
    "arrived = empty(sum(recv), width); all_to_all_single(arrived, x[order], recv, send)\n"
    "chunks = arrived.split(got.tolist()); chunk i is for expert rank * m + i % m: run it\n"
    "back = empty_like(x); all_to_all_single(back, cat(outputs), send, recv)\n"
    "y = empty_like(x); y[order] = back; return y",
)


def moe_dispatch(x: torch.Tensor, expert_of: torch.Tensor, experts: Experts) -> torch.Tensor:
    """The reference: the counts, the tokens out (the dispatch), the local experts, the outputs back (the combine)."""
    n, m = dist.get_world_size(), experts.per_rank
    order = torch.argsort(expert_of, stable=True)  # grouped by expert, so by the rank that holds it
    counts = torch.bincount(expert_of, minlength=experts.count)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)  # got[s * m + j]: rank s's tokens for this rank's j-th expert
    send, recv = counts.view(n, m).sum(1).tolist(), got.view(n, m).sum(1).tolist()
    arrived = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(arrived, x[order], recv, send)  # output_split_sizes first, then input_split_sizes
    first = dist.get_rank() * m
    done = torch.cat([experts(first + i % m, rows) for i, rows in enumerate(arrived.split(got.tolist()))])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)  # the combine: the same routes, reversed
    y = torch.empty_like(x)
    y[order] = back  # each output to its token's place
    return y


def stub(x: torch.Tensor, expert_of: torch.Tensor, experts: Experts) -> torch.Tensor:
    """A starting point: replace the body (see ``describe('moe_dispatch')``)."""
    raise NotImplementedError(
        "write the dispatch and the combine: send each token to the rank that holds its expert with "
        "dist.all_to_all_single (uneven split sizes), run experts(e, rows) there, and bring each output back to its "
        "token's place; return y shaped like x (exercises.hint('moe_dispatch') when stuck)")


# -- the experts ----------------------------------------------------------------------------------------------
class Experts:
    """The experts of one rank: ``count`` in all, ``per_rank`` each, ``experts(e, rows)`` for this rank's own.

    Their weights are drawn for each check on this rank alone (``draw_weights``): a rank cannot compute another
    rank's experts, so the outputs of the tokens it sent away must come back."""

    def __init__(self, rank: int, world_size: int, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.count, self.per_rank, self.rank = EXPERTS, EXPERTS // world_size, rank
        self._weights = weights  # this rank's per_rank experts, in order
        self.ran: list[tuple[int, torch.Tensor]] = []  # (expert, rows): what each call got, for the judge

    def __call__(self, e: Any, rows: torch.Tensor) -> torch.Tensor:
        e = int(e)
        first, m = self.rank * self.per_rank, self.per_rank
        if not first <= e < first + m:
            raise ValueError(f"experts({e}, rows) on rank {self.rank}: this rank holds experts {first} to "
                             f"{first + m - 1} (m = {m} per rank, expert e on rank e // m); expert {e} is on rank "
                             f"{e // m}, so its tokens must be sent there")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != WIDTH:
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"experts({e}, rows): rows must be a k × {WIDTH} tensor (k tokens); got {got}")
        self.ran.append((e, rows.detach().float().clone()))
        return expert(self._weights, e - first, rows.detach().float())


# -- checking --------------------------------------------------------------------------------------------------
class _ForeignTokens:
    """Whether the learner's code holds another rank's token that chose an expert this rank does not hold, found
    by its values at every line it runs (a ``HeldWatch`` probe): gathering every token shows, whatever it is
    called and wherever the tokens are kept."""

    def __init__(self, rank: int, n: int, case: int) -> None:
        m = EXPERTS // n
        self.labels, tokens = [], []
        for s in range(n):
            x, expert_of = routing(s, n, case)
            for t, e in enumerate(expert_of.tolist()):
                if s != rank and e // m != rank:
                    self.labels.append(f"rank {s}'s token {t}, which chose expert {e} (on rank {e // m})")
                    tokens.append(x[t])
        self.prints = Fingerprints(tokens)
        self.first: str | None = None

    def __call__(self, found: list[Found], moment: str) -> None:
        if self.first is not None or not self.labels:
            return
        shares = self.prints.shares(held_values(found))
        held = [label for label, share in zip(self.labels, shares) if share > 0.99]
        if held:
            where = [f.where for f in found if self.prints.shares(held_values([f])).max() > 0.99]
            more = f" and {len(held) - 1} more such tokens" if len(held) > 1 else ""
            self.first = f"{held[0]}{more} {moment} (in {places(where, 3)})"


def on_rank(info: Any, fn: Any) -> list[Record]:
    records = []
    weights = draw_weights(EXPERTS // info.world_size)  # this rank's experts, for this check only
    for case, name in enumerate(CASES):
        x, expert_of = routing(info.rank, info.world_size, case)
        experts = Experts(info.rank, info.world_size, weights)
        foreign = _ForeignTokens(info.rank, info.world_size, case)
        try:
            with sizes_agreed(info.rank, info.world_size, f"moe/{_name(fn)}/{case}"), HeldWatch(foreign, fn):
                value, calls = call_learner(fn, x.clone(), expert_of.clone(), experts, where=f"with {name}")
        except ExerciseError as err:
            raise ExerciseError(_disagreed(err, case) or _split_error(err, info.rank, info.world_size, case)
                                or str(err)) from err
        out = value.detach().clone() if isinstance(value, torch.Tensor) else None
        records.append(Record(out, type(value).__name__, calls, tuple(experts.ran), foreign.first, weights))
    return records


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _disagreed(err: ExerciseError, case: int) -> str | None:
    """Split sizes a rank guessed, which its peer does not send: stopped on every rank before gloo aborts one."""
    cause = err.__cause__
    if not isinstance(cause, SizesDisagree):
        return None
    return (f"{str(cause)[0].upper()}{str(cause)[1:]} with {CASES[case]}. A rank cannot guess what it will receive: "
            "the router sends each rank as many tokens as chose its experts, which only the sender knows. Learn the "
            "sizes first, from a small all-to-all of the counts (each rank's tokens per expert), then size the "
            "output and its output_split_sizes by them. (Every rank was stopped before that call: gloo ends a "
            "process whose all-to-all sizes disagree with a peer's, with no error to show.)")


def _split_error(err: ExerciseError, rank: int, n: int, case: int) -> str | None:
    """An all_to_all_single that failed on its sizes: which sizes, against the ones the routing needs."""
    call = torch_call(err.__cause__ or err)
    if call is None or call[0] != "all_to_all_single":
        return None
    args = call[1]
    inp, out = args.get("input"), args.get("output")
    sent, got = args.get("input_split_sizes"), args.get("output_split_sizes")
    if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor) or inp.dim() != 2:
        return None
    send, recv = route_of(rank, n, case)
    given = (None if sent is None else list(sent), None if got is None else list(got))
    swapped = given in ((recv, send), (send, recv)) and inp.shape[0] == sum(given[1] or ())
    head = (f"rank {rank}'s all_to_all_single with {CASES[case]} failed ({str(err).split(': ')[-1]}): its input has "
            f"{inp.shape[0]} rows split as {split_words(sent)}, its output {out.shape[0]} rows split as "
            f"{split_words(got)}. ")
    if swapped:
        head += ("input_split_sizes and output_split_sizes are swapped: the signature is all_to_all_single(output, "
                 "input, output_split_sizes, input_split_sizes). ")
    return (head + "input_split_sizes are the rows this rank sends to each rank and add up to the input's rows; "
            "output_split_sizes the rows it receives from each and add up to the output's. Here the tokens go out "
            f"as {send} and come in as {recv}; their outputs come back the other way round.")


def summary(records: dict[int, list[list[Record]]]) -> str:
    worst = 0.0
    for n, ranks in records.items():
        for case in range(len(CASES)):
            weights = every_expert(ranks, case)
            for r, recs in enumerate(ranks):
                worst = max(worst, max_abs(recs[case].out, expected(weights, r, n, case)))
    n0 = min(records)
    calls = records[n0][0][0].calls
    return (f"at world sizes {', '.join(map(str, records))}, with {' and with '.join(CASES)}, every rank's output "
            f"matched its tokens' experts applied in one process (largest difference {worst:.1g}; each "
            "expert's weights drawn for this check on its own rank alone, so that no rank could compute another's "
            "experts), every expert ran on exactly the tokens that chose it, on its own rank, and no rank held "
            f"another rank's token routed elsewhere. Rank 0 at n={n0} with uneven routing made {ops_used(calls)}: "
            f"{splits_of(calls) or 'split sizes not recorded'} (rows to and from ranks 0..{n0 - 1}).")


EXERCISE = Exercise("moe_dispatch", DESCRIPTION, on_rank, judge, summary, moe_dispatch, stub,
                    world_sizes=WORLD_SIZES, allowed_world_sizes=WORLD_SIZES, hints=HINTS)
