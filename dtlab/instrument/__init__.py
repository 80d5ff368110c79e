"""Recording communication: c10d collectives and point-to-point calls, and RPC calls."""

from dtlab.core.comm import FIELDS, algbw, bus_factor, busbw, chrome_trace, events_frame
from dtlab.instrument.ddp_hooks import allreduce_hook, recording_hook
from dtlab.instrument.recorder import CommRecorder, active

__all__ = ["FIELDS", "CommRecorder", "active", "algbw", "allreduce_hook", "bus_factor", "busbw", "chrome_trace",
           "events_frame", "recording_hook"]
