"""Bug ``seed``: every rank seeds torch with its own rank, so the replicas start as different models.

Gradient averaging keeps identical replicas identical; it cannot make
different ones equal. The symptom: the ranks' parameters differ from the
first step on, and the run does not match one process (parity).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, max_abs, parity_problem, replicas_disagree

STEPS = 6

DESCRIPTION = (
    "train(info) builds a small MLP, then for 6 steps takes its shard of the global batch (every "
    "world_size-th sample), runs backward, averages the gradients over the ranks (kit.average_gradients: one "
    "all_reduce) and steps SGD; it returns the model. Fix it so that every rank holds the same model at every step "
    "and the run matches one process training on the whole batch. Checked at world sizes 2 and 1: every rank's "
    "parameters before each optimizer step and its gradients, and the parameters after training against world size 1."
)
TOOL = "parity: the ranks' parameters before each step, and the run against one process (world size 1)"


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(info.rank)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
    return model


def fixed(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)  # the same seed on every rank: the same initial parameters everywhere
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
    return model


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    return replicas_disagree(runs[2]) or parity_problem(runs[1], runs[2])


def summary(runs: dict[int, list[RankRun]]) -> str:
    steps = len(runs[2][0].steps)
    return (f"both ranks held the same parameters before each of {steps} optimizer steps, stepped with the same "
            f"gradients, and ended within {max_abs(runs[2][0].final, runs[1][0].final):.1g} of one process "
            "(parity).")


def symptom(ranks: list[RankRun]) -> str:
    first = max_abs(ranks[1].steps[0].before, ranks[0].steps[0].before)
    last = max_abs(ranks[1].final, ranks[0].final)
    return (f"the program finished, but rank 1's parameters differed from rank 0's by {first:.2g} before the first "
            f"step and by {last:.2g} after training: two different models.")


BUG = Bug("seed", "A different seed on every rank", TOOL, DESCRIPTION, train, fixed, judge, summary, symptom,
          world_sizes=(2, 1), constants=("STEPS",))
