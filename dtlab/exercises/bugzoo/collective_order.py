"""Bug ``collective_order``: two ranks call the same two collectives in a different order, and hang.

The learning-rate schedule runs on rank 0 only; after warm-up it tells the others each step's rate with a
broadcast. Rank 0 broadcasts once it has averaged its gradients; the others receive at the start of the
step, before they average theirs. Through the warm-up the ranks agree (no broadcast yet); at the first
step after it, rank 0's next collective is the gradient all_reduce and rank 1's the broadcast: the same
sequence number, two different collectives, and neither completes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, parity_problem, replicas_disagree

STEPS, WARMUP, DECAY = 6, 3, 0.5

DESCRIPTION = (
    f"train(info) trains a small MLP for {STEPS} steps (gradients averaged with kit.average_gradients). From step "
    f"{WARMUP} on, rank 0's schedule halves the learning rate every step and broadcasts it to the other ranks. "
    "It returns the model. Fix the hang. Checked at world sizes 1 and 2: it must finish, the ranks must hold the "
    "same model, and it must train the same model as one process does (every rank stepping with rank 0's rates)."
)
TOOL = "PyTorch's Flight Recorder: every rank's dump, read by dtlab.core.flight_diagnosis (and torch's fr_trace)"


def schedule(step: int) -> float:
    """Rank 0's learning rate for ``step``: constant through the warm-up, then halved every step."""
    return kit.LR * DECAY ** max(0, step + 1 - WARMUP)


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    lr = torch.tensor([kit.LR])
    for step in kit.steps(STEPS):
        if step >= WARMUP and info.rank != 0:
            dist.broadcast(lr, src=0)  # the others take rank 0's rate before the step
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        if step >= WARMUP and info.rank == 0:
            lr.fill_(schedule(step))
            dist.broadcast(lr, src=0)  # rank 0 decides once its gradients are averaged, and sends it
        for group in opt.param_groups:
            group["lr"] = lr.item()
        opt.step()
    return model


def fixed(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    lr = torch.tensor([kit.LR])
    for step in kit.steps(STEPS):
        x, y = kit.batch(step)
        x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        if step >= WARMUP:
            if info.rank == 0:
                lr.fill_(schedule(step))
            dist.broadcast(lr, src=0)  # every rank at the same point: the same collectives in the same order
        for group in opt.param_groups:
            group["lr"] = lr.item()
        opt.step()
    return model


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    return replicas_disagree(runs[2]) or parity_problem(runs[1], runs[2])


def summary(runs: dict[int, list[RankRun]]) -> str:
    return (f"the program finished at world sizes 1 and 2, both ranks held the same model after "
            f"{len(runs[2][0].steps)} steps, and it matched one process's.")


def symptom(ranks: list[RankRun]) -> str:
    return "the program finished."


BUG = Bug("collective_order", "Collectives in a different order", TOOL, DESCRIPTION, train, fixed, judge, summary,
          symptom, world_sizes=(1, 2), helpers=(schedule,), constants=("STEPS", "WARMUP", "DECAY"),
          flight_recorder=True)
