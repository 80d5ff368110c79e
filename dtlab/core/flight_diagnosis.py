"""Why a run hung, read from its ranks' Flight Recorder dumps: the rank, the collective, its sequence number.

Every process group numbers its collectives on each rank (``collective_seq_id``, from 1). A collective can
only complete once every member of its group has issued it with the same op and sizes, so a hang shows in
the dumps as the first sequence number, in some group, where the members disagree. ``diagnose`` finds that
point in every group, takes the one that happened first (the others wait on it), and says which kind it is:

- ``order``: every member issued #N, but not the same collective (op, sizes or dtype): the ranks call their
  collectives in different orders, or one calls a collective the others do not;
- ``wrong_group``: a member never issued #N, but issued the same collective (op, sizes) on another group;
- ``skipped``: a member never issued #N and went on past it (it issued later collectives elsewhere, or
  finished its program);
- ``stuck``: a member never issued #N and has issued nothing since its last collective, which completed long
  before its dump: it is busy outside torch.distributed (computing, loading, waiting on something else);
- ``missing``: a member never issued #N, for none of the reasons above; ``no_dump``: a member left no dump;
- ``incomplete``: every member issued the same #N, and it is still pending in a dump (a transport or peer
  failure);
- ``none``: every collective in the dumps matched on every member.

Which rank is named: the lowest rank of the majority is the reference (with two ranks, rank 0); the named
rank is one that departs from it -- the one that skipped, sat stuck, issued another collective, or issued
it on another group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from dtlab.core.flight import Dump, Entry, group_label, read_all

# Sizes must agree across ranks for these ops (an all-to-all's splits, a gather's or scatter's root differ).
_SAME_SIZES = {"all_reduce", "broadcast", "reduce", "all_gather", "_allgather_base", "reduce_scatter",
               "_reduce_scatter_base", "barrier", "allreduce_coalesced"}


@dataclass(frozen=True)
class Diagnosis:
    """What the dumps say: ``kind`` (see the module), the ``rank`` named, its collective ``op`` and ``seq`` on
    ``group``; ``text`` says it in a sentence or two."""

    kind: str
    rank: int | None = None
    op: str = ""
    seq: int | None = None
    group: str = ""
    text: str = ""
    entries: tuple[Entry, ...] = field(default=(), repr=False)  # the entries at the point of divergence

    def __str__(self) -> str:
        return self.text


@dataclass
class _Divergence:
    group: str
    seq: int
    present: dict[int, Entry]
    missing: list[int]

    @property
    def first_s(self) -> float:
        return min(e.created_s for e in self.present.values())


def _signature(e: Entry) -> tuple:
    return (e.op, e.dtype, e.input_sizes if e.op in _SAME_SIZES else ())


def _members(dumps: Mapping[int, Dump], group: str) -> list[int]:
    ranks = {r for d in dumps.values() for r in d.groups.get(group, ("", ()))[1]}
    return sorted(ranks or {r for r, d in dumps.items() if any(e.group == group for e in d.entries)})


def _first_divergence(dumps: Mapping[int, Dump], group: str) -> _Divergence | None:
    members = [r for r in _members(dumps, group) if r in dumps]  # a rank without a dump cannot be judged here
    by_rank = {r: {e.seq: e for e in dumps[r].entries if e.group == group} for r in members if r in dumps}
    seqs = [set(s) for s in by_rank.values() if s]
    if not seqs:
        return None
    start = max(min(s) for s in seqs)  # a ring buffer may have dropped the oldest entries of some ranks
    for n in range(start, max(max(s) for s in seqs) + 1):
        present = {r: s[n] for r, s in by_rank.items() if n in s}
        missing = [r for r in members if r not in present]
        if missing or len({_signature(e) for e in present.values()}) > 1:
            return _Divergence(group, n, present, missing)
    return None


def _descs(dumps: Mapping[int, Dump], group: str) -> dict[int, str]:
    return {r: d.groups[group][0] for r, d in dumps.items() if group in d.groups}


def _group_note(dumps: Mapping[int, Dump], groups: list[str]) -> str:
    """Where the ranks name the same process group differently: they made their groups in different orders."""
    notes = []
    for g in dict.fromkeys(groups):
        descs = _descs(dumps, g)
        if len(set(descs.values())) > 1:
            names = ", ".join(f"'{d}' on rank {r}" for r, d in sorted(descs.items()))
            notes.append(f"process group {g} is {names}")
    return ("; ".join(notes) + ": the ranks created their process groups in different orders (new_group must be "
            "called in the same order on every rank).") if notes else ""


def _order(dumps: Mapping[int, Dump], d: _Divergence) -> Diagnosis:
    counts = Counter(_signature(e) for e in d.present.values())
    top = max(counts.values())
    ref = min(r for r, e in d.present.items() if counts[_signature(e)] == top)
    odd = min(r for r, e in d.present.items() if _signature(e) != _signature(d.present[ref]))
    mine, theirs = d.present[odd], d.present[ref]
    text = (f"rank {odd} issued {mine.label()} ({mine.shape()}{_at(mine)}) where rank {ref} issued {theirs.op} "
            f"#{d.seq} ({theirs.shape()}{_at(theirs)}): neither can complete. The ranks call their collectives in "
            f"a different order, or one calls a collective the other does not.")
    return Diagnosis("order", odd, mine.op, d.seq, mine.group, text, tuple(d.present.values()))


def _at(e: Entry) -> str:
    return f", from {e.where}" if e.where else ""


def _elsewhere(dumps: Mapping[int, Dump], rank: int, root: _Divergence, divs: list[_Divergence]) -> Entry | None:
    """The same collective as ``root``'s, issued by ``rank`` on another group and unmatched there."""
    sig = _signature(next(iter(root.present.values())))
    for d in divs:
        e = d.present.get(rank)
        if d.group != root.group and e is not None and _signature(e) == sig:
            return e
    return None


def _wrong_group(dumps: Mapping[int, Dump], root: _Divergence, other: Entry) -> Diagnosis:
    here = next(iter(root.present.values()))
    sides = {min(root.present): here, other.rank: other}
    ref = min(sides)
    named = max(sides)  # the side without the reference rank
    e, f = sides[named], sides[ref]
    note = _group_note(dumps, [e.group, f.group])
    text = (f"rank {named} issued {e.label()} ({e.shape()}{_at(e)}), while rank {ref} issued the same collective "
            f"as {f.label()}: each waits in a group where the other never issues it -- a collective on the wrong "
            f"group. {note}").strip()
    return Diagnosis("wrong_group", named, e.op, e.seq, e.group, text, (e, f))


def _missing(dumps: Mapping[int, Dump], root: _Divergence, divs: list[_Divergence]) -> Diagnosis:
    here = next(iter(root.present.values()))
    m = root.missing[0]
    who = ", ".join(f"rank {r}" for r in sorted(root.present))
    if (other := _elsewhere(dumps, m, root, divs)) is not None:
        return _wrong_group(dumps, root, other)
    dump, head = dumps[m], f"rank {m} never issued {here.label()} ({here.shape()}), which {who} issued{_at(here)}"
    later = sorted((e for e in dump.entries if e.created_s > root.first_s), key=lambda e: e.created_s)
    if later:
        text = (f"{head}: rank {m} skipped it and went on to {later[0].label()} "
                f"({later[0].created_s - root.first_s:.3f} s later{_at(later[0])}), where it waits for them.")
        return Diagnosis("skipped", m, here.op, root.seq, root.group, text, (here, later[0]))
    if dump.reason == "end":
        text = f"{head}: rank {m} skipped it and finished its program."
        return Diagnosis("skipped", m, here.op, root.seq, root.group, text, (here,))
    last = dump.last()
    idle = dump.dumped_s - last.created_s if last is not None and dump.dumped_s else 0.0
    since = f"its last collective, {last.label()}, was issued {idle:.1f} s before its dump" if last else ""
    if last is not None and last.retired and idle >= max(0.5, here.timeout_s / 2):
        text = (f"{head}: rank {m} is stuck outside torch.distributed -- {since} and completed, the others "
                f"entered #{root.seq} {here.created_s - last.created_s:.3f} s after it, and rank {m} issued nothing "
                f"since (computing, loading data, or waiting on something that is not a collective).")
        return Diagnosis("stuck", m, here.op, root.seq, root.group, text, (here, last))
    text = f"{head}" + (f"; {since}." if since else ".")
    return Diagnosis("missing", m, here.op, root.seq, root.group, text, (here,))


def _pending(dumps: Mapping[int, Dump]) -> Diagnosis:
    stuck = [e for d in dumps.values() for e in d.entries if not e.retired]
    silent = sorted({r for d in dumps.values() for g in d.groups.values() for r in g[1]} - set(dumps))
    if silent:
        last = min(stuck, key=lambda e: e.created_s) if stuck else max(
            (d.last() for d in dumps.values() if d.last() is not None), key=lambda e: e.created_s, default=None)
        waited = f"; rank {last.rank} was last in {last.label()}" if last is not None else ""
        text = f"rank {silent[0]} left no Flight Recorder dump (it died, or was killed before it wrote one){waited}."
        return Diagnosis("no_dump", silent[0], last.op if last else "", last.seq if last else None,
                         last.group if last else "", text, (last,) if last else ())
    if not stuck:
        n = sum(len(d.entries) for d in dumps.values())
        return Diagnosis("none", text=f"every collective in the dumps ({n} entries) was issued by every member of "
                                      "its group, in the same order: nothing in them shows a program bug.")
    e = min(stuck, key=lambda e: e.created_s)
    text = (f"every member issued {e.label()} ({e.shape()}), and it did not finish on rank {e.rank}: not a "
            f"program bug -- a transport or peer failure (see the ranks' errors).")
    return Diagnosis("incomplete", e.rank, e.op, e.seq, e.group, text, (e,))


def diagnose(dumps: Mapping[int, Dump] | Mapping[int, bytes] | str) -> Diagnosis:
    """The first point where the ranks' collectives disagree, and what kind of bug it shows (see the module).

    ``dumps``: ``read_all``'s Dumps, a run's ``flight`` (rank -> bytes), or a folder of ``rank_<R>`` files."""
    if isinstance(dumps, str) or any(not isinstance(d, Dump) for d in dict(dumps).values()):
        dumps = read_all(dumps)  # type: ignore[arg-type]
    groups = sorted({e.group for d in dumps.values() for e in d.entries})
    divs = [d for g in groups if (d := _first_divergence(dumps, g)) is not None]
    if not divs:
        return _pending(dumps)
    root = min(divs, key=lambda d: d.first_s)
    if not root.missing or len({_signature(e) for e in root.present.values()}) > 1:
        return _order(dumps, root)
    return _missing(dumps, root, divs)


__all__ = ["Diagnosis", "diagnose", "group_label"]
