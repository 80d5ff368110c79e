"""Distributed Checkpoint: resharding on load, safe saves, and clear errors for broken checkpoints."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from dtlab import RunConfig
from dtlab.core.results import RunResult
from dtlab.tiers.ddp import Options as DDPOptions
from dtlab.tiers.fsdp import Options
from dtlab.tiers.parts import base, checkpoint
from dtlab.tiers.parts.checkpoint import CheckpointError
from dtlab.train import preflight, run

TOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def job(**changes) -> RunConfig:
    return RunConfig(**{**dict(steps=20, optimizer="adam", lr=0.01, global_batch_size=64, threads_per_rank=1),
                        **changes})


@functools.cache
def uninterrupted():
    return run(job(), progress=False)


def assert_continues(resumed: RunResult, saved_at: int) -> None:
    """The resumed run trains steps saved_at..19 and lands where 20 uninterrupted steps do."""
    ref = uninterrupted()
    curve = resumed.loss_curve()
    assert list(curve.index) == list(range(saved_at, 20))
    assert (curve - ref.loss_curve().loc[curve.index]).abs().max() <= TOL
    assert resumed.max_param_diff(ref) <= TOL


# -- in one process -------------------------------------------------------------------
def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def test_round_trip_restores_model_optimizer_and_step(tmp_path):
    model, optimizer = trained(0)
    checkpoint.save(model, optimizer, 7, tmp_path / "ck")
    other, other_opt = trained(1)
    assert checkpoint.load(other, other_opt, tmp_path / "ck") == 7
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"],
                       other_opt.state[other_opt.param_groups[0]["params"][0]]["exp_avg"])
    assert checkpoint.saved_step(tmp_path / "ck") == 7


def test_a_folder_of_checkpoints_resolves_to_its_latest(tmp_path):
    model, optimizer = trained()
    for step in (5, 10):
        checkpoint.save(model, optimizer, step, checkpoint.step_dir(tmp_path, step))
    (tmp_path / "step-00000015").mkdir()  # no .metadata: never finished, so not a candidate
    assert checkpoint.resolve(tmp_path) == checkpoint.step_dir(tmp_path, 10)
    assert checkpoint.saved_step(tmp_path) == 10


@pytest.mark.parametrize("damage,message", [
    (lambda d: shutil.rmtree(d), "no such directory"),
    (lambda d: (d / ".metadata").unlink(), r"\.metadata is missing \(it holds only __0_0.distcp\)"),
    (lambda d: (d / "__0_0.distcp").unlink(), "incomplete: __0_0.distcp missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b"x"), "corrupt: __0_0.distcp has 1 bytes"),
    (lambda d: (d / ".metadata").write_bytes(b"garbage"), r"\.metadata is unreadable"),
], ids=["no-directory", "no-metadata", "no-shard", "truncated-shard", "garbled-metadata"])
def test_broken_checkpoints_name_what_is_missing(tmp_path, damage, message):
    model, optimizer = trained()
    path = checkpoint.save(model, optimizer, 3, tmp_path / "ck")
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.verify(path)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(model, optimizer, path)


def test_a_checkpoint_of_another_model_is_refused_with_the_reason(tmp_path):
    model, optimizer = trained()
    checkpoint.save(model, optimizer, 1, tmp_path / "ck")
    wider = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(CheckpointError, match=r"does not fit.*Size mismatch.*model\.0\.weight"):
        checkpoint.load(wider, None, tmp_path / "ck")


def test_an_interrupted_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained()
    path = checkpoint.save(model, optimizer, 1, tmp_path / "ck")

    def die_before_metadata(self, *args, **kwargs):
        raise KeyboardInterrupt("killed while saving")  # the shards are written, .metadata is not

    with monkeypatch.context() as patch:
        patch.setattr(FileSystemWriter, "finish", die_before_metadata)
        with pytest.raises(BaseException, match="killed while saving"):
            checkpoint.save(model, optimizer, 2, path)
    assert checkpoint.saved_step(path) == 1  # untouched
    leftover = tmp_path / ".ck.incomplete"
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        checkpoint.verify(leftover)
    checkpoint.save(model, optimizer, 2, path)  # the next save clears the leftover and replaces the old one
    assert checkpoint.saved_step(path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# -- across world sizes ---------------------------------------------------------------------
@pytest.fixture
def resumable_loop():
    if not hasattr(base.Strategy, "start_step"):
        pytest.fail("resuming needs issue 8's changes to dtlab/train.py, dtlab/tiers/parts/base.py and dtlab/memory.py")


@pytest.mark.usefixtures("no_survivors", "resumable_loop")
def test_fsdp_saved_at_two_resumes_at_one_and_four(tmp_path):
    first = run(job(tier="fsdp", world_size=2, steps=10, tier_options=Options(checkpoint_dir=str(tmp_path))),
                progress=False)
    saved = checkpoint.step_dir(tmp_path, 10)
    assert first.ranks[0].strategy["checkpoints"] == [str(saved)]
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # a shard each
    for world in (1, 4):
        resumed = run(job(tier="fsdp", world_size=world, tier_options=Options(resume_from=str(tmp_path))),
                      progress=False)
        assert resumed.ranks[0].strategy["resumed_from_step"] == 10
        assert_continues(resumed, 10)


@pytest.mark.usefixtures("no_survivors", "resumable_loop")
def test_ddp_checkpoint_reshards_into_fsdp(tmp_path):
    saved = run(job(tier="ddp", world_size=2, steps=10, tier_options=DDPOptions(checkpoint_dir=str(tmp_path))),
                progress=False)
    assert saved.ranks[0].strategy["checkpoints"] == [str(checkpoint.step_dir(tmp_path, 10))]
    # DDP saves full tensors (rank 0 writes each replicated tensor once); fsdp loads its slices
    resumed = run(job(tier="fsdp", world_size=4, tier_options=Options(resume_from=str(tmp_path))), progress=False)
    assert_continues(resumed, 10)


def test_resume_from_a_broken_checkpoint_fails_before_launch(tmp_path):
    model, optimizer = trained()
    path = checkpoint.save(model, optimizer, 10, tmp_path / "ck")
    # The job is a valid description; reading the checkpoint is the preflight's work (dtlab.run calls it first).
    with pytest.raises(ValueError, match="nothing is left to train"):
        preflight(job(tier="fsdp", world_size=2, steps=10, tier_options=Options(resume_from=str(path))))
    (path / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"tier_options.resume_from=.*__0_0.distcp missing"):
        preflight(job(tier="fsdp", world_size=2, tier_options=Options(resume_from=str(path))))
