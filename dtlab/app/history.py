"""The panel's run history: saved runs under ``results/history``, comparable after a kernel restart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

HISTORY = Path("results/history")
# What the comparison reads from result.json; a summary without them cannot be compared.
SUMMARY_KEYS = ("median_step_s", "samples_per_s", "final_loss")

__all__ = ["HISTORY", "SUMMARY_KEYS", "SavedRun", "load_history", "new_run_folder", "read_run", "read_runs",
           "saved_loss_curve"]


@dataclass(frozen=True)
class SavedRun:
    """What the comparison needs of one saved run: its result.json and its loss per step."""

    summary: dict[str, Any]
    loss: pd.Series


def load_history(folder: Path = HISTORY) -> dict[str, Path]:
    """Saved runs, newest first: label -> folder (each holds result.json and steps.csv)."""
    runs = sorted((p for p in folder.glob("*/result.json")), reverse=True) if folder.exists() else []
    return {p.parent.name: p.parent for p in runs}


def new_run_folder(history: Path, name: str) -> Path:
    """A new, empty folder ``history/name`` (``name-2``, ``name-3``, ... if taken), made atomically: two kernels of
    one learner saving the same tier in the same second never write into one folder."""
    history.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        folder = history / (name if n == 1 else f"{name}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"{history}: {name} and 998 more like it are taken")


def saved_loss_curve(folder: Path) -> Any:
    return pd.read_csv(folder / "steps.csv").groupby("step")["loss"].mean()


def read_run(folder: Path) -> SavedRun:
    """One saved run; ValueError saying which file is unreadable and why (a folder may be half-copied or
    hand-edited: the history is just folders on disk)."""
    try:
        summary = json.loads((folder / "result.json").read_text())
        if not isinstance(summary, dict) or not all(isinstance(summary.get(k), int | float) for k in SUMMARY_KEYS):
            raise ValueError(f"it lacks the numbers {', '.join(SUMMARY_KEYS)}")
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"result.json: {_reason(exc)}") from None
    try:
        loss = saved_loss_curve(folder)
    except (OSError, ValueError, KeyError) as exc:  # missing, empty, or without step/loss columns
        raise ValueError(f"steps.csv: {_reason(exc)}") from None
    return SavedRun(summary, loss)


def read_runs(runs: dict[str, Path]) -> tuple[dict[str, SavedRun], dict[str, str]]:
    """Every run that can be read (label -> SavedRun) and every one that cannot (label -> why), so one
    broken folder leaves the others comparable."""
    readable: dict[str, SavedRun] = {}
    broken: dict[str, str] = {}
    for label, folder in runs.items():
        try:
            readable[label] = read_run(folder)
        except ValueError as exc:
            broken[label] = str(exc)
    return readable, broken


def _reason(exc: Exception) -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, KeyError):
        return f"no column {exc}"
    return " ".join(str(exc).split()) or type(exc).__name__
