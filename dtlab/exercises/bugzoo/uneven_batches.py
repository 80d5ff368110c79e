"""Bug ``uneven_batches``: the ranks get different numbers of batches, and the one with more hangs.

41 samples split over 2 ranks give 21 and 20, so 6 batches of 4 against 5.
DDP all-reduces gradients in every backward: rank 0's sixth backward waits
for a partner that has left the loop for the final barrier. Fixes: DDP's
``Join`` context (a rank that has run out of data shadows the others'
all-reduces with zeros until all are done), or even shards (drop the
remainder, or pad as DistributedSampler does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join
from torch.utils.data import DataLoader, Subset

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

SAMPLES, BATCH = 41, 4

DESCRIPTION = (
    f"train(info) gives each rank every world_size-th of kit.Samples({SAMPLES}) ({SAMPLES} does not divide by the "
    f"world size), trains a DDP model over its batches of {BATCH}, meets the other ranks at a barrier and returns "
    "the model. Fix the hang, keeping the dataset. Checked at world size 2: it must finish, the ranks must end with "
    f"the same parameters, and the ranks together must have read at least {SAMPLES - 1} of the samples."
)
TOOL = "dtlab's last-collective-per-rank table (the ranks' step numbers differ)"


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.DDP(kit.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    data = kit.Samples(SAMPLES)
    shard = Subset(data, range(info.rank, len(data), info.world_size))
    for _step, (x, y) in kit.enumerate_steps(DataLoader(shard, batch_size=BATCH)):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()  # everyone is done before anyone saves or leaves
    return model


def fixed(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.DDP(kit.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    data = kit.Samples(SAMPLES)
    shard = Subset(data, range(info.rank, len(data), info.world_size))
    # Join: a rank out of batches answers the others' all-reduces with zeros until every rank is done,
    # then DDP copies the last rank's parameters to all
    with Join([model]):
        for _step, (x, y) in kit.enumerate_steps(DataLoader(shard, batch_size=BATCH)):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    return model


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    read = set().union(*(i for run in ranks for i in run.fetched))
    if len(read) < SAMPLES - 1:
        return (f"the ranks read {len(read)} distinct samples of kit.Samples({SAMPLES}); keep the dataset (dropping "
                f"a remainder smaller than the world size is fine) and make the program cope with uneven shards.")
    finals = [run.final for run in ranks]
    if any(f is None for f in finals):
        return "no optimizer step was seen on some rank: train the model with a torch.optim optimizer."
    if problem := replicas_disagree([run for run in ranks]):
        return problem
    return None


def summary(runs: dict[int, list[RankRun]]) -> str:
    ranks = runs[2]
    steps = " and ".join(str(len(run.steps)) for run in ranks)
    read = len(set().union(*(i for run in ranks for i in run.fetched)))
    return (f"the program finished with {read} of {SAMPLES} samples read ({steps} optimizer steps on ranks 0 and 1) "
            "and both ranks ended with the same parameters.")


def symptom(ranks: list[RankRun]) -> str:
    return "the program finished."


BUG = Bug("uneven_batches", "An uneven last batch", TOOL, DESCRIPTION, train, fixed, judge, summary, symptom,
          constants=("SAMPLES", "BATCH"), imports=("from torch.utils.data import DataLoader, Subset",))
