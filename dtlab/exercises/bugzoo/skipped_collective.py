"""Bug ``skipped_collective``: a rank skips a collective when it has nothing to add, and the ranks hang.

The program tracks the accuracy on one class (``WATCHED``): each rank counts the class's samples in its
batch and how many it got right, and an all_reduce on a separate ``metrics`` group adds the counts up.
A rank whose batch holds no sample of that class skips the all_reduce (it has nothing to add). At the
first step where that happens on one rank only, the other waits in the metrics all_reduce while the
skipper goes on to the next step's gradient all_reduce: each waits for the other. Flight Recorder's dumps
show the metrics group's collective that one rank never issued, and where that rank went instead.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

STEPS, WATCHED = 8, 3
READ_S = 0.01  # reading a batch from storage

DESCRIPTION = (
    f"train(info) trains a small MLP for {STEPS} steps (gradients averaged with kit.average_gradients) and tracks "
    f"its accuracy on class {WATCHED}: the ranks' counts (samples of that class, and correct predictions) are "
    "added up with an all_reduce on a separate 'metrics' process group. It returns that accuracy over the whole "
    f"run. Fix the hang. Checked at world size 2: it must finish, the ranks must hold the same model, and every "
    f"rank must return the accuracy on class {WATCHED} over every step's whole batch (kit.batch(step)), as the "
    "model predicted it in that step."
)
TOOL = "PyTorch's Flight Recorder: every rank's dump, read by dtlab.core.flight_diagnosis (and torch's fr_trace)"


def read_batch(step: int, info: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s batch; reading it takes a moment."""
    time.sleep(READ_S)
    x, y = kit.batch(step)
    return x[info.rank::info.world_size], y[info.rank::info.world_size]


def train(info: Any) -> float:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    metrics = kit.new_group("metrics")  # logging never queues behind a gradient all-reduce
    seen = correct = 0.0
    for step in kit.steps(STEPS):
        x, y = read_batch(step, info)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
        watched = y == WATCHED
        if watched.any():  # nothing to add when this batch has no sample of the class
            counts = torch.stack([watched.sum(), (logits.argmax(1) == y)[watched].sum()]).float()
            dist.all_reduce(counts, group=metrics)
            seen, correct = seen + counts[0].item(), correct + counts[1].item()
    return correct / seen


def fixed(info: Any) -> float:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    metrics = kit.new_group("metrics")
    seen = correct = 0.0
    for step in kit.steps(STEPS):
        x, y = read_batch(step, info)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
        watched = y == WATCHED
        counts = torch.stack([watched.sum(), (logits.argmax(1) == y)[watched].sum()]).float()
        dist.all_reduce(counts, group=metrics)  # every rank, every step: zeros are a fine thing to add
        seen, correct = seen + counts[0].item(), correct + counts[1].item()
    return correct / seen


def watched_accuracy(ranks: list[RankRun]) -> float:
    """The accuracy on class WATCHED over every step's whole batch, with the parameters each step started from,
    computed here in one process from what rank 0's optimizer saw."""
    model = kit.make_model()
    seen = correct = 0
    for step, st in enumerate(ranks[0].steps):
        torch.nn.utils.vector_to_parameters(st.before, model.parameters())
        x, y = kit.batch(step)
        with torch.no_grad():
            hit = model(x).argmax(1) == y
        seen += int((y == WATCHED).sum())
        correct += int(hit[y == WATCHED].sum())
    return correct / seen


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    if problem := replicas_disagree(ranks):
        return problem
    if len(ranks[0].steps) != STEPS:
        return f"rank 0 took {len(ranks[0].steps)} optimizer steps; the program must train for {STEPS}."
    want = watched_accuracy(ranks)
    for r, run in enumerate(ranks):
        if not isinstance(run.value, int | float) or abs(run.value - want) > 1e-6:
            return (f"rank {r} returned {run.value!r}, but the model's accuracy on class {WATCHED} over the whole "
                    f"batches was {want:.4f}: every sample of the class, on every rank, must be counted once.")
    return None


def summary(runs: dict[int, list[RankRun]]) -> str:
    ranks = runs[2]
    return (f"the program finished, both ranks held the same model after {len(ranks[0].steps)} steps and returned "
            f"the accuracy on class {WATCHED}, {ranks[0].value:.4f}.")


def symptom(ranks: list[RankRun]) -> str:
    return f"the program finished; the ranks returned {[run.value for run in ranks]}."


BUG = Bug("skipped_collective", "A rank that skips a collective", TOOL, DESCRIPTION, train, fixed, judge, summary,
          symptom, helpers=(read_batch,), constants=("STEPS", "WATCHED", "READ_S"), imports=("import time",),
          flight_recorder=True)
