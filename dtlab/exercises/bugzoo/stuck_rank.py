"""Bug ``stuck_rank``: one rank is busy far longer than the collective timeout, and the others give up.

Each sample is a sequence; preparing it takes time in proportion to its length. One sample, in rank 1's
share of step 2, is enormous (a corrupt record, an unbounded log line). Rank 0 finishes its step and
waits in the gradient all_reduce; rank 1 is still preparing its batch when rank 0's timeout fires. No
collective is wrong: Flight Recorder's dumps show rank 1's last collective completed, and nothing since,
while rank 0 waits in the next one. Fix: bound the work per sample (read at most ``MAX_LEN`` tokens).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from dtlab.exercises.bugzoo import kit
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, replicas_disagree

STEPS, BATCH, MAX_LEN = 4, 4, 256
SECONDS_PER_TOKEN = 2e-5
LENGTHS = [64 + (i * 37) % 128 for i in range(32)]
LENGTHS[21] = 5_000_000  # in rank 1's share of step 2 (every other sample, 4 per step): 100 s to prepare

DESCRIPTION = (
    f"train(info) trains a small MLP for {STEPS} steps on sequences (sample i has LENGTHS[i] tokens; preparing "
    "a sample takes time per token it reads), each rank taking every other sample in batches of "
    f"{BATCH}, gradients averaged with kit.average_gradients; it returns the model. Fix the hang: a model needs at "
    f"most MAX_LEN={MAX_LEN} tokens of a sample. Checked at world size 2, with a collective timeout of a few "
    f"seconds: it must finish, and the ranks must hold the same model after {STEPS} steps."
)
TOOL = "PyTorch's Flight Recorder: every rank's dump, read by dtlab.core.flight_diagnosis (and torch's fr_trace)"


def prepare(i: int, tokens: int) -> torch.Tensor:
    """Sample i's features from its first ``tokens`` tokens; reading them takes time per token."""
    time.sleep(tokens * SECONDS_PER_TOKEN)
    gen = torch.Generator().manual_seed(i)
    return torch.randn(kit.FEATURES, generator=gen)


def train(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    mine = list(range(info.rank, len(LENGTHS), info.world_size))
    for step in kit.steps(STEPS):
        idx = mine[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([prepare(i, LENGTHS[i]) for i in idx])
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
    mine = list(range(info.rank, len(LENGTHS), info.world_size))
    for step in kit.steps(STEPS):
        idx = mine[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([prepare(i, min(LENGTHS[i], MAX_LEN)) for i in idx])  # bounded work per sample
        y = torch.tensor([i % kit.CLASSES for i in idx])
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        kit.average_gradients(model)
        opt.step()
    return model


def judge(runs: dict[int, list[RankRun]]) -> str | None:
    ranks = runs[2]
    if problem := replicas_disagree(ranks):
        return problem
    if len(ranks[0].steps) != STEPS:
        return f"rank 0 took {len(ranks[0].steps)} optimizer steps; the program must train for {STEPS}."
    return None


def summary(runs: dict[int, list[RankRun]]) -> str:
    return f"the program finished, and both ranks held the same model after {len(runs[2][0].steps)} steps."


def symptom(ranks: list[RankRun]) -> str:
    return "the program finished."


BUG = Bug("stuck_rank", "A rank stuck in its own work", TOOL, DESCRIPTION, train, fixed, judge, summary, symptom,
          helpers=(prepare,), constants=("STEPS", "BATCH", "MAX_LEN"),
          imports=("import time", "from dtlab.exercises.bugzoo.stuck_rank import LENGTHS, SECONDS_PER_TOKEN"),
          flight_recorder=True)
