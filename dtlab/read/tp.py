"""Reading a tensor-parallel run: the collectives rank 0 issued per step, and which module issued them.

``dtlab.cost.tp`` gives what the book says each step must issue, to set beside these.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from dtlab.core.results import RunResult
from dtlab.cost.tp import by_op_and_bytes, textbook_collectives

__all__ = ["against_book", "calls_by_tag", "recorded_per_step"]


def recorded_per_step(events: pd.DataFrame, steps: range) -> pd.DataFrame:
    """Recorded collectives of rank 0 per step: op, bytes and calls (averaged over ``steps``)."""
    df = events[(events["rank"] == 0) & events["step"].isin(list(steps))]
    out = df.groupby(["op", "bytes"]).size().div(len(steps)).rename("calls").reset_index()
    return out.sort_values(["op", "bytes"]).reset_index(drop=True)


def calls_by_tag(result: RunResult, rank: int = 0) -> pd.DataFrame:
    """Calls per training step of one rank, tag (the module that issued it; "(none)": no module) x op, the tags
    in the order first issued."""
    ev = result.events_frame()
    ev = ev[(ev["rank"] == rank) & (ev["step"] >= 0) & (ev["step"] < result.config.steps)]
    ev = ev.assign(tag=ev["tag"].replace("", "(none)"))
    order = list(dict.fromkeys(ev.sort_values("seq")["tag"]))
    return (ev.groupby(["tag", "op"]).size() / result.config.steps).unstack(fill_value=0).reindex(order)


def against_book(runs: Mapping[str, RunResult], vocab: int = 0) -> pd.DataFrame:
    """Per run and (op, bytes per call): the calls per step ``textbook_collectives`` says rank 0 must issue,
    beside the calls it recorded. Columns variant, op, bytes per call, textbook calls, recorded calls."""
    rows = []
    for name, r in runs.items():
        book = by_op_and_bytes(textbook_collectives(r.config, vocab=vocab))
        recorded = recorded_per_step(r.events_frame(), range(r.config.steps))
        seen = {(op, b): calls for op, b, calls in recorded.itertuples(index=False)}
        for op, b in sorted(book.keys() | seen.keys()):
            rows.append({"variant": name, "op": op, "bytes per call": b, "textbook calls": book.get((op, b), 0),
                         "recorded calls": seen.get((op, b), 0)})
    return pd.DataFrame(rows, columns=["variant", "op", "bytes per call", "textbook calls", "recorded calls"])
