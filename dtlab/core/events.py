"""Run events: what torchrun-launched workers did (start, restart, snapshot, fault, ...).

Workers append one JSON line per event to ``events.jsonl`` in their WORKDIR;
the launcher reads them back into the run's timeline. ``emit`` is how the
training loop and the tiers add theirs; outside a torchrun worker it does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
WORKDIR_ENV = "DTLAB_WORKDIR"  # set by the worker: where this process's events go


def emit_to(workdir: Path, kind: str, **fields: Any) -> None:
    """Append one event to WORKDIR's events file (one short line per write, so lines never interleave)."""
    line = json.dumps({"time": time.time(), "kind": kind, **fields}, default=str) + "\n"
    fd = os.open(workdir / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def emit(kind: str, **fields: Any) -> None:
    """Record an event of this worker (rank, node and attempt added); a no-op outside a torchrun worker."""
    path = os.environ.get(WORKDIR_ENV)
    if path:
        emit_to(Path(path), kind, rank=int(os.environ.get("RANK", -1)),
                node=int(os.environ.get("GROUP_RANK", 0)), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                world_size=int(os.environ.get("WORLD_SIZE", 0)), **fields)


def read_events(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / EVENTS
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a SIGKILL
            events.append(json.loads(line))
    return sorted(events, key=lambda e: e["time"])
