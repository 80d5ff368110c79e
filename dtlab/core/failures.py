"""Turning what went wrong on the ranks into one readable exception.

When one rank raises, its peers fail a moment later with gloo's "Connection
closed by peer" or a timeout. Those are victims. The report names the
culprit first, with its own message and traceback, then the victims.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

# Messages that a rank produces *because another rank failed*.
_VICTIM_PATTERNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connectfullmesh",
    "timed out waiting",
    "socket timeout",
    "read error",
    "econnreset",
    "connection refused",
    "terminated by dtlab",
)


@dataclass
class RankFailure:
    """What one rank reported (or what its exit code said)."""

    rank: int
    kind: str  # "exception", "died", "timeout"
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    time: float = 0.0
    exitcode: int | None = None
    log_tail: str = ""

    @property
    def looks_like_victim(self) -> bool:
        text = f"{self.error_type} {self.message}".lower()
        return self.kind == "exception" and any(p in text for p in _VICTIM_PATTERNS)

    def headline(self) -> str:
        if self.kind == "died":
            return f"rank {self.rank} died without a Python error: {describe_exitcode(self.exitcode)}"
        if self.kind == "timeout":
            return f"rank {self.rank}: {self.message}"
        return f"rank {self.rank} failed: {self.error_type}: {self.message}"


def describe_exitcode(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def pick_culprit(failures: list[RankFailure]) -> RankFailure:
    """The first failure that is not a consequence of another one."""
    ordered = sorted(failures, key=lambda f: f.time)
    for f in ordered:
        if f.kind == "exception" and not f.looks_like_victim:
            return f
    for f in ordered:
        if f.kind == "died":
            return f
    return ordered[0]


@dataclass
class OpState:
    """The last collective a rank entered, from the CommRecorder's live slot."""

    rank: int
    op: str
    seq: int
    in_flight: bool
    since_s: float
    step: int
    finished: bool = False

    def describe(self) -> str:
        if self.finished:
            return f"rank {self.rank}: finished"
        if self.seq == 0:
            return f"rank {self.rank}: has not entered any collective yet"
        where = f"step {self.step}" if self.step >= 0 else "before training"
        if self.in_flight:
            return (f"rank {self.rank}: waiting in {self.op} (its collective #{self.seq}, {where}) "
                    f"for {self.since_s:.1f} s")
        return f"rank {self.rank}: last left {self.op} (its collective #{self.seq}, {where})"


class RankError(RuntimeError):
    """A launch failed. ``rank`` is the culprit; ``failures`` has every rank's report."""

    def __init__(self, failures: list[RankFailure], ops: list[OpState] | None = None, note: str = "") -> None:
        self.failures = failures
        self.culprit = pick_culprit(failures)
        self.rank = self.culprit.rank
        self.ops = ops or []
        self.note = note
        super().__init__(self._format())

    def _format(self) -> str:
        c = self.culprit
        lines = [c.headline()]
        if self.note:
            lines.append(self.note)
        if c.traceback:
            lines += [f"--- traceback of rank {c.rank} ---", c.traceback.rstrip()]
        elif c.log_tail:
            lines += [f"--- last output of rank {c.rank} ---", c.log_tail.rstrip()]
        others = [f for f in self.failures if f is not c]
        if others:
            lines.append("--- other ranks (most likely consequences of the failure above) ---")
            lines += [f.headline() for f in sorted(others, key=lambda f: f.rank)]
        if self.ops:
            lines.append("--- last collective per rank (CommRecorder) ---")
            lines += [s.describe() for s in self.ops]
        return "\n".join(lines)


class CollectiveTimeout(RankError):
    """A rank waited in one collective for longer than the launch's timeout."""


class NoPeerToRecover(RuntimeError):
    """A restarted replica group found no live peer to take its state from (they had all finished).

    Raised inside the replica's ranks; the ``ft`` launcher reads it by name and records the replica as
    not rejoined instead of restarting it again: starting over from step 0 alone would give a wrong model.
    """


@dataclass
class ErrorReport:
    """What a rank process sends home when its function raises."""

    rank: int
    error_type: str
    message: str
    traceback: str
    time: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_failure(self) -> RankFailure:
        return RankFailure(self.rank, "exception", self.error_type, self.message, self.traceback, self.time)
