"""Reading runs: tables of time, memory and communication, comparisons, sweeps and the cost model."""

from dtlab.read.frames import breakdown_frame, comm_overlap, dataparallel_lanes, memory_frame

__all__ = ["breakdown_frame", "comm_overlap", "dataparallel_lanes", "memory_frame"]
