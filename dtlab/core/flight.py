"""Reading PyTorch Flight Recorder dumps: each rank's collectives in order, as torch recorded them.

A dump (``dtlab.launch.flight`` writes one per rank) is torch's pickle: ``entries``, one per collective the
rank issued (profiling name such as ``gloo:all_reduce``, input and output sizes, dtypes, the process group,
its sequence number in that group, times, the Python stack that issued it), and ``pg_config`` (the groups,
which dtlab fills in: gloo leaves it empty). ``read`` turns one into a ``Dump`` of ``Entry`` rows;
``torch_verdict`` runs torch's own analyser (the ``fr_trace`` tool) on the dumps of a run.

What gloo records on torch 2.13 (checked here): every collective issued through the process group, whoever
issued it -- ``torch.distributed``'s functions, DDP's C++ reducer and constructor, functional collectives --
but no point-to-point op (send, recv, their batched form): those advance ``op_id`` and leave no entry.
``state`` stays "scheduled" (gloo gives Flight Recorder no start or end event, so the ``discovered`` times
stay 0); ``retired`` says the work ended -- a collective that timed out may read either way (its work ends
with the error, racing the rank's own wait) -- so only matching the ranks' entries tells a hang apart.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.core import compat

# Bytes per element of the dtypes Flight Recorder names (c10's ScalarType names).
DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
               "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
# Frames that are not the caller's code: torch, dtlab's recorder and launcher, multiprocessing.
_INTERNAL = (f"{os.sep}torch{os.sep}", f"dtlab{os.sep}instrument{os.sep}", f"dtlab{os.sep}launch{os.sep}",
             f"{os.sep}multiprocessing{os.sep}", f"{os.sep}typing_extensions.py")


@dataclass(frozen=True)
class Entry:
    """One collective one rank issued, as Flight Recorder recorded it."""

    rank: int
    group: str  # the process group's name ("0": the default group)
    group_desc: str  # its description ("default_pg", or the group_desc it was made with)
    seq: int  # collective_seq_id: its position among this group's collectives on this rank, from 1
    op: str  # "all_reduce", "broadcast", ... (the profiling name without its backend)
    backend: str  # "gloo", "nccl", ...
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    dtype: str  # the first input's (or output's) dtype, as c10 names it ("Float")
    retired: bool  # the work ended (completed, or failed: a timed-out one may read either way); False: pending
    state: str  # Flight Recorder's state ("scheduled" on gloo, which never advances it)
    created_s: float  # when it was issued (wall clock, seconds)
    p2p_seq: int = 0
    timeout_s: float = 0.0
    where: str = ""  # the innermost frame of the caller's code: "train (prog.py:41)"

    @property
    def bytes(self) -> int:
        """The input's size in bytes (all inputs)."""
        return sum(_numel(s) for s in self.input_sizes) * DTYPE_BYTES.get(self.dtype, 0)

    @property
    def output_bytes(self) -> int:
        return sum(_numel(s) for s in self.output_sizes) * DTYPE_BYTES.get(self.dtype, 0)

    def label(self) -> str:
        """``all_reduce #5 on group 0 (default_pg)``."""
        return f"{self.op} #{self.seq} on {group_label(self.group, self.group_desc)}"

    def shape(self) -> str:
        sizes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.input_sizes) or "no tensor"
        return f"{sizes} {self.dtype}".strip()


@dataclass
class Dump:
    """One rank's dump: its entries in the order issued, the groups it knew, and why and when it was taken."""

    rank: int
    entries: list[Entry]
    groups: dict[str, tuple[str, tuple[int, ...]]]  # name -> (desc, global ranks)
    reason: str = ""  # "end", "error", "request", "terminated" (dtlab's dumps); "" if unknown
    error: str = ""
    dumped_s: float = 0.0
    version: str = ""
    pg_status: dict[str, Any] = field(default_factory=dict)

    def last(self) -> Entry | None:
        return max(self.entries, key=lambda e: e.created_s) if self.entries else None


def group_label(name: str, desc: str) -> str:
    return f"group {name} ({desc})" if desc and desc != "undefined" else f"group {name}"


def _numel(size: Any) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


def _where(frames: list[dict[str, Any]] | None) -> str:
    for f in frames or []:
        name = str(f.get("filename", ""))
        if name and not any(part in name for part in _INTERNAL):
            return f"{f.get('name', '?')} ({os.path.basename(name)}:{f.get('line', '?')})"
    return ""


def _entry(rank: int, raw: Mapping[str, Any], groups: Mapping[str, tuple[str, tuple[int, ...]]]) -> Entry:
    backend, _, name = str(raw.get("profiling_name", "")).partition(":")
    op = (name or backend).split(" ")[0]  # nccl's p2p names carry the peers: "send 0->1"
    group, desc = (list(raw.get("process_group") or ("", "")) + ["", ""])[:2]
    dtypes = list(raw.get("input_dtypes") or []) + list(raw.get("output_dtypes") or [])
    timeout_ms = raw.get("timeout_ms") or 0
    return Entry(
        rank=rank, group=str(group), group_desc=str(desc or groups.get(str(group), ("", ()))[0]),
        seq=int(raw.get("collective_seq_id") or 0), op=op, backend=backend if name else "",
        input_sizes=tuple(tuple(int(d) for d in s) for s in raw.get("input_sizes") or []),
        output_sizes=tuple(tuple(int(d) for d in s) for s in raw.get("output_sizes") or []),
        dtype=str(dtypes[0]) if dtypes else "", retired=bool(raw.get("retired")), state=str(raw.get("state", "")),
        created_s=int(raw.get("time_created_ns") or 0) / 1e9, p2p_seq=int(raw.get("p2p_seq_id") or 0),
        timeout_s=float(timeout_ms) / 1e3, where=_where(raw.get("frames")))


def _groups(pg_config: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for name, pg in (pg_config or {}).items():
        ranks = pg.get("ranks", "[]")
        ranks = [int(r) for r in ranks.strip("[] ").split(",") if r.strip()] if isinstance(ranks, str) else ranks
        if str(name):  # gloo's own (empty) placeholder has the name ""
            out[str(name)] = (str(pg.get("desc", "")), tuple(sorted(int(r) for r in ranks)))
    return out


def read(data: bytes | Mapping[str, Any], rank: int | None = None) -> Dump:
    """One rank's dump (the bytes dtlab wrote, or the unpickled dict) as a ``Dump``."""
    raw = pickle.loads(data) if isinstance(data, bytes | bytearray) else data
    meta = raw.get("dtlab", {}) or {}
    rank = int(meta.get("rank", rank if rank is not None else -1))
    groups = _groups(raw.get("pg_config", {}))
    entries = [_entry(rank, e, groups) for e in raw.get("entries", [])]
    return Dump(rank, entries, groups, str(meta.get("reason", "")), str(meta.get("error", "")),
                int(meta.get("dumped_ns", 0)) / 1e9, str(raw.get("version", "")), dict(raw.get("pg_status", {})))


def dump_files(folder: str | os.PathLike[str]) -> dict[int, Path]:
    """The ``rank_<R>`` files in ``folder`` (a saved run's ``flight_recorder``), in rank order."""
    found = {int(p.name.removeprefix("rank_")): p for p in Path(folder).glob("rank_*")
             if p.name.removeprefix("rank_").isdigit()}
    return dict(sorted(found.items()))


def read_all(dumps: Mapping[int, bytes] | str | os.PathLike[str]) -> dict[int, Dump]:
    """Every rank's dump, from a run's ``flight`` (rank -> bytes) or from a folder of ``rank_<R>`` files."""
    if isinstance(dumps, str | os.PathLike):
        dumps = {r: p.read_bytes() for r, p in dump_files(dumps).items()}
    return {r: read(data, r) for r, data in sorted(dumps.items())}


def torch_verdict(dumps: Mapping[int, bytes]) -> str:
    """What torch's own analyser (``torch.distributed.flight_recorder``, the ``fr_trace`` tool) says about these
    dumps: its report of the first collective that did not match on every rank, or that every one matched --
    or, where it cannot read them, why (in one line)."""
    if not dumps:
        return "torch's fr_trace: no dumps to read"
    with tempfile.TemporaryDirectory(prefix="dtlab-fr-trace-") as folder:
        for rank, data in dumps.items():
            Path(folder, f"rank_{rank}").write_bytes(data)
        try:
            db, lines = compat.fr_trace_database(folder)
        except Exception as exc:  # noqa: BLE001 - its failure is the verdict
            return f"torch's fr_trace could not analyse these dumps: {type(exc).__name__}: {exc}"
    report = [ln for ln in lines if ln and "tabulate" not in ln]
    stack = next((i for i, ln in enumerate(report) if ln.startswith("collective stack trace")), len(report))
    bad = [c for c in db.collectives if not c.pass_check or c.missing_ranks]
    if not report and not bad:
        return f"torch's fr_trace: all {len(db.collectives)} collectives matched on every rank"
    return "torch's fr_trace:\n  " + "\n  ".join(report[:stack] or [str(bad[0])])
