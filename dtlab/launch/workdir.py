"""What a torchrun work directory (WORKDIR) holds, file by file.

The launcher writes the job (``payload.pkl``, or ``config.json`` for a
cluster), each worker leaves its result or error and rank 0 its progress.
Kept apart from ``dtlab.launch.worker`` so that importing dtlab never imports
the module ``python -m dtlab.launch.worker`` runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from dtlab.core.config import RunConfig

PAYLOAD = "payload.pkl"


CONFIG = "config.json"


def result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result-rank{rank}.pkl"


def error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error-rank{rank}.json"


def progress_path(workdir: Path) -> Path:
    return workdir / "progress.jsonl"


def read_config(workdir: Path) -> RunConfig:
    """The RunConfig in WORKDIR/config.json (a cluster job, see ``dtlab.launch.cluster``)."""
    return RunConfig.from_dict(json.loads((workdir / CONFIG).read_text()))
