"""One recorded communication call: a slotted event, filled in as the call starts, completes and is waited on."""

from __future__ import annotations

from typing import Any


class Event:
    """A collective or point-to-point call of one rank.

    ``start`` is when the call was issued, ``end`` when it was seen complete (its work's future, or the
    return of a ``wait()`` on it; None until then), ``wait_s`` how long the caller blocked in ``wait()``.
    ``group`` is the process group's name and ``group_size`` its size at the time of the call; ``peer`` a
    global rank (a p2p call's other side, a rooted collective's root). ``extra`` holds op-specific fields
    (an all-to-all's split sizes).
    """

    __slots__ = ("rank", "seq", "op", "bytes", "dtype", "group_size", "group", "peer", "start", "end", "wait_s",
                 "is_async", "tag", "step", "extra")

    def __init__(self, rank: int | None, seq: int, op: str, nbytes: int, dtype: str, group_size: int, group: str,
                 peer: int | None, start: float, is_async: bool, tag: str, step: int,
                 extra: dict[str, Any] | None = None) -> None:
        self.rank, self.seq, self.op, self.bytes, self.dtype = rank, seq, op, nbytes, dtype
        self.group_size, self.group, self.peer = group_size, group, peer
        self.start, self.end, self.wait_s = start, None, 0.0
        self.is_async, self.tag, self.step, self.extra = is_async, tag, step, extra

    def finish(self, when: float) -> None:
        """Seen complete at ``when``. Every sighting is no earlier than the completion, so the earliest wins:
        a future's callback waits for the GIL (up to its 5 ms switch interval) while the thread that waited
        runs on, and a wait may come long after the op ended."""
        if self.end is None or when < self.end:
            self.end = when

    def row(self, clock_offset: float = 0.0) -> dict[str, Any]:
        """The event as a dict of ``dtlab.core.comm.FIELDS`` (plus ``extra``), on the wall clock."""
        end = self.start if self.end is None else self.end
        row = {"rank": self.rank, "seq": self.seq, "op": self.op, "bytes": self.bytes, "dtype": self.dtype,
               "group_size": self.group_size, "group": self.group, "peer": self.peer,
               "start": self.start + clock_offset, "end": end + clock_offset, "wait_s": self.wait_s,
               "async": self.is_async, "tag": self.tag, "step": self.step}
        if self.extra:
            row.update(self.extra)
        return row

    def __repr__(self) -> str:
        return (f"Event({self.op}, {self.bytes} B, group {self.group!r} of {self.group_size}, peer {self.peer}, "
                f"tag {self.tag!r}, step {self.step})")

