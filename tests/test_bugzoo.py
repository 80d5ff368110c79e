"""The bug zoo: every reference fix passes its check; every buggy program, and other wrong fixes, fail saying why.

The wrong fixes below are plausible first attempts; each test asserts on the
part of the feedback that names what is still wrong (which rank, which step,
what was seen).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from dtlab.exercises import CheckResult, _progress, bugzoo
from dtlab.exercises.bugzoo import collective_order, kit, rank_branch, skipped_collective, stuck_rank
from dtlab.read.stragglers import straggler

launches_ranks = pytest.mark.usefixtures("no_survivors")  # (conftest marks these slow)
NAMES = ("seed", "set_epoch", "rank_branch", "unused_parameter", "uneven_batches", "straggler", "skipped_collective",
         "collective_order", "wrong_group", "stuck_rank")
HANGS = NAMES[6:]  # run with Flight Recorder: the hang's report reads every rank's dump


@pytest.fixture(autouse=True)
def progress_log(tmp_path, monkeypatch):
    """Checks record their verdicts in a temporary file, not in the working directory's results/."""
    monkeypatch.setattr(_progress, "PROGRESS_LOG", tmp_path / "progress.jsonl")


# -- wrong fixes: the bug moved, not gone ----------------------------------------------------------------------------
def same_seed_but_no_averaging(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(4):
        x, y = kit.batch(step)
        F.cross_entropy(model(x[info.rank::2]), y[info.rank::2]).backward()
        opt.step()
        opt.zero_grad()
    return model


def sampler_seeded_by_rank(info: Any) -> None:
    sampler = DistributedSampler(kit.Samples(32), shuffle=True, seed=info.rank)
    for epoch in kit.epochs(3):
        sampler.set_epoch(epoch)
        for _ in DataLoader(sampler.dataset, batch_size=4, sampler=sampler):
            pass


def evaluate_alone_on_a_shard(info: Any) -> float | None:
    torch.manual_seed(0)
    model = kit.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(4):
        x, y = kit.batch(step)
        F.cross_entropy(model(x[info.rank::2]), y[info.rank::2]).backward()
        kit.average_gradients(model)
        opt.step()
        opt.zero_grad()
    x, y = kit.batch(99, rank_branch.VAL)
    accuracy = float((model(x[::2]).argmax(1) == y[::2]).float().mean()) if info.rank == 0 else None
    dist.barrier()
    return accuracy


def without_ddp(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.make_model(unused=True)
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    for step in kit.steps(5):
        x, y = kit.batch(step)
        F.cross_entropy(model(x[info.rank::2]), y[info.rank::2]).backward()
        opt.step()
        opt.zero_grad()
    return model


def a_smaller_dataset(info: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = kit.DDP(kit.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=kit.LR)
    data = kit.Samples(32)
    for x, y in DataLoader(Subset(data, range(info.rank, 32, 2)), batch_size=4):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return model


# -- the API, without launching ----------------------------------------------------------------------------------
def test_names_describe_and_sources_that_define_the_program():
    assert bugzoo.names() == NAMES
    for name in NAMES:
        text = bugzoo.describe(name)
        assert "Checked at world size" in text and "The tool that names it:" in text
        namespace: dict[str, Any] = {}
        exec(bugzoo.source(name), namespace)  # what the notebook's stub cell holds
        assert callable(namespace["train"])
    with pytest.raises(ValueError, match="no bug named"):
        bugzoo.describe("typo")
    with pytest.raises(TypeError, match="train"):
        bugzoo.check("seed", "not a function")


# -- launching ---------------------------------------------------------------------------------------------------
@launches_ranks
@pytest.mark.parametrize("name", NAMES)
def test_the_reference_fix_passes(name):
    result = bugzoo.check(name, bugzoo.solution(name))
    assert isinstance(result, CheckResult) and result.passed, result.feedback


@launches_ranks
@pytest.mark.parametrize(("name", "says"), [
    ("seed", r"before optimizer step 0, rank 1's parameters differed .* started different"),
    ("set_epoch", r"rank 0 fetched its samples in the same order in epochs 0 and 1 .*set_epoch"),
    ("rank_branch", r"after 3 s: .*rank 0: waiting in all_reduce \(its collective #5.*rank 1: waiting in barrier \(its "
                    r"collective #5"),
    ("unused_parameter", r"Expected to have finished reduction.*did not receive grad for rank \d: 4 5"),
    # #11: DDP's construction (a shape check, two broadcasts), its bucket rebuild at step 1 (two broadcasts), a
    # bucket all-reduce per step: every collective on the wire, C++'s included
    ("uneven_batches", r"rank 0: waiting in all_reduce \(its collective #11, step 5\).*rank 1: waiting in barrier"),
    ("straggler", r"rank 1 still works .* ms per step between all-reduces against rank 0's"),
])
def test_the_buggy_program_fails_saying_what_was_seen(name, says):
    namespace: dict[str, Any] = {}
    exec(bugzoo.source(name), namespace)  # the program as the notebook's stub cell holds it
    result = bugzoo.check(name, namespace["train"])
    assert not result.passed
    assert result.feedback and re.search(says, result.feedback), result.feedback


@launches_ranks
@pytest.mark.parametrize(("name", "fn", "says"), [
    ("seed", same_seed_but_no_averaging, "at optimizer step 0, rank 1's gradients differed"),
    ("set_epoch", sampler_seeded_by_rank, "was fetched by rank 0 and by rank 1: the shards overlap"),
    ("rank_branch", evaluate_alone_on_a_shard, "but the trained model scores"),
    ("unused_parameter", without_ddp, "rank 1's gradients differed"),
    ("uneven_batches", a_smaller_dataset, "the ranks read 32 distinct samples"),
])
def test_a_fix_that_moves_the_bug_fails_too(name, fn, says):
    result = bugzoo.check(name, fn)
    assert not result.passed and says in result.feedback, result.feedback


@launches_ranks
def test_the_straggler_is_named_from_arrival_times_and_the_answer_is_checked():
    run = bugzoo.run("straggler", show=False)
    named = straggler(run.result)
    assert named["rank"] == 1 and named["last_share"] >= 0.6 and named["cost_per_step_s"] > 0.01
    assert bugzoo.check("straggler", 1).passed
    wrong = bugzoo.check("straggler", 0)
    assert not wrong.passed and "rank 0 is not the one" in wrong.feedback


@launches_ranks
def test_a_hang_ends_within_seconds_with_the_table():
    run = bugzoo.run("rank_branch", timeout_s=2, show=False)
    assert run.error is not None and run.ranks is None
    assert "rank 0: waiting in all_reduce" in run.report and "rank 1: waiting in barrier" in run.report
    with pytest.raises(ValueError, match="nothing to analyse"):
        run.result  # noqa: B018


# -- hangs named from Flight Recorder's dumps --------------------------------------------------------------------
def expected_hang(name: str) -> tuple[str, int, str, int, str]:
    """(kind, rank, op, sequence number, group description) each planted hang must be diagnosed as, worked out
    here from the program's data and constants, not from a run."""
    if name == "skipped_collective":
        has = [[bool((kit.batch(s)[1][r::2] == skipped_collective.WATCHED).any()) for r in range(2)]
               for s in range(skipped_collective.STEPS)]
        step = next(s for s, h in enumerate(has) if h[0] != h[1])  # one rank has the class, the other skips
        return "skipped", has[step].index(False), "all_reduce", 1 + sum(all(h) for h in has[:step]), "metrics"
    if name == "collective_order":  # rank 1 receives the rate before averaging, rank 0 sends it after
        return "order", 1, "broadcast", collective_order.WARMUP + 1, "default_pg"
    if name == "wrong_group":  # the gradients' first all_reduce, on the group rank 1 made first: its "grads"
        return "wrong_group", 1, "all_reduce", 1, "grads"
    huge = max(range(len(stuck_rank.LENGTHS)), key=stuck_rank.LENGTHS.__getitem__)
    rank, step = huge % 2, list(range(huge % 2, len(stuck_rank.LENGTHS), 2)).index(huge) // stuck_rank.BATCH
    return "stuck", rank, "all_reduce", step + 1, "default_pg"  # the step's all_reduce it never reaches


@launches_ranks
@pytest.mark.parametrize("name", HANGS)
def test_a_hang_is_named_from_the_flight_recorder_dumps(name):
    run = bugzoo.run(name, timeout_s=2, show=False)
    assert run.error is not None and sorted(run.flight) == [0, 1]
    found = run.diagnosis
    kind, rank, op, seq, desc = expected_hang(name)
    assert (found.kind, found.rank, found.op, found.seq) == (kind, rank, op, seq), found.text
    assert found.entries[0].group_desc == desc and found.text in run.report
    assert "torch's fr_trace" in run.report
