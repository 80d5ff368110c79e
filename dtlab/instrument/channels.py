"""Channels a tier can open on the recorder: names for calls that carry none of their own.

Every c10d call is recorded whatever the channels (``dtlab.instrument.dispatch``). A channel only
labels calls whose thread set no tag (``CommRecorder.tagged``):

- ``modules``: the module that issued the call (torch's ``ModTracker``, as in ``CommDebugMode``), for
  tiers where DTensor communicates inside layers (tensor parallelism);
- ``ddp_buckets``: DDP's reducer launches its buckets from C++ in index order, one all-reduce each, so
  the k-th all-reduce autograd's engine issues in a step is bucket k (``ddp_bucket:<k>``); a Python
  comm hook tags its own calls instead (``dtlab.instrument.recorder.tag_ddp_hook``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from dtlab.core.compat import module_tracker

__all__ = ["CHANNELS", "DDPBuckets", "Modules", "innermost_module", "modules_untracked"]


def innermost_module(parents: set[str]) -> str:
    """The deepest running module in ModTracker's ``parents`` (``"CharFormer.blocks.0.attn"`` ->
    ``"blocks.0.attn"``); ``""`` at the top level."""
    names = [p for p in parents if p != "Global"]
    if not names:
        return ""
    deepest = max(names, key=lambda n: (n.count("."), len(n)))
    return deepest.partition(".")[2] or deepest


class Modules:
    """Tags a call with the innermost running module, ``" (backward)"`` added in backward."""

    def __init__(self) -> None:
        self.tracker = module_tracker()

    def __enter__(self) -> Modules:
        if self.tracker is not None:
            self.tracker.__enter__()
            _trackers.append(self.tracker)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tracker is not None:
            _trackers.remove(self.tracker)
            self.tracker.__exit__(*exc)

    def tag(self, op: str, from_engine: bool, step: int) -> str:
        if self.tracker is None:
            return ""
        where = innermost_module(self.tracker.parents)
        return f"{where} (backward)" if self.tracker.is_bw and where else where


class DDPBuckets:
    """Numbers the all-reduces DDP's reducer issues from C++ within each step: bucket 0, 1, ..."""

    def __init__(self) -> None:
        self.step, self.index = None, 0

    def __enter__(self) -> DDPBuckets:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def tag(self, op: str, from_engine: bool, step: int) -> str:
        if op != "all_reduce" or not from_engine:
            return ""
        if step != self.step:
            self.step, self.index = step, 0
        self.index += 1
        return f"ddp_bucket:{self.index - 1}"


CHANNELS: dict[str, Callable[[], Any]] = {"modules": Modules, "ddp_buckets": DDPBuckets}

_trackers: list[Any] = []  # the module trackers entered in this process, innermost last


@contextlib.contextmanager
def modules_untracked() -> Iterator[None]:
    """Pause the running module trackers; calls meanwhile name no module.

    ModTracker hooks a grad hook onto each module's inputs; ``torch.autograd.grad`` then fails on a
    leaf input ("A leaf node was passed to _will_engine_execute_node"), as in a pipeline stage's
    first-step shape inference (``torch.distributed.pipelining``)."""
    paused = list(_trackers)
    for tracker in paused:
        tracker.__exit__()
    try:
        yield
    finally:
        for tracker in paused:
            tracker.__enter__()
