"""Bug ``straggler``: one rank's share of the data costs more to prepare, and every step waits for it.

The dataset is sorted by sequence length (as bucketing by length does) and
cut into contiguous halves: rank 1 gets all the long sequences, and loading a
sequence takes time in proportion to its length. Under synchronous data
parallelism every rank waits in the gradient all-reduce for the last one to
arrive, so step times cannot say who is slow; when each rank *enters* the
all-reduce can (``dtlab.read.stragglers``). Fix: shard so that every rank
gets a mix of lengths (every world_size-th sample, or a shuffle).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

LENGTHS = [i * i // 4 for i in range(64)]  # sequence lengths, sorted
SECONDS_PER_TOKEN = 3e-5
BATCH = 4
SLOW_RANK = 1
SKEW_TOL_S = 0.015  # a median arrival skew below this passes whatever the work (the planted one is about 60 ms)
WORK_RATIO = 2.0  # a rank working this many times longer per step than another is a straggler (planted: > 5x)

DESCRIPTION = (
    f"train(info) loads each of its samples (a sequence of LENGTHS[i] tokens; loading takes time per token) and "
    f"trains a small MLP on them in batches of {BATCH}, averaging gradients with kit.average_gradients; it returns "
    "the model. First name the slow rank: check('straggler', rank) with the rank dtlab.read.stragglers finds. "
    "Then fix the program: check('straggler', train). Checked at world size 2: it must train the same model on both "
    f"ranks for at least 3 steps, and no rank may work more than {WORK_RATIO:g}x as long per step between "
    f"all-reduces as another (or the median arrival skew must stay under {SKEW_TOL_S * 1e3:g} ms)."
)
TOOL = "dtlab.read.stragglers on the recorded run: when each rank enters each collective"



def load(i: int) -> torch.Tensor:
    """Sample i's features. Reading it takes time in proportion to its length (storage, decoding): the costly part."""
    time.sleep(LENGTHS[i] * SECONDS_PER_TOKEN)
    gen = torch.Generator().manual_seed(i)
    return torch.randn(kit.FEATURES, generator=gen)


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    per_rank = len(LENGTHS) // info.world_size
    mine = list(range(info.rank * per_rank, (info.rank + 1) * per_rank))
    for step in kit.steps(per_rank // BATCH):
        idx = mine[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([load(i) for i in idx])
        y = torch.tensor([i % kit.CLASSES for i in idx])
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
    return model


def fixed(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    per_rank = len(LENGTHS) // info.world_size
    # every world_size-th sample: each rank gets short and long sequences alike, so equal work per step
    mine = list(range(info.rank, len(LENGTHS), info.world_size))
    for step in kit.steps(per_rank // BATCH):
        idx = mine[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([load(i) for i in idx])
        y = torch.tensor([i % kit.CLASSES for i in idx])
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
    return model


def arrival_skew(ranks: list[RankRun]) -> tuple[list[float], list[int]]:
    """Per all-reduce (the k-th on every rank): how long the first arrival waited for the last, and who was last."""
    starts = [[c.start for c in run.calls if c.op == "all_reduce"] for run in ranks]
    skews, last = [], []
    for k in range(min(len(s) for s in starts)):
        at = [s[k] for s in starts]
        skews.append(max(at) - min(at))
        last.append(at.index(max(at)))
    return skews, last


def work_per_step(run: RankRun) -> float:
    """The rank's median time between leaving one all-reduce and entering the next: its own work per step."""
    calls = [c for c in run.calls if c.op == "all_reduce"]
    gaps = [b.start - a.end for a, b in zip(calls, calls[1:]) if a.end is not None]
    return statistics.median(gaps) if gaps else 0.0


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    if problem := replicas_disagree(ranks):
        return problem
    skews, last = arrival_skew(ranks)
    if len(skews) < 3:
        return f"the ranks met in {len(skews)} all-reduces; the program must train at least 3 steps."
    # Each rank's own work between all-reduces, not the arrival skew alone: on a busy machine the skew of a
    # balanced program is noise, while the ratio of work stays put.
    work = [work_per_step(run) for run in ranks]
    slow, fast = max(range(len(work)), key=work.__getitem__), min(range(len(work)), key=work.__getitem__)
    if work[slow] > WORK_RATIO * work[fast] and statistics.median(skews[1:]) > SKEW_TOL_S:
        return (f"rank {slow} still works {work[slow] * 1e3:.1f} ms per step between all-reduces against rank "
                f"{fast}'s {work[fast] * 1e3:.1f} ms, and arrives last at {last.count(slow)} of {len(last)} "
                "all-reduces: the others wait for it. Give every rank the same amount of work.")
    return None


def summary(runs: dict[int, list[RankRun]]) -> str:
    skews, _ = arrival_skew(runs[2])
    work = " and ".join(f"{work_per_step(run) * 1e3:.1f}" for run in runs[2])
    return (f"both ranks trained the same model, worked {work} ms per step between all-reduces, and met at "
            f"{len(skews)} all-reduces with a median skew of {statistics.median(skews[1:]) * 1e3:.1f} ms (the "
            "planted straggler costs about 60 ms per step).")


def symptom(ranks: list[RankRun]) -> str:
    skews, _ = arrival_skew(ranks)
    return (f"the program finished; the ranks' all-reduces waited {statistics.median(skews[1:]) * 1e3:.1f} ms per "
            "step (median) for someone. Who?")


def judge_answer(rank: int, ranks: list[RankRun]) -> tuple[bool, str]:
    """The learner's named rank against the measured one."""
    skews, last = arrival_skew(ranks)
    slow = max(set(last), key=last.count)
    cost = statistics.median(skews[1:]) * 1e3
    if rank != slow:
        return False, (f"rank {rank} is not the one the others wait for: measure when each rank enters each "
                       "all-reduce (dtlab.read.stragglers.straggler on the recorded run).")
    return True, (f"rank {slow} arrives last at {last.count(slow)} of {len(last)} all-reduces; the others wait "
                  f"{cost:.1f} ms per step (median). Now fix the program: check('straggler', your_train).")


BUG = Bug("straggler", "A straggler", TOOL, DESCRIPTION, train, fixed, judge, summary, symptom, helpers=(load,),
          constants=("BATCH",),
          imports=("import time", "from dtlab.exercises.bugzoo.straggler import LENGTHS, SECONDS_PER_TOKEN"))
