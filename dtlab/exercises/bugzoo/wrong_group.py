"""Bug ``wrong_group``: the ranks create their process groups in different orders, so "grads" is not one group.

The program makes two process groups over every rank, one for gradients and one for metrics. A process
group is known by the order it was created in (its name is its number), not by the variable that holds
it: rank 0 creates the metrics group first, the others create the gradient group first. So rank 0's
"grads" is group 2 and rank 1's is group 1; each rank's gradient all_reduce waits in a group where its
peer never issues one. Flight Recorder's dumps show the same collective issued on two different groups --
and, with ``group_desc`` set, that group 1 is "metrics" on one rank and "grads" on the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

STEPS = 4

DESCRIPTION = (
    f"train(info) makes a process group for gradients and one for metrics, trains a small MLP for {STEPS} steps "
    "(gradients averaged with kit.average_gradients over the gradient group) and adds the ranks' losses up on "
    "the metrics group; it returns the last step's mean loss. Fix the hang. Checked at world size 2: it must "
    "finish, the ranks must hold the same model, and both must return the last step's mean loss over the ranks."
)
TOOL = "PyTorch's Flight Recorder: every rank's dump, read by dtlab.core.flight_diagnosis (and torch's fr_trace)"


def make_groups(info: Any) -> tuple[Any, Any]:
    """A group for gradients and one for metrics, over every rank (logging never queues behind gradients)."""
    if info.rank == 0:  # rank 0 writes the logs: it sets up its metrics group first
        metrics = kit.new_group("metrics")
        grads = kit.new_group("grads")
    else:
        grads = kit.new_group("grads")
        metrics = kit.new_group("metrics")
    return grads, metrics


def train(info: Any) -> float:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    grads, metrics = make_groups(info)
    mean = torch.zeros(1)
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model, group=grads)
        opt.step()
        mean = loss.detach().reshape(1) / info.world_size
        dist.all_reduce(mean, group=metrics)
    return mean.item()


def fixed_groups(info: Any) -> tuple[Any, Any]:
    """The same two groups, created in the same order on every rank: a group is known by its creation order."""
    grads = kit.new_group("grads")
    metrics = kit.new_group("metrics")
    return grads, metrics


def fixed(info: Any) -> float:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    grads, metrics = fixed_groups(info)
    mean = torch.zeros(1)
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model, group=grads)
        opt.step()
        mean = loss.detach().reshape(1) / info.world_size
        dist.all_reduce(mean, group=metrics)
    return mean.item()


def last_mean_loss(ranks: list[RankRun]) -> float:
    """The last step's loss over its whole batch, with the parameters that step started from (one process)."""
    model = kit.make_model()
    step = len(ranks[0].steps) - 1
    torch.nn.utils.vector_to_parameters(ranks[0].steps[step].before, model.parameters())
    x, y = kit.batch(step)
    with torch.no_grad():
        halves = [F.cross_entropy(model(x[r::2]), y[r::2]) for r in range(2)]
    return float(sum(halves) / 2)


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    if problem := replicas_disagree(ranks):
        return problem
    if len(ranks[0].steps) != STEPS:
        return f"rank 0 took {len(ranks[0].steps)} optimizer steps; the program must train for {STEPS}."
    want = last_mean_loss(ranks)
    for r, run in enumerate(ranks):
        if not isinstance(run.value, int | float) or abs(run.value - want) > 1e-5:
            return (f"rank {r} returned {run.value!r}, but the last step's mean loss over the ranks was {want:.5f}: "
                    "add the ranks' losses up on the metrics group.")
    return None


def summary(runs: dict[int, list[RankRun]]) -> str:
    ranks = runs[2]
    return (f"the program finished, both ranks held the same model after {len(ranks[0].steps)} steps and returned "
            f"the last mean loss, {ranks[0].value:.4f}.")


def symptom(ranks: list[RankRun]) -> str:
    return f"the program finished; the ranks returned {[run.value for run in ranks]}."


BUG = Bug("wrong_group", "A collective on the wrong group", TOOL, DESCRIPTION, train, fixed, judge, summary, symptom,
          helpers=(make_groups,), constants=("STEPS",), flight_recorder=True)
