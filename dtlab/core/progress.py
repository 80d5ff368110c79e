"""Progress from a rank process to whoever launched it.

A launcher attaches a channel (a pipe end, or a file under torchrun) in each
rank process; ``report()`` sends to it and is a no-op where none is attached,
so the training loop and the tiers report without knowing how they were started.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol


class Channel(Protocol):
    def send(self, message: tuple[str, dict[str, Any]]) -> None: ...


_channel: Channel | None = None
_rank: int | None = None


def attach(channel: Channel | None, rank: int | None) -> None:
    """Send this process's reports to ``channel`` (None: report nothing)."""
    global _channel, _rank
    _channel, _rank = channel, rank


def report(**progress: Any) -> None:
    """Send progress (e.g. step=3, total=50, loss=0.7) from this rank to the launcher.

    A ``progress`` callable given to ``launch`` receives every rank's reports (with
    ``rank`` added); the tqdm bar follows rank 0's.
    """
    if _channel is not None:
        with contextlib.suppress(OSError):
            _channel.send(("progress", {**progress, "rank": _rank}))
