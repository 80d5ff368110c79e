"""Channels a tier declares (``Strategy.comm_channels``): names for calls that carry none of their own, and
what the instrument layer measures of a tier (``Channel``: the training loop opens them and merges their reports).

Every c10d call is recorded whatever the channels (``dtlab.instrument.dispatch``). The naming channels open only
while a recorder runs, and label calls whose thread set no tag (``CommRecorder.tagged``):

- ``modules``: the module that issued the call (torch's ``ModTracker``, as in ``CommDebugMode``), for
  tiers where DTensor communicates inside layers (tensor parallelism);
- ``ddp_buckets``: DDP's reducer launches its buckets from C++ in index order, one all-reduce each, so
  the k-th all-reduce autograd's engine issues in a step is bucket k (``ddp_bucket:<k>``); a Python
  comm hook tags its own calls instead (``dtlab.instrument.recorder.tag_ddp_hook``);
- ``fsdp_units``: each FSDP2 unit's all-gather and reduce-scatter ``fsdp:<pass>:<unit>`` (the pass its
  all-gather serves: forward until the root's forward returns, backward after), and HSDP's all-reduce.

A measuring channel opens whether the run records or not:

- ``fsdp_gathered``: what FSDP2 holds gathered (``dtlab.instrument.gathered``), reported as ``comm_buffers``
  memory and the facts ``gathered_after_forward_bytes`` and ``unit_bytes``.

The FSDP channels learn the units from ``declare_fsdp`` (the tier that shards a model calls it) and see each
collective through ``fsdp_collective``, which FSDP2's custom comms enter (``dtlab.tiers.parts.fsdp_comms``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dtlab.core.compat import module_tracker
from dtlab.instrument.gathered import GatheredBytes

__all__ = ["CHANNELS", "Channel", "DDPBuckets", "FSDPGathered", "FSDPUnits", "Modules", "declare_fsdp",
           "fsdp_collective", "innermost_module", "modules_untracked", "to_open"]


class Channel:
    """What the recorder and the training loop call on an open channel; each overrides what it uses."""

    measures = False  # True: opened whether the run records or not (it measures; it names no call)

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def tag(self, op: str, from_engine: bool, step: int) -> str:
        """A name for an untagged call; "" leaves it to the next channel."""
        return ""

    def step_started(self, step: int) -> None:
        """The loop starts step ``step``."""

    def step_ended(self, step: int) -> None:
        """Step ``step``'s optimizer step is done."""

    def memory(self) -> dict[str, int]:
        """Memory kinds (bytes) measured, merged into ``RankResult.memory`` over the strategy's."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Facts merged into ``RankResult.strategy``."""
        return {}


def innermost_module(parents: set[str]) -> str:
    """The deepest running module in ModTracker's ``parents`` (``"CharFormer.blocks.0.attn"`` ->
    ``"blocks.0.attn"``); ``""`` at the top level."""
    names = [p for p in parents if p != "Global"]
    if not names:
        return ""
    deepest = max(names, key=lambda n: (n.count("."), len(n)))
    return deepest.partition(".")[2] or deepest


class Modules(Channel):
    """Tags a call with the innermost running module, ``" (backward)"`` added in backward."""

    def __init__(self, recorder: Any) -> None:
        super().__init__(recorder)
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


class DDPBuckets(Channel):
    """Numbers the all-reduces DDP's reducer issues from C++ within each step: bucket 0, 1, ..."""

    def __init__(self, recorder: Any) -> None:
        super().__init__(recorder)
        self.step, self.index = None, 0

    def tag(self, op: str, from_engine: bool, step: int) -> str:
        if op != "all_reduce" or not from_engine:
            return ""
        if step != self.step:
            self.step, self.index = step, 0
        self.index += 1
        return f"ddp_bucket:{self.index - 1}"


class _FSDPChannel(Channel):
    """An FSDP channel: told the units by ``declare_fsdp`` and each collective by ``fsdp_collective``."""

    def __enter__(self) -> _FSDPChannel:
        _fsdp_channels.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _fsdp_channels.remove(self)

    def declare(self, model: nn.Module, units: dict[nn.Module, str], dtype: torch.dtype | None, hsdp: bool) -> None:
        """``model`` is sharded: ``units`` names each sharded module, ``dtype`` the gathered parameters' (None: their
        own), ``hsdp``: its gradients are all-reduced across replicate groups."""

    def collective(self, op: str, unit: str) -> contextlib.AbstractContextManager[Any]:
        """Around ``unit``'s ``op`` ("all_gather" or "reduce_scatter")."""
        return contextlib.nullcontext()


class FSDPUnits(_FSDPChannel):
    """Tags each unit's all-gather and reduce-scatter ``fsdp:<pass>:<unit>``, and HSDP's all-reduce."""

    def __init__(self, recorder: Any) -> None:
        super().__init__(recorder)
        self.now = "forward"  # the pass that an all-gather serves

    def declare(self, model: nn.Module, units: dict[nn.Module, str], dtype: torch.dtype | None, hsdp: bool) -> None:
        # prepend: before FSDP's own root pre-forward hook, which gathers the root unit; whatever is gathered
        # after the forward, until the next, serves the backward
        model.register_forward_pre_hook(lambda *_: setattr(self, "now", "forward"), prepend=True)
        model.register_forward_hook(lambda *_: setattr(self, "now", "backward"))
        for module, unit in units.items():
            if hsdp and hasattr(module, "set_all_reduce_hook"):
                module.set_all_reduce_hook(self._all_reduced(f"fsdp:backward:{unit}"))

    def collective(self, op: str, unit: str) -> contextlib.AbstractContextManager[Any]:
        return self.recorder.tagged(f"fsdp:{self.now if op == 'all_gather' else 'backward'}:{unit}")

    def _all_reduced(self, tag: str) -> Callable[[torch.Tensor], None]:
        """FSDP2 calls ``dist.all_reduce`` itself (the recorder sees it) and then this hook, synchronously on
        CPU, so the event just recorded is that all-reduce: tag it."""
        def hook(_: torch.Tensor) -> None:
            events = self.recorder.events
            if events and events[-1].op == "all_reduce":
                events[-1].tag = tag
        return hook


class FSDPGathered(_FSDPChannel):
    """Counts what each rank holds gathered (``GatheredBytes``) on the loop's first step: the peak is the same
    every step."""

    measures = True

    def __init__(self, recorder: Any) -> None:
        super().__init__(recorder)
        self.gathered: GatheredBytes | None = None
        self.started = False

    def declare(self, model: nn.Module, units: dict[nn.Module, str], dtype: torch.dtype | None, hsdp: bool) -> None:
        self.gathered = GatheredBytes(model, units, dtype)

    def collective(self, op: str, unit: str) -> contextlib.AbstractContextManager[Any]:
        if op == "all_gather" and self.gathered is not None:
            self.gathered.gathering(unit)
        return contextlib.nullcontext()

    def step_started(self, step: int) -> None:
        if self.gathered is not None:
            self.gathered.counting = not self.started
        self.started = True

    def step_ended(self, step: int) -> None:
        if self.gathered is not None:
            self.gathered.counting = False

    def memory(self) -> dict[str, int]:
        """``comm_buffers``: the most bytes of all-gathered parameters held at once."""
        return {"comm_buffers": self.gathered.peak} if self.gathered and self.gathered.peak else {}

    def describe(self) -> dict[str, Any]:
        g = self.gathered
        return {"gathered_after_forward_bytes": g.after_forward if g else 0,
                "unit_bytes": dict(g.unit_bytes) if g else {}}


CHANNELS: dict[str, Callable[[Any], Channel]] = {"modules": Modules, "ddp_buckets": DDPBuckets,
                                                 "fsdp_units": FSDPUnits, "fsdp_gathered": FSDPGathered}

_trackers: list[Any] = []  # the module trackers entered in this process, innermost last
_fsdp_channels: list[_FSDPChannel] = []  # the FSDP channels open in this process


def to_open(names: Sequence[str], recording: bool) -> list[str]:
    """The channels of ``names`` to open: all while recording, else only those that measure (unknown names are
    left to ``CommRecorder.channels`` to refuse)."""
    return [n for n in names if recording or n not in CHANNELS or CHANNELS[n].measures]


def declare_fsdp(model: nn.Module, units: dict[nn.Module, str], dtype: torch.dtype | None = None,
                 hsdp: bool = False) -> None:
    """Hand a model that FSDP2 has just sharded to the open FSDP channels (``_FSDPChannel.declare``)."""
    for channel in _fsdp_channels:
        channel.declare(model, units, dtype, hsdp)


@contextlib.contextmanager
def fsdp_collective(op: str, unit: str) -> Iterator[None]:
    """Around FSDP2's ``op`` ("all_gather" or "reduce_scatter") for ``unit``: the open FSDP channels see it."""
    with contextlib.ExitStack() as stack:
        for channel in list(_fsdp_channels):
            stack.enter_context(channel.collective(op, unit))
        yield


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
