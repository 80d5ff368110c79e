"""Recording communication: every c10d collective and point-to-point call (at the dispatcher), and RPC calls."""

from dtlab.core.comm import FIELDS, algbw, bus_factor, busbw, chrome_trace, events_frame
from dtlab.instrument.events import Event
from dtlab.instrument.recorder import CommRecorder, active, tag_methods, tagged

__all__ = ["FIELDS", "CommRecorder", "Event", "active", "algbw", "bus_factor", "busbw", "chrome_trace",
           "events_frame", "tag_methods", "tagged"]
