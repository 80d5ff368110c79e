"""ddp_script: wrong scripts fail naming their cause; the reference written with names imported from
torch.distributed passes.

Each script below is the reference with one edit (the edited text must be in the reference, so a change there
cannot silently turn a test into a copy of the reference); each check is one torchrun launch at world size 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtlab import exercises
from dtlab.exercises import _progress

runs_torchrun = pytest.mark.usefixtures("nothing_left")  # (conftest marks these slow)
REFERENCE = Path(exercises.solution("ddp_script")).read_text()


@pytest.fixture(autouse=True)
def progress_log(tmp_path, monkeypatch):
    """Checks record their verdicts in a temporary file, not in the working directory's results/."""
    monkeypatch.setattr(_progress, "PROGRESS_LOG", tmp_path / "progress.jsonl")


def edited(*edits: tuple[str, str]) -> str:
    text = REFERENCE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


PREBOUND = edited(
    ("import torch.distributed as dist\n",
     "from torch.distributed import barrier, destroy_process_group, get_rank, init_process_group\n"),
    ('    dist.init_process_group("gloo")', '    init_process_group("gloo")'),
    ("    rank = dist.get_rank()", "    rank = get_rank()"),
    ("    dist.barrier()", "    barrier()"),
    ("    dist.destroy_process_group()", "    destroy_process_group()"),
)
SAMPLER_NOT_IN_THE_LOADER = edited(  # the files say each rank's share; the loader gives every rank everything
    ("    loader = DataLoader(dataset, batch_size=4, sampler=sampler)",
     "    loader = DataLoader(dataset, batch_size=4, shuffle=True)"))
NO_SAMPLER = edited(  # every rank shuffles the whole data set, and says so
    ("    sampler = DistributedSampler(dataset, shuffle=True, seed=0)", ""),
    ("sampler=sampler)", "shuffle=False)"),
    ("        sampler.set_epoch(epoch)",
     "        torch.manual_seed(epoch)\n        order = torch.randperm(len(dataset))"),
    ("json.dump(list(sampler), f)", "json.dump(order.tolist(), f)"),
    ("        for x, y in loader:",
     "        for x, y in DataLoader(torch.utils.data.Subset(dataset, order), batch_size=4):"))
NO_PROCESS_GROUP = edited(('    dist.init_process_group("gloo")', "    pass"))
DDP_BYPASSED = edited(  # the wrapper is built, but the training steps call the module inside it
    ("    for x, y in loader:\n            optimizer.zero_grad()\n            F.cross_entropy(model(x), y)",
     "    for x, y in loader:\n            optimizer.zero_grad()\n            F.cross_entropy(model.module(x), y)"))
SAVED_BY_EVERY_RANK = edited(("    if rank == 0:  # the replicas are identical: one copy is enough\n        torch.save",
                              "    if True:\n        torch.save"))
NO_BARRIER = edited(("    dist.barrier()  # no rank goes on (or reads model.pt) before it is written\n", ""))


@runs_torchrun
@pytest.mark.parametrize("script,says", [
    (SAMPLER_NOT_IN_THE_LOADER, ("rank 0's model trained on all 48 samples in every epoch, although it wrote only 48 "
                                 "indices", "give the DataLoader the DistributedSampler")),
    (NO_SAMPLER, ("rank 0's model trained on all 48 samples in every epoch:", "each rank trains on its own 1/2")),
    (NO_PROCESS_GROUP, ("'s script raised ValueError at line", "Default process group has not been initialized, "
                        "please make sure to call init_process_group")),
    (DDP_BYPASSED, ("rank 0 built a DistributedDataParallel but never ran a forward pass through it",
                    "not the module inside it")),
    (SAVED_BY_EVERY_RANK, ("rank 1 saved model.pt too", "save on rank 0 only")),
    (NO_BARRIER, ("did not wait at a dist.barrier()",)),
], ids=["sampler_not_in_the_loader", "no_sampler", "no_process_group", "ddp_bypassed", "saved_by_every_rank",
        "no_barrier"])
def test_a_wrong_script_fails_naming_its_cause(tmp_path, script, says):
    path = tmp_path / "my_script.py"
    path.write_text(script)
    result = exercises.check("ddp_script", path)
    assert not result.passed and result.feedback.startswith("World size 2: "), result.feedback
    for words in says:
        assert words in result.feedback, result.feedback


@runs_torchrun
def test_the_reference_with_names_imported_from_torch_distributed_passes(tmp_path):
    path = tmp_path / "my_script.py"
    path.write_text(PREBOUND)
    result = exercises.check("ddp_script", path)
    assert result.passed, result.feedback
    assert "each rank's model trained on exactly the samples it wrote" in result.feedback
