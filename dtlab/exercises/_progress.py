"""The learner's progress: every check's verdict and every revealed prediction, read back as two tables.

``exercises.check`` and ``bugzoo.check`` append one line per verdict to
``results/progress.jsonl`` (time, kind, name, passed), and ``dtlab.predict``'s
``reveal`` appends to ``results/predictions.jsonl``: both are plain files under
the notebook's working directory, so progress outlives a kernel restart.
``exercises.progress()`` reads them into a ``Progress``.

Recording never fails a check: a file that cannot be written costs one warning
and the line, nothing else.
"""

from __future__ import annotations

import datetime
import html
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

# Relative paths: they resolve against the working directory at each call, like dtlab.app.predict's LOG.
PROGRESS_LOG = Path("results/progress.jsonl")
# What dtlab.app.predict.LOG names. Read by path because dtlab.exercises sits below dtlab.app in the layers.
PREDICTIONS_LOG = Path("results/predictions.jsonl")

PASSED, NOT_YET, NOT_TRIED = "passed", "not yet", "not tried"
CHECK_COLUMNS = ("kind", "name", "status", "attempts", "last_checked")
PREDICTION_COLUMNS = ("question", "guess", "measured", "agrees", "revealed")

_warned = False  # one warning per process: a read-only folder would otherwise warn at every check


def _now() -> str:
    return datetime.datetime.now().isoformat(sep=" ", timespec="seconds")


def record(kind: str, name: str, passed: bool, path: str | Path | None = None) -> None:
    """Append one check's verdict (``kind`` "exercise" or "bug") to ``path`` (default ``PROGRESS_LOG``).

    A file that cannot be written gives one warning per process and is otherwise ignored.
    """
    global _warned
    target = Path(PROGRESS_LOG if path is None else path)
    row = {"time": _now(), "kind": kind, "name": name, "passed": bool(passed)}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as err:
        if not _warned:
            _warned = True
            warnings.warn(f"dtlab could not record this check in {target} ({err}); the check itself is unaffected, "
                          "but exercises.progress() will not show it", RuntimeWarning, stacklevel=3)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file, one a line; a missing file is empty, a damaged line is skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short (a kernel killed mid-write) must not hide the others
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def checks_frame(items: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per (kind, name) in ``items``, in that order: status, attempts and when it was last checked.

    "passed" once any check passed: a later failing experiment does not take it back.
    """
    table = []
    for kind, name in items:
        mine = [r for r in rows if r.get("kind") == kind and r.get("name") == name]
        if not mine:
            status = NOT_TRIED
        else:
            status = PASSED if any(r.get("passed") is True for r in mine) else NOT_YET
        last = max((str(r.get("time", "")) for r in mine), default="")
        table.append((kind, name, status, len(mine), last))
    return pd.DataFrame(table, columns=list(CHECK_COLUMNS))


def predictions_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The predictions revealed with a guess locked in, one row per question: its latest reveal.

    A reveal without a guess (nobody pressed Lock in, or a notebook run without a front-end) is no prediction.
    """
    latest: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("guess") is None or "question" not in r:
            continue
        latest.pop(r["question"], None)  # re-inserted: a question asked again moves to where it was last answered
        latest[r["question"]] = r
    table = [(q, r.get("guess"), r.get("measured"), r.get("agrees"), str(r.get("time", "")).replace("T", " "))
             for q, r in latest.items()]
    return pd.DataFrame(table, columns=list(PREDICTION_COLUMNS))


@dataclass(frozen=True)
class Progress:
    """Where a learner stands: ``checks`` (a DataFrame, one row per exercise and per bug) and ``predictions``.

    ``checks``: kind ("exercise" or "bug"), name, status ("passed", "not yet" or "not tried"), attempts,
    last_checked. ``predictions``: question, guess, measured, agrees, revealed. A notebook shows both tables
    under a one-line summary.
    """

    checks: pd.DataFrame
    predictions: pd.DataFrame

    def summary(self) -> str:
        """'2 of 6 exercises and 1 of 6 bugs passed; 3 predictions, 2 agreeing with the measurement.'"""
        parts = []
        for kind, plural in (("exercise", "exercises"), ("bug", "bugs")):
            rows = self.checks[self.checks["kind"] == kind]
            if len(rows):
                parts.append(f"{int((rows['status'] == PASSED).sum())} of {len(rows)} "
                             f"{plural if len(rows) != 1 else kind}")
        n, agreed = len(self.predictions), sum(a is True for a in self.predictions["agrees"])
        said = f"{n} prediction{'s' * (n != 1)}, {agreed} agreeing with the measurement" if n else "no prediction yet"
        return f"{' and '.join(parts) or 'nothing'} passed; {said}."

    def __repr__(self) -> str:
        text = [self.summary(), "", self.checks.to_string(index=False)]
        if len(self.predictions):
            text += ["", self.predictions.to_string(index=False)]
        return "\n".join(text)

    def _repr_html_(self) -> str:
        parts = [f"<p><b>{html.escape(self.summary())}</b></p>", self.checks.to_html(index=False)]
        if len(self.predictions):
            parts += ["<p><b>Predictions</b> (the latest reveal of each question with a guess locked in)</p>",
                      self.predictions.to_html(index=False)]
        return "\n".join(parts)


def progress(items: Sequence[tuple[str, str]], progress_log: str | Path | None = None,
             predictions_log: str | Path | None = None) -> Progress:
    """Read both logs (defaults ``PROGRESS_LOG`` and ``PREDICTIONS_LOG``) into a ``Progress`` over ``items``."""
    checks = checks_frame(items, read_rows(PROGRESS_LOG if progress_log is None else progress_log))
    predictions = predictions_frame(read_rows(PREDICTIONS_LOG if predictions_log is None else predictions_log))
    return Progress(checks, predictions)
