"""A shared server: an instructor's cap on the ranks of every run (DTLAB_MAX_WORLD_SIZE), refused before any start."""

from __future__ import annotations

import pytest

import dtlab
from dtlab.app import cli
from dtlab.app.history import new_run_folder
from dtlab.core.config import MAX_WORLD_SIZE_ENV, RunConfig, check_world_cap, shared_threads
from dtlab.launch import lifeline, local
from dtlab.launch.ft import launch_ft
from dtlab.launch.rpc import launch_rpc
from dtlab.launch.torchrun import Node, launch_torchrun


def noop(*_args):
    return None


@pytest.fixture
def nothing_starts(monkeypatch):
    """Every launcher's first step (a forkserver context, a temporary folder) fails the test."""
    def started(*_args, **_kwargs):
        raise AssertionError("a launch got as far as starting something")

    monkeypatch.setattr(local, "_context", started)
    monkeypatch.setattr(lifeline, "temporary_folder", started)


@pytest.mark.parametrize("start,message", [
    (lambda: dtlab.launch(noop, 3), "world_size=3 is over"),
    (lambda: launch_torchrun(noop, 2, nodes=[Node(), Node()]), "nproc_per_node x nodes=4 is over"),
    (lambda: launch_ft(noop, 3, 1), "replicas x ranks_per_replica=3 is over"),
    (lambda: launch_rpc(noop, ["ps", "trainer0", "trainer1"]), "RPC workers=3 is over"),
    (lambda: dtlab.run(RunConfig(tier="ddp", world_size=4)), "RunConfig.world_size=4 is over"),
    (lambda: dtlab.run(RunConfig(tier="elastic", world_size=4)), "RunConfig.world_size=4 is over"),
])
def test_a_run_over_the_cap_is_refused_in_one_line_naming_the_variable(start, message, monkeypatch, nothing_starts):
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, "2")
    with pytest.raises(ValueError, match=message) as info:
        start()
    assert f"limit {MAX_WORLD_SIZE_ENV}=2" in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_says_it_in_one_line_and_exits_2(monkeypatch, capsys, nothing_starts):
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, "2")
    assert cli.main(["run", "--tier", "ddp", "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{MAX_WORLD_SIZE_ENV}=2" in err and "world_size=4" in err


@pytest.mark.parametrize("raw", ["0", "two", "-1", "1.5"])
def test_a_bad_cap_is_an_error_naming_the_variable(raw, monkeypatch):
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, raw)
    with pytest.raises(ValueError, match=f"{MAX_WORLD_SIZE_ENV}='{raw}' is invalid: must be an integer >= 1"):
        check_world_cap(1)


@pytest.mark.parametrize("raw", ["", "  ", "4"])
def test_no_cap_or_a_run_within_it_passes(raw, monkeypatch):
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, raw)
    check_world_cap(4)  # raises nothing


def test_threads_are_shared_out_among_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the machine's, shared with every other learner
    assert (shared_threads(2), shared_threads(3), shared_threads(8)) == (2, 1, 1)


def test_two_kernels_saving_the_same_run_in_the_same_second_get_two_folders(tmp_path):
    name = "20250101-120000-ddp-w2"
    first, second = new_run_folder(tmp_path, name), new_run_folder(tmp_path, name)
    assert (first.name, second.name) == (name, f"{name}-2")
    assert first.is_dir() and second.is_dir()
