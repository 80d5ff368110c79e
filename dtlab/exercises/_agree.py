"""All-to-all sizes agreed before the call, so that a rank's wrong guess is named instead of killing it.

Gloo's all-to-all sends each peer its rows and receives each peer's into the part of the output that
``output_split_sizes`` set aside. When a rank expects other sizes than its peer sends, gloo's check fails on
a thread of its own and aborts the process (SIGABRT): no Python error, no line, nothing a checker can name.
Inside ``sizes_agreed``, every rank publishes each ``all_to_all_single``'s sizes in the launch's store just
before the call is issued (the recorder's ``checked`` hook), reads every peer's, and when they disagree
raises ``SizesDisagree`` -- the same pair named on every rank, so every rank stops there and none waits for
the others. Where a peer does not reach the same call in time, or a rank's own sizes do not add up (torch
raises that itself), the call goes ahead as it would have.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dtlab.core.compat import default_store
from dtlab.exercises._check import ordinal
from dtlab.instrument.recorder import active

__all__ = ["Sizes", "SizesDisagree", "sizes_agreed"]

_PREFIX = "dtlab-exercise-a2a"


@dataclass(frozen=True)
class Sizes:
    """One rank's all_to_all_single: the rows it sends to each rank and expects from each, and the bytes of a row
    it sends and of one it receives."""

    sent: tuple[int, ...]
    expected: tuple[int, ...]
    row_bytes: tuple[int, int]


class SizesDisagree(RuntimeError):
    """Rank ``receiver``'s ``call``-th all_to_all_single expects other rows from ``sender`` than it sends."""

    def __init__(self, call: int, receiver: int, sender: int, every: list[Sizes]) -> None:
        self.call, self.receiver, self.sender, self.every = call, receiver, sender, every
        want, send = every[receiver], every[sender]
        if want.expected[sender] != send.sent[receiver]:
            what = (f"expects {want.expected[sender]} rows from rank {sender} (its output_split_sizes "
                    f"{list(want.expected)}), which sends it {send.sent[receiver]} (its input_split_sizes "
                    f"{list(send.sent)})")
        else:
            what = (f"expects rows of {want.row_bytes[1]} bytes from rank {sender}, which sends rows of "
                    f"{send.row_bytes[0]} bytes")
        super().__init__(f"in the {ordinal(call)} all_to_all_single, rank {receiver} {what}")


def _rows(t: Any) -> tuple[int, int]:
    """A tensor's rows (dim 0) and the bytes of one row."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return 0, 0
    return t.shape[0], math.prod(t.shape[1:]) * t.element_size()


def _sizes(bound: dict[str, Any], n: int) -> Sizes | None:
    """What this rank's call sends and expects; None when its own sizes do not add up (torch says so itself)."""
    (rows_in, bytes_in), (rows_out, bytes_out) = _rows(bound.get("input")), _rows(bound.get("output"))
    parts = []
    for splits, rows in ((bound.get("input_split_sizes"), rows_in), (bound.get("output_split_sizes"), rows_out)):
        if splits:
            part = tuple(int(s) for s in splits)
        elif rows % n == 0:
            part = (rows // n,) * n  # no split sizes: n equal parts
        else:
            return None
        if len(part) != n or sum(part) != rows:
            return None
        parts.append(part)
    return Sizes(parts[0], parts[1], (bytes_in, bytes_out))


def _disagreement(every: list[Sizes]) -> tuple[int, int] | None:
    """The first (receiver, sender) whose sizes differ, in rank order: the same pair on every rank."""
    for receiver, want in enumerate(every):
        for sender, send in enumerate(every):
            if want.expected[sender] != send.sent[receiver]:
                return receiver, sender
            if want.expected[sender] and want.row_bytes[1] != send.row_bytes[0]:
                return receiver, sender
    return None


@contextlib.contextmanager
def sizes_agreed(rank: int, n: int, label: str, wait_s: float = 5.0) -> Iterator[None]:
    """Inside, an all_to_all_single over all ``n`` ranks is issued only once every rank's sizes agree; else every
    rank raises the same ``SizesDisagree``. ``label`` names what runs inside (the learner's function and the test
    case): the k-th entry with a label has the same keys on every rank, and a rank that stopped early under one
    label leaves the others' keys as they were."""
    recorder, store = active(), default_store()
    if recorder is None:
        raise RuntimeError("dtlab.exercises needs the CommRecorder: launch with record=True")
    entry = f"{label}#{store.add(f'{_PREFIX}/entries/{label}/{rank}', 1)}"
    calls = itertools.count(1)

    def check(op: str, bound: dict[str, Any], group_size: int) -> None:
        if op != "all_to_all_single" or group_size != n:
            return
        call, mine = next(calls), _sizes(bound, n)
        key = f"{_PREFIX}/{entry}/{call}"
        store.set(f"{key}/{rank}", json.dumps(None if mine is None else [mine.sent, mine.expected, mine.row_bytes]))
        keys = [f"{key}/{s}" for s in range(n)]
        try:
            store.wait(keys, datetime.timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - a peer is elsewhere: the call goes ahead, and its own timeout names it
            return
        published = [json.loads(store.get(k)) for k in keys]
        if any(p is None for p in published):
            return  # a rank's own sizes do not add up: torch raises that on it
        every = [Sizes(tuple(s), tuple(e), (int(b[0]), int(b[1]))) for s, e, b in published]
        pair = _disagreement(every)
        if pair is not None:
            raise SizesDisagree(call, *pair, every)

    with recorder.checked(check):
        yield
