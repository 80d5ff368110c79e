"""What a rank keeps between calls, weighed by storage wherever it is held: its state dict, globals, closures,
attributes, gradients left in ``.grad`` (zero1_step's memory check; any exercise that weighs memory can share it)."""

from __future__ import annotations

import collections
import gc
import math
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")
# how long a scan that found something waits before it looks again: a backend thread lets go within microseconds
# when it runs, and a loaded machine can delay it tens of milliseconds
SETTLE_S = 0.2


def settled(scan: Callable[[], T], found_any: Callable[[T], bool]) -> T:
    """``scan()``; where ``found_any`` of it, ``scan()`` once more ``SETTLE_S`` later, and that one counts.

    A collective returns when its result is ready, but the backend's worker thread (gloo's) can hold the finished
    call, and with it the call's tensors, a moment longer (about 1 call in 4 at 3 ranks here); torch keeps those
    tensors' Python objects alive meanwhile, so a scan of what is alive can find a buffer the learner let go of.
    What the learner keeps is still there at the second look; what the backend held is not. (One look again, not
    many: a scan of every live object takes a good part of a second in a rank.)"""
    result = scan()
    if not found_any(result):
        return result
    time.sleep(SETTLE_S)
    return scan()


def live_tensors() -> list[torch.Tensor]:
    """Every tensor alive in this process that Python can see (torch.Tensor objects are tracked by the gc)."""
    is_tensor: dict[type, bool] = {}
    found = []
    for obj in gc.get_objects():
        kind = type(obj)
        if is_tensor.setdefault(kind, issubclass(kind, torch.Tensor)):
            found.append(obj)
    return found


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for one without a plain storage (sparse, meta)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr(), storage.nbytes()


def state_storages(state: Any) -> tuple[dict[int, int], int]:
    """What ``state`` holds: every tensor's storage reachable in it, {address: bytes}, each once (dicts, lists,
    optimizers, objects' attributes); and the bytes of its numpy arrays and numbers (8 bytes each)."""
    storages: dict[int, int] = {}
    visited: set[int] = set()
    other = 0

    def walk(x: Any) -> None:
        nonlocal other
        if isinstance(x, torch.Tensor):
            for t in (x, x.grad):
                if t is not None and (found := _storage(t)):
                    storages.setdefault(*found)
            return
        if isinstance(x, bool | int | float):
            other += 8
            return
        if id(x) in visited or isinstance(x, str | bytes | type | types.ModuleType | types.FunctionType):
            return
        visited.add(id(x))
        if isinstance(x, np.ndarray):
            other += x.nbytes
        elif isinstance(x, torch.optim.Optimizer):  # its moments, and the tensors it steps if they are copies
            walk(list(x.state.values()))
            walk([group["params"] for group in x.param_groups])
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple | set | frozenset | collections.deque):
            for v in x:
                walk(v)
        elif hasattr(x, "__dict__"):
            walk(vars(x))

    walk(state)
    return storages, other


@dataclass(frozen=True)
class Kept:
    """What a rank keeps between calls, in bytes, each storage once and the parameters' own not counted: what its
    state dict holds, the tensors it holds elsewhere (globals, closures, attributes), how much of either is a
    gradient left in some tensor's .grad, and a shape per storage (its largest tensor's)."""

    in_state: int
    outside: int
    in_grads: int
    shapes: tuple[tuple[int, ...], ...]

    @property
    def total(self) -> int:
        return self.in_state + self.outside


def kept(state: Any, before: Sequence[torch.Tensor], ours: Sequence[torch.Tensor]) -> Kept:
    """Weigh what a rank keeps: ``before``, the tensors alive before the learner's first call (still referenced,
    so that no new storage can take their addresses), and ``ours``, the checker's, are not counted. What is held
    outside the state dict is looked at once more, after the backend has had time to let go of its last
    call (``settled``)."""
    return settled(lambda: _weigh(state, before, ours), lambda k: k.outside > 0)


def _weigh(state: Any, before: Sequence[torch.Tensor], ours: Sequence[torch.Tensor]) -> Kept:
    gc.collect()  # what only a reference cycle still holds is not kept
    skip = {found[0] for t in (*before, *ours) if (found := _storage(t))}
    in_state, other = state_storages(state)
    outside: dict[int, int] = {}
    grads: dict[int, int] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for x in live_tensors():
        for t in (x, x.grad):
            found = _storage(t) if t is not None else None
            if found is None or found[0] in skip:
                continue
            if found[0] not in in_state:
                outside.setdefault(*found)
            if t is not x:
                grads.setdefault(*found)
            if t.numel() > math.prod(shapes.get(found[0], (0,))):
                shapes[found[0]] = tuple(t.shape)
    in_bytes = other + sum(b for ptr, b in in_state.items() if ptr not in skip)
    return Kept(in_bytes, sum(outside.values()), sum(grads.values()), tuple(shapes.values()))
