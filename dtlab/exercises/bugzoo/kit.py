"""What the zoo's training programs share: a small dataset, a model, gradient averaging and step marks.

The programs are ordinary torch.distributed code; these helpers only keep them
short. ``Samples`` notes every index a rank fetches and ``steps``/``epochs``
tell dtlab's CommRecorder which step a collective belongs to, so that a check
can read what each rank saw and when, without reading the program's source.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtlab.core import compat
from dtlab.instrument.recorder import active

FEATURES, CLASSES, WIDTH = 8, 4, 16
LR = 0.1
T = TypeVar("T")

# Indices fetched on this rank, per epoch ([] before the first ``epochs`` mark); the checker reads it.
fetched: list[list[int]] = [[]]


class Samples(torch.utils.data.Dataset):
    """``n`` fixed (x, y) samples, the same on every rank, that note which index each rank fetched."""

    def __init__(self, n: int = 48) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, FEATURES, generator=gen)
        self.y = torch.randint(0, CLASSES, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        fetched[-1].append(int(i))
        return self.x[i], self.y[i]


def make_model(unused: bool = False) -> nn.Module:
    """A small MLP drawn from torch's current random state (so the seed decides its parameters)."""
    return _Net(unused) if unused else nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(),
                                                     nn.Linear(WIDTH, CLASSES))


class _Net(nn.Module):
    """The MLP with an auxiliary head that ``forward`` only uses when ``with_aux`` is set."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU())
        self.head = nn.Linear(WIDTH, CLASSES)
        self.aux = nn.Linear(WIDTH, CLASSES)
        self.with_aux = not unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + self.aux(h) if self.with_aux else self.head(h)


def batch(step: int, global_batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole global batch (every rank can make it; each takes its own slice)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(global_batch, FEATURES, generator=gen), torch.randint(0, CLASSES, (global_batch,), generator=gen)


def new_group(desc: str) -> Any:
    """``dist.new_group(group_desc=desc)`` over every rank, with the default group's collective timeout.

    Without ``timeout`` a new group waits torch's own default (30 minutes for gloo), not the timeout the
    process group was started with: a hang in it would outlast any sensible wait.
    """
    return dist.new_group(group_desc=desc, timeout=compat.group_timeout())


def average_gradients(model: nn.Module, group: Any = None) -> None:
    """The global batch's gradient on every rank: one all_reduce (sum) of all gradients over ``group`` (default:
    every rank), then / its size."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def steps(n: int) -> Iterator[int]:
    """``range(n)``, telling the CommRecorder each step (dtlab's hang report and timeline name it)."""
    for step, _ in enumerate_steps(range(n)):
        yield step


def enumerate_steps(items: Iterable[T]) -> Iterator[tuple[int, T]]:
    """``enumerate(items)`` (a DataLoader, say), telling the CommRecorder each step."""
    rec = active()
    for step, item in enumerate(items):
        if rec is not None:
            rec.step = step
        yield step, item


def epochs(n: int) -> Iterator[int]:
    """``range(n)``, starting a new list of fetched indices at each epoch (and telling the recorder)."""
    fetched.clear()
    for epoch in steps(n):
        fetched.append([])
        yield epoch


def DDP(module: nn.Module, **kwargs: Any) -> DistributedDataParallel:  # noqa: N802 - reads as the class it makes
    """``DistributedDataParallel(module, **kwargs)`` whose bucket all-reduces dtlab's recorder sees.

    DDP's reducer runs its all-reduces in C++, out of the recorder's sight; this
    comm hook issues them through ``dist.all_reduce`` instead, and waits for each
    (no overlap with backward: these models are tiny), so that a rank stuck in
    one shows up in dtlab's hang report. The arithmetic is DDP's own.
    """
    ddp = DistributedDataParallel(module, **kwargs)
    ddp.register_comm_hook(None, _recorded_allreduce)
    return ddp


def _recorded_allreduce(process_group, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations here
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(process_group))
    dist.all_reduce(buf, group=process_group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut
