"""Reading a finished run: its events, phases, memory and strategy fields as DataFrames. Nothing here starts a
run (import-linter keeps ``read`` from importing ``train`` and ``launch``).

One module per tier it reads (``read.tp``, ``read.cp``, ``read.ep``, ``read.pipeline``, ``read.fsdp``, ``read.ft``,
``read.elastic``, ``read.diloco``, ``read.rpc``, ``read.multinode``) and per view (``read.frames``, ``read.flight``,
``read.mesh``, ``read.overlap``, ``read.speedup``, ``read.stragglers``, ``read.recovery``); all are loaded with the
package, so ``from dtlab import read`` then ``read.elastic.restart(result)`` reads as it runs.
"""

from dtlab.read import (
    cp,
    diloco,
    elastic,
    ep,
    flight,
    frames,
    fsdp,
    ft,
    mesh,
    multinode,
    overlap,
    pipeline,
    recovery,
    rpc,
    speedup,
    stragglers,
    tp,
)
from dtlab.read.frames import breakdown_frame, comm_overlap, dataparallel_lanes, memory_frame

__all__ = ["breakdown_frame", "comm_overlap", "cp", "dataparallel_lanes", "diloco", "elastic", "ep", "flight", "frames",
           "fsdp", "ft", "memory_frame", "mesh", "multinode", "overlap", "pipeline", "recovery", "rpc", "speedup",
           "stragglers", "tp"]
