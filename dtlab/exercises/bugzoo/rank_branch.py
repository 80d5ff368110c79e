"""Bug ``rank_branch``: only rank 0 calls a function that holds a collective, and the ranks hang.

``evaluate`` is written for every rank (each scores its share of the
validation set, an all_reduce adds the counts up), but the program calls it
under ``if info.rank == 0``. Rank 1 goes on to the final barrier; rank 0 waits
in the all_reduce; neither call can complete. dtlab's hang report shows both
ranks at the same collective number in different collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

STEPS, VAL = 4, 32

DESCRIPTION = (
    f"train(info) trains a small MLP for {STEPS} steps (gradients averaged with kit.average_gradients), evaluates "
    "it on a validation set, and returns the accuracy on rank 0 (other ranks may return anything). Fix the hang. "
    "Checked at world size 2: it must finish, the ranks must hold the same model, and rank 0 must return the "
    f"trained model's accuracy on the whole validation set (kit.batch(99, {VAL}))."
)
TOOL = "dtlab's last-collective-per-rank table, printed when a collective times out"


def evaluate(model: torch.nn.Module, info: Any) -> float:
    """Accuracy on the validation set: each rank scores its share, one all_reduce adds the counts up."""
    x, y = kit.batch(99, VAL)
    x, y = x[info.rank::info.world_size], y[info.rank::info.world_size]
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum().float()
    dist.all_reduce(correct)
    return correct.item() / VAL


def train(info: Any) -> float | None:
    torch.manual_seed(0)
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
    accuracy = None
    if info.rank == 0:
        accuracy = evaluate(model, info)
        print(f"validation accuracy {accuracy:.2f}")
    dist.barrier()  # nobody leaves before rank 0 has evaluated
    return accuracy


def fixed(info: Any) -> float | None:
    torch.manual_seed(0)
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
    accuracy = evaluate(model, info)  # a collective: every rank calls it; only the printing is rank 0's
    if info.rank == 0:
        print(f"validation accuracy {accuracy:.2f}")
    dist.barrier()
    return accuracy


def accuracy_of(params: torch.Tensor) -> float:
    """The validation accuracy of the MLP with these (flat) parameters, computed here in one process."""
    model = kit.make_model()
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    x, y = kit.batch(99, VAL)
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    if problem := replicas_disagree(ranks):
        return problem
    value, want = ranks[0].value, accuracy_of(ranks[0].final)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return f"rank 0 returned {value!r}: return the validation accuracy (a float) from rank 0."
    if abs(value - want) > 1e-6:
        return (f"rank 0 returned accuracy {value:.4f}, but the trained model scores {want:.4f} on the whole "
                f"validation set ({VAL} samples): every sample must be counted once.")
    return None


def summary(runs: dict[int, list[RankRun]]) -> str:
    ranks = runs[2]
    return (f"the program finished, both ranks held the same model after {len(ranks[0].steps)} steps, and rank 0 "
            f"returned its validation accuracy {ranks[0].value:.4f}.")


def symptom(ranks: list[RankRun]) -> str:
    return f"the program finished; rank 0 returned {ranks[0].value!r}."


BUG = Bug("rank_branch", "A collective behind `if rank == 0`", TOOL, DESCRIPTION, train, fixed, judge, summary,
          symptom, helpers=(evaluate,), constants=("STEPS", "VAL"))
