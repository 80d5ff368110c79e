"""PyTorch Flight Recorder dumps of a run, as tables and a hang report.

A run made with ``RunConfig(flight_recorder=True)`` (or ``dtlab run --flight-recorder``) holds every
rank's dump in ``result.flight``; a failed one in ``error.flight``; a saved one in
``OUT/flight_recorder/rank_<R>``. ``frame`` lays them out as one row per collective per rank, in the
order issued; ``report`` says why a run hung -- dtlab's reading of the dumps (``diagnose``: the rank, the
collective, its sequence number) beside torch's own analyser's verdict. Reading the dumps and diagnosing
them live in ``dtlab.core.flight`` and ``dtlab.core.flight_diagnosis`` (the bug zoo's reports use them too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dtlab.core.flight import Dump, dump_files, read_all, torch_verdict
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
    return f"{report(source)}\nwrote {folder}/rank_* (dtlab.analysis.flight.report('{folder}') reads them again)"


__all__ = ["COLUMNS", "Diagnosis", "diagnose", "diagnosis", "frame", "report", "saved_report"]
