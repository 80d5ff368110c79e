"""Bug ``set_epoch``: the DistributedSampler's epoch is never set, so every epoch visits the data in the same order.

DistributedSampler shuffles with ``seed + epoch``; its epoch stays 0 unless
``sampler.set_epoch(epoch)`` is called, so "shuffle=True" shuffles once. The
shards stay disjoint either way: every rank must draw the same permutation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

EPOCHS, SAMPLES = 3, 32

DESCRIPTION = (
    f"train(info) trains a DDP model for {EPOCHS} epochs over kit.Samples({SAMPLES}) with a shuffling "
    "DistributedSampler and returns the model. Fix it so that every epoch visits the samples in a new order "
    "while the ranks' shards stay disjoint and cover the dataset. Checked at world size 2 from the indices each rank "
    "fetched in each epoch (loop over kit.epochs(n), use kit.Samples)."
)
TOOL = "the sample indices each rank fetched, epoch by epoch"


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.DDP(kit.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    sampler = DistributedSampler(kit.Samples(SAMPLES), shuffle=True)
    loader = DataLoader(sampler.dataset, batch_size=4, sampler=sampler)
    for _epoch in kit.epochs(EPOCHS):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def fixed(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.DDP(kit.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    sampler = DistributedSampler(kit.Samples(SAMPLES), shuffle=True)
    loader = DataLoader(sampler.dataset, batch_size=4, sampler=sampler)
    for epoch in kit.epochs(EPOCHS):
        sampler.set_epoch(epoch)  # shuffle with seed + epoch: a new order each epoch, the same on every rank
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def _shard_problem(epoch: int, shards: list[tuple[int, ...]]) -> str | None:
    seen: dict[int, int] = {}
    for r, shard in enumerate(shards):
        for i in shard:
            if i in seen and seen[i] != r:
                return (f"in epoch {epoch} sample {i} was fetched by rank {seen[i]} and by rank {r}: the shards "
                        "overlap. Every rank must shuffle with the same seed (DistributedSampler does) and take "
                        "its own share.")
            seen[i] = r
    missing = sorted(set(range(SAMPLES)) - set(seen))
    if missing:
        return f"in epoch {epoch} no rank fetched samples {missing[:6]}: the shards must cover the dataset."
    return None


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    for r, run in enumerate(ranks):
        if len(run.fetched) < EPOCHS:
            return (f"rank {r} fetched samples in {len(run.fetched)} epochs, expected {EPOCHS}: loop over "
                    f"kit.epochs({EPOCHS}) and read kit.Samples({SAMPLES}) in each.")
    for e in range(EPOCHS):
        if problem := _shard_problem(e, [run.fetched[e] for run in ranks]):
            return problem
    for r, run in enumerate(ranks):
        for e in range(1, EPOCHS):
            if run.fetched[e] == run.fetched[e - 1]:
                return (f"rank {r} fetched its samples in the same order in epochs {e - 1} and {e} "
                        f"({list(run.fetched[e][:5])}...): the sampler's shuffle depends on its epoch, which stays "
                        "0 unless the program tells it (DistributedSampler.set_epoch).")
    return replicas_disagree(ranks)


def summary(runs: dict[int, list[RankRun]]) -> str:
    first = [list(run.fetched[0][:4]) for run in runs[2]]
    second = [list(run.fetched[1][:4]) for run in runs[2]]
    return (f"in each of {EPOCHS} epochs the two ranks' shards were disjoint and covered all {SAMPLES} samples, and "
            f"each epoch had a new order (rank 0 began with {first[0]}, then {second[0]}; rank 1 with {first[1]}, "
            f"then {second[1]}).")


def symptom(ranks: list[RankRun]) -> str:
    return "the program finished; rank 0 fetched, epoch by epoch:\n" + "\n".join(
        f"  epoch {e}: {list(order)}" for e, order in enumerate(ranks[0].fetched))


BUG = Bug("set_epoch", "A missing sampler.set_epoch", TOOL, DESCRIPTION, train, fixed, judge, summary, symptom,
          constants=("EPOCHS", "SAMPLES"), imports=("from torch.utils.data import DataLoader",
                                                  "from torch.utils.data.distributed import DistributedSampler"))
