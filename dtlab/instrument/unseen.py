"""Calls the recorder cannot see, said once: a rank notes the path in its log, the launcher warns once per path."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable

PREFIX = "dtlab: not recorded: "


def note_unseen(path: str) -> None:
    """In a rank: one line in its output (its log), which ``warn_unseen`` reads in the launcher."""
    print(f"{PREFIX}{path} (called directly, below the dispatcher where dtlab records)", file=sys.stderr,
          flush=True)


def unseen_lines(logs: Iterable[str]) -> list[str]:
    """The distinct not-recorded notes in the ranks' logs, in order of first appearance (torchrun's agents
    put a rank prefix before each line)."""
    return list(dict.fromkeys(line[line.index(PREFIX):].strip() for log in logs for line in log.splitlines()
                              if PREFIX in line))


def warn_unseen(logs: Iterable[str]) -> list[str]:
    """In the launcher: one warning per path that some rank could not record; returns the lines."""
    lines = unseen_lines(logs)
    for line in lines:
        warnings.warn(line, RuntimeWarning, stacklevel=3)
    return lines
