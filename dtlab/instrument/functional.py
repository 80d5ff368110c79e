"""Functional collectives (what DTensor and tensor parallelism issue) as CommRecorder events.

DTensor redistributes through ``torch.ops._c10d_functional`` -- C++ ops that
never pass through the ``torch.distributed`` functions the recorder wraps. A
``TorchDispatchMode`` sees every op below autograd, in forward and in the
backward that runs on this thread, so it sees these too: an op's call is its
start, the ``wait_tensor`` on its result its end. torch's ``ModTracker`` (the
module tracker inside ``CommDebugMode``) names the layer that issued it, which
goes in the event's ``tag``.

A dispatch mode costs a Python call per aten op, so it is entered only by the
tiers that use DTensor (``Strategy.functional_collectives``), and only when recording.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dtlab.core.comm import END, TAG
from dtlab.core.compat import module_tracker, process_group_size
from dtlab.instrument.calls import dtype_name, tensor_nbytes
from dtlab.instrument.recorder import CommRecorder

__all__ = ["FUNCTIONAL_OPS", "FunctionalRecorder", "innermost_module", "modules_untracked"]

# op name -> (dtlab op name, index of the group name, index of the group size or None, whether bytes are the
# output's: nccl-tests' convention, as the c10d wrappers count them: all_gather counts what it gathers)
FUNCTIONAL_OPS: dict[str, tuple[str, int, int | None, bool]] = {
    "all_reduce": ("all_reduce", 2, None, False),
    "all_reduce_": ("all_reduce", 2, None, False),
    "all_reduce_coalesced": ("all_reduce", 2, None, False),
    "all_reduce_coalesced_": ("all_reduce", 2, None, False),
    "all_gather_into_tensor": ("all_gather_into_tensor", 2, 1, True),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor", 2, 1, True),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 3, 2, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", 3, 2, False),
    "all_to_all_single": ("all_to_all_single", 3, None, False),
    "broadcast": ("broadcast", 2, None, False),
}
_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def innermost_module(parents: set[str]) -> str:
    """The deepest running module in ModTracker's ``parents`` (``"CharFormer.blocks.0.attn"`` ->
    ``"blocks.0.attn"``); ``""`` at the top level."""
    names = [p for p in parents if p != "Global"]
    if not names:
        return ""
    deepest = max(names, key=lambda n: (n.count("."), len(n)))
    return deepest.partition(".")[2] or deepest


class FunctionalRecorder(TorchDispatchMode):
    """Adds one event to ``recorder`` per functional collective run under it (use as a context manager)."""

    def __init__(self, recorder: CommRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.tracker = module_tracker()
        self._pending: dict[int, list[Any]] = {}  # storage address of a result -> its event, until waited on

    def __enter__(self) -> FunctionalRecorder:
        if self.tracker is not None:
            self.tracker.__enter__()
        _running.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _running.remove(self)
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types) and not isinstance(func, torch._ops.HigherOrderOperator):
            # A DTensor op: let DTensor run it first (as CommDebugMode does). Its collectives --
            # redistributions inside the op, e.g. the loss-parallel cross-entropy's -- then come back here.
            return NotImplemented
        namespace, name = getattr(func, "namespace", ""), func.__name__.split(".")[0]
        if namespace not in _NAMESPACES:
            return func(*args, **kwargs)
        if name == "wait_tensor":
            out = func(*args, **kwargs)
            event = self._pending.pop(_address(args[0]), None)
            if event is not None:
                event[END] = self.recorder.now()
            return out
        if name not in FUNCTIONAL_OPS:
            return func(*args, **kwargs)
        return self._collective(name, func, args, kwargs)

    def _collective(self, name: str, func: Any, args: tuple, kwargs: dict) -> Any:
        op, group_at, size_at, output_bytes = FUNCTIONAL_OPS[name]
        rec = self.recorder
        start = rec.now()
        out = func(*args, **kwargs)
        group = args[group_at] if len(args) > group_at else kwargs.get("group_name", "")
        size = int(args[size_at]) if size_at is not None and len(args) > size_at else process_group_size(group)
        payload = out if output_bytes else args[0]
        extra = {}
        if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
            rows = args[0].shape[0] // max(size, 1)
            extra = {"input_splits": list(args[2] or [rows] * size),
                     "output_splits": list(args[1] or [out.shape[0] // max(size, 1)] * size)}
        event = rec.add(op, tensor_nbytes(payload), dtype_name(payload), size, None, start, None, True, **extra)
        event[TAG] = self._module()  # which layer issued it
        for result in out if isinstance(out, (list, tuple)) else [out]:
            self._pending[_address(result)] = event
        return out

    def _module(self) -> str:
        if self.tracker is None:
            return ""
        where = innermost_module(self.tracker.parents)
        return f"{where} (backward)" if self.tracker.is_bw and where else where


_running: list[FunctionalRecorder] = []  # the recorders entered on this process, innermost last


@contextlib.contextmanager
def modules_untracked() -> Iterator[None]:
    """Pause the running recorders' module trackers; events meanwhile name no module.

    ModTracker hooks a grad hook onto each module's inputs; ``torch.autograd.grad`` then fails on a
    leaf input ("A leaf node was passed to _will_engine_execute_node"), as in a pipeline stage's
    first-step shape inference (``torch.distributed.pipelining``)."""
    paused = [r.tracker for r in _running if r.tracker is not None]
    for tracker in paused:
        tracker.__exit__()
    try:
        yield
    finally:
        for tracker in paused:
            tracker.__enter__()


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else id(t)
