"""PyTorch Flight Recorder dumps of a run, as tables and a hang report.

A run made with ``RunConfig(flight_recorder=True)`` (or ``dtlab run --flight-recorder``) holds every
rank's dump in ``result.flight``; a failed one in ``error.flight``; a saved one in
``OUT/flight_recorder/rank_<R>``. ``frame`` lays them out as one row per collective per rank, in the
order issued; ``report`` says why a run hung -- dtlab's reading of the dumps (``diagnose``: the rank, the
collective, its sequence number) beside torch's own analyser's verdict. Reading the dumps and diagnosing
them live in ``dtlab.core.flight`` and ``dtlab.core.flight_diagnosis`` (the bug zoo's reports use them too).

dtlab's CommRecorder against PyTorch's Flight Recorder: did both see the same collectives, in the same order?

Run a job with ``record=True`` (dtlab's recorder, the default) and ``RunConfig(flight_recorder=True)``;
``crosscheck(result)`` lines up, rank by rank, dtlab's events (op and bytes, in the order issued) with
Flight Recorder's entries (in the order recorded), after mapping dtlab's op names and byte conventions to
Flight Recorder's on gloo (``GLOO_NAMES``, checked on torch 2.13), and returns every difference: a
collective only one of them saw, or one both saw with another op or size.

Left out of the comparison, and listed as such with the reason (``CrossCheck.excluded``):

- point-to-point ops (send, recv, their async and batched forms) on a rank whose dump holds none: gloo
  records no point-to-point op into Flight Recorder on torch 2.13, so there is nothing to compare with;
- dtlab's ``wait`` rows: the wait on an asynchronous op, not a collective of its own;
- collectives that are not the training job's: none today (no dtlab launcher issues a collective of its
  own between a rank's process group start and its end); the list says so.
"""

from __future__ import annotations

import difflib
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dtlab.core.flight import Dump, Entry, dump_files, read_all, torch_verdict
from dtlab.core.flight_diagnosis import Diagnosis, diagnose
from dtlab.core.results import save_flight

_WHEN = {"end": "at its end", "error": "when it raised", "request": "on the launcher's request",
         "terminated": "when torchrun's agent stopped it"}
COLUMNS = ("rank", "group", "group_desc", "seq", "op", "input_sizes", "output_sizes", "dtype", "bytes", "retired",
           "state", "created_s", "where")


def _dumps(source: Any) -> dict[int, Dump]:
    """Dumps from a RunResult, a RankError, a rank -> bytes mapping, or a folder."""
    flight = getattr(source, "flight", source)
    if isinstance(flight, str | os.PathLike):
        return read_all(flight)
    if isinstance(flight, Mapping) and flight and all(isinstance(v, Dump) for v in flight.values()):
        return dict(flight)
    if not flight:
        raise ValueError("no Flight Recorder dumps: run with RunConfig(flight_recorder=True) "
                         "(dtlab run --flight-recorder, or launch(..., flight_recorder=True))")
    return read_all(flight)


def frame(source: Any) -> Any:
    """One row per collective per rank, in the order each rank issued them (``COLUMNS``); ``created_s`` is
    seconds after the first collective of the run."""
    import pandas as pd

    dumps = _dumps(source)
    rows = [{c: getattr(e, c) for c in COLUMNS} for d in dumps.values() for e in d.entries]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    if not df.empty:
        df["created_s"] -= df["created_s"].min()
        df = df.sort_values(["rank", "created_s"], kind="stable").reset_index(drop=True)
    return df


def diagnosis(source: Any) -> Diagnosis:
    """dtlab's reading of the dumps (see ``dtlab.core.flight_diagnosis``)."""
    return diagnose(_dumps(source))


def report(source: Any) -> str:
    """dtlab's diagnosis, each rank's last collective, and torch's ``fr_trace`` verdict, as text."""
    dumps = _dumps(source)
    lines = [f"Flight Recorder (dtlab): {diagnose(dumps)}", "last collective issued per rank:"]
    for rank, d in dumps.items():
        last = d.last()
        # not "finished"/"pending": gloo marks a collective that timed out as retired too (see dtlab.core.flight)
        ago = f", {d.dumped_s - last.created_s:.1f} s before its dump" if last is not None and d.dumped_s else ""
        state = "no collective" if last is None else f"{last.label()}{ago}"
        lines.append(f"  rank {rank}: {state} (dumped {_WHEN.get(d.reason, 'at a point not recorded')})")
    raw = getattr(source, "flight", source)
    if isinstance(raw, str | os.PathLike):
        raw = {r: p.read_bytes() for r, p in dump_files(raw).items()}
    if isinstance(raw, Mapping) and all(isinstance(v, bytes) for v in raw.values()):
        lines.append(torch_verdict(raw))
    return "\n".join(lines)


def saved_report(source: Any, out_dir: str | os.PathLike[str]) -> str:
    """``report``, after saving the dumps as ``out_dir/flight_recorder/rank_<R>`` (a failed run's, say)."""
    folder = save_flight(getattr(source, "flight", source), out_dir)
    return f"{report(source)}\nwrote {folder}/rank_* (dtlab.read.flight.report('{folder}') reads them again)"


__all__ = ["COLUMNS", "GLOO_NAMES", "CrossCheck", "Diagnosis", "compare_rank", "crosscheck", "diagnose", "diagnosis",
           "frame", "report", "saved_report"]

# dtlab op -> the op Flight Recorder records for it on gloo (torch 2.13, checked here). gloo runs a
# reduce-scatter as an all-reduce of the whole input (then keeps its chunk), and names every all-gather
# and all-to-all form by its plain name.
GLOO_NAMES = {
    "all_reduce": "all_reduce", "broadcast": "broadcast", "broadcast_coalesced": "broadcast", "reduce": "reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "all_reduce",
    "reduce_scatter": "all_reduce", "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "gather": "gather", "scatter": "scatter", "barrier": "barrier",
    "send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "batch_isend_irecv": "send/recv",
}
P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}
NOT_COLLECTIVES = {"wait": "dtlab's record of waiting on an asynchronous op, not a collective of its own"}
NOT_THE_JOBS: dict[str, str] = {}  # op -> why it is not the training job's (none today: see the module)
P2P_REASON = "gloo records no point-to-point op into Flight Recorder (torch 2.13): nothing to compare with"


@dataclass
class CrossCheck:
    """Every difference between the two recorders (``differences``: dict rows), what was left out and why
    (``excluded``), and how many collectives each side had per rank (``compared``: rank -> (dtlab, FR))."""

    differences: list[dict[str, Any]]
    excluded: list[dict[str, Any]]
    compared: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.differences, columns=["rank", "kind", "dtlab", "flight_recorder"])

    def __str__(self) -> str:
        counts = ", ".join(f"rank {r}: {a} vs {b}" for r, (a, b) in self.compared.items())
        lines = [f"compared (dtlab vs Flight Recorder): {counts}",
                 f"{len(self.differences)} difference(s)" + (":" if self.differences else "")]
        lines += [f"  rank {d['rank']} {d['kind']}: dtlab {d['dtlab'] or '-'} | Flight Recorder "
                  f"{d['flight_recorder'] or '-'}" for d in self.differences]
        lines.append("left out:" if self.excluded else "left out: nothing")
        lines += [f"  rank {x['rank']}: {x['count']} x {x['op']} ({x['source']}): {x['reason']}" for x in self.excluded]
        if not NOT_THE_JOBS:
            lines.append("  collectives not the training job's: none")
        return "\n".join(lines)


def _fr_bytes(e: Entry, group_size: int) -> int:
    """Flight Recorder's entry in dtlab's byte convention (nccl-tests'): an all-gather counts what it gathers
    (Flight Recorder's output sizes for a functional all-gather are one rank's chunk, so from the input), a
    scatter what it receives."""
    if e.op == "all_gather":
        return e.bytes * max(1, group_size)
    return e.output_bytes if e.op == "scatter" else e.bytes


def _fr_tokens(dump: Dump) -> list[tuple[str, int, str]]:
    out = []
    for e in sorted(dump.entries, key=lambda e: e.created_s):
        size = len(dump.groups.get(e.group, ("", ()))[1])
        out.append((e.op, _fr_bytes(e, size), f"{e.op} {_fr_bytes(e, size)} B ({e.label().split(' ', 1)[1]})"))
    return out


def _dtlab_tokens(events: list[dict[str, Any]], rank: int, fr_has_p2p: bool,
                  excluded: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    out, left_out = [], Counter()
    for ev in sorted((e for e in events if e.get("rank") == rank), key=lambda e: e.get("seq", 0)):
        op, nbytes = str(ev.get("op")), int(ev.get("bytes") or 0)
        if op in NOT_COLLECTIVES or op in NOT_THE_JOBS or (op in P2P and not fr_has_p2p):
            left_out[op] += 1
            continue
        name = GLOO_NAMES.get(op, op)
        where = f"(seq {ev.get('seq')}, step {ev.get('step')})"
        if op == "reduce_scatter":  # a list reduce-scatter: gloo all-reduces each rank's chunk in turn
            n = max(1, int(ev.get("group_size") or 1))
            out += [(name, nbytes // n, f"{op} {nbytes} B, part {i + 1}/{n} {where}") for i in range(n)]
        else:
            out.append((name, nbytes, f"{op} {nbytes} B {where}"))
    for op, count in left_out.items():
        reason = NOT_COLLECTIVES.get(op) or NOT_THE_JOBS.get(op) or P2P_REASON
        excluded.append({"rank": rank, "source": "dtlab", "op": op, "count": count, "reason": reason})
    return out


def compare_rank(rank: int, events: list[dict[str, Any]], dump: Dump | None,
                 excluded: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], tuple[int, int]]:
    """One rank's differences (and the counts compared)."""
    fr = _fr_tokens(dump) if dump is not None else []
    has_p2p = any(op in ("send", "recv") for op, _, _ in fr)
    mine = _dtlab_tokens(events, rank, has_p2p, excluded)
    matcher = difflib.SequenceMatcher(None, [t[:2] for t in mine], [t[:2] for t in fr], autojunk=False)
    diffs = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        a, b = mine[i1:i2], fr[j1:j2]
        for k in range(max(len(a), len(b))):
            left, right = (a[k][2] if k < len(a) else ""), (b[k][2] if k < len(b) else "")
            kind = "differ" if left and right else ("only dtlab" if left else "only Flight Recorder")
            diffs.append({"rank": rank, "kind": kind, "dtlab": left, "flight_recorder": right})
    return diffs, (len(mine), len(fr))


def crosscheck(result: Any) -> CrossCheck:
    """Every rank's collectives as dtlab recorded them against Flight Recorder's (see the module).

    ``result``: a RunResult made with ``record=True`` and ``RunConfig(flight_recorder=True)``."""
    if not getattr(result, "flight", None):
        raise ValueError("this result holds no Flight Recorder dumps: run it with RunConfig(flight_recorder=True)")
    dumps = read_all(result.flight)
    events = [e for r in result.ranks for e in r.events]
    differences: list[dict[str, Any]] = []
    excluded: list[dict[str, Any]] = []
    compared = {}
    for rank in sorted({r.rank for r in result.ranks} | set(dumps)):
        diffs, compared[rank] = compare_rank(rank, events, dumps.get(rank), excluded)
        differences += diffs
    return CrossCheck(differences, excluded, compared)


