"""Bug ``unused_parameter``: a parameter takes no part in the loss, and DDP stops at the second step.

DDP's reducer waits for a gradient from every parameter before it all-reduces
a bucket. A parameter that forward never used never produces one, so the
first backward ends with a bucket still unreduced, and the next step raises
"Expected to have finished reduction in the prior iteration". With
``TORCH_DISTRIBUTED_DEBUG=INFO`` the error names the parameters (DETAIL would
too, but with DDP on gloo it crashes the ranks with SIGSEGV on torch 2.13 CPU).
Fixes: use the parameter, remove it, or tell DDP (``find_unused_parameters=True``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, max_abs, parity_problem, replicas_disagree

STEPS = 5

DESCRIPTION = (
    f"train(info) wraps kit.make_model(unused=True) (an MLP whose auxiliary head `aux` forward does not use) in DDP "
    f"and trains {STEPS} steps on each rank's shard of the global batch; it returns the model. Fix the error DDP "
    "raises. Checked at world sizes 2 and 1: every step must run, the ranks must hold the same model, and the "
    "result must match one process (parity)."
)
TOOL = "the rank's own error, and TORCH_DISTRIBUTED_DEBUG=INFO, which names the parameters without a gradient"


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.DDP(kit.make_model(unused=True))
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def fixed(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    # find_unused_parameters: after each forward DDP marks the parameters the graph does not reach as ready
    model = kit.DDP(kit.make_model(unused=True), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    if len(runs[2][0].steps) < STEPS:
        return f"rank 0 took {len(runs[2][0].steps)} optimizer steps; the program must take {STEPS}."
    return replicas_disagree(runs[2]) or parity_problem(runs[1], runs[2])


def summary(runs: dict[int, list[RankRun]]) -> str:
    return (f"all {len(runs[2][0].steps)} steps ran at world size 2, both ranks held the same model, and it ended "
            f"within {max_abs(runs[2][0].final, runs[1][0].final):.1g} of one process (parity).")


def symptom(ranks: list[RankRun]) -> str:
    return f"the program finished {len(ranks[0].steps)} steps."


BUG = Bug("unused_parameter", "An unused parameter under DDP", TOOL, DESCRIPTION, train, fixed, judge, summary,
          symptom, world_sizes=(2, 1), constants=("STEPS",))
