"""Reading a finished run: its events, phases, memory and strategy fields as DataFrames. Nothing here starts a
run (import-linter keeps ``read`` from importing ``train`` and ``launch``).

One module per tier it reads (``read.tp``, ``read.cp``, ``read.ep``, ``read.pipeline``, ``read.fsdp``, ``read.ft``,
``read.elastic``, ``read.diloco``, ``read.rpc``, ``read.multinode``) and per view (``read.frames``, ``read.flight``,
``read.mesh``, ``read.overlap``, ``read.speedup``, ``read.stragglers``, ``read.recovery``), each loaded on first
use, so ``from dtlab import read`` then ``read.elastic.restart(result)`` reads as it runs while a notebook that
reads only frames does not import what the pipeline, tp and cp readers stand on (the pipelining schedules,
DTensor, sympy: seconds per kernel).
"""

from __future__ import annotations

import importlib
from typing import Any

from dtlab.read.frames import breakdown_frame, comm_overlap, dataparallel_lanes, memory_frame

__all__ = ["breakdown_frame", "comm_overlap", "cp", "dataparallel_lanes", "diloco", "elastic", "ep", "flight", "frames",
           "fsdp", "ft", "memory_frame", "mesh", "multinode", "overlap", "pipeline", "recovery", "rpc", "speedup",
           "stragglers", "tp"]

_MODULES = ("cp", "diloco", "elastic", "ep", "flight", "fsdp", "ft", "mesh", "multinode", "overlap", "pipeline",
            "recovery", "rpc", "speedup", "stragglers", "tp")


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'dtlab.read' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")  # binds the submodule here: found at once next time


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})
