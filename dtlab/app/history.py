"""The panel's run history: saved runs under ``results/history``, comparable after a kernel restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

HISTORY = Path("results/history")

__all__ = ["HISTORY", "load_history", "saved_loss_curve"]


def load_history(folder: Path = HISTORY) -> dict[str, Path]:
    """Saved runs, newest first: label -> folder (each holds result.json and steps.csv)."""
    runs = sorted((p for p in folder.glob("*/result.json")), reverse=True) if folder.exists() else []
    return {p.parent.name: p.parent for p in runs}


def saved_loss_curve(folder: Path) -> Any:
    return pd.read_csv(folder / "steps.csv").groupby("step")["loss"].mean()
