"""A shared server: an instructor's cap on every run's ranks (DTLAB_MAX_WORLD_SIZE), and learners running at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dtlab
from dtlab.app import cli
from dtlab.app.history import new_run_folder
from dtlab.core.config import MAX_WORLD_SIZE_ENV, RunConfig, check_world_cap, shared_threads
from dtlab.launch import lifeline, local
from dtlab.launch.ft import launch_ft
from dtlab.launch.rpc import launch_rpc
from dtlab.launch.torchrun import Node, launch_torchrun

REPO = Path(dtlab.__file__).resolve().parents[1]


def noop(*_args):
    return None


@pytest.fixture
def nothing_starts(monkeypatch):
    """Every launcher's first step (a forkserver context, a temporary folder) fails the test."""
    def started(*_args, **_kwargs):
        raise AssertionError("a launch got as far as starting something")

    monkeypatch.setattr(local, "context", started)
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


# -- several learners at once ----------------------------------------------------------------------------------------
LEARNERS = {  # tier -> extra flags: one learner each, all started together
    "ddp": ["--flight-recorder"],
    "elastic": ["--flight-recorder"],
    "multinode": [],  # simulated hosts as root, loopback nodes otherwise
    "ft": [],
}


@pytest.mark.slow
def test_learners_running_at_once_each_get_their_own_results_and_leave_nothing(tmp_path):
    """Four users (their own HOME, working folder and TMPDIR) start a run each at the same moment."""
    procs = {}
    for tier, flags in LEARNERS.items():
        home = tmp_path / tier
        for sub in ("work", "tmp"):
            (home / sub).mkdir(parents=True)
        env = {**os.environ, "HOME": str(home), "TMPDIR": str(home / "tmp"), "PYTHONPATH": str(REPO)}
        argv = [sys.executable, "-m", "dtlab", "run", "--tier", tier, "--world-size", "2", "--steps", "8",
                "--model-size", "32", "--threads", "1", "--quiet", *flags]
        log = open(home / "log.txt", "wb")  # noqa: SIM115 - closed below, once the run ends
        procs[tier] = (subprocess.Popen(argv, cwd=home / "work", env=env, stdout=log, stderr=subprocess.STDOUT), log)
    for tier, (proc, log) in procs.items():
        code = proc.wait(600)
        log.close()
        assert code == 0, f"{tier}: exit {code}\n{(tmp_path / tier / 'log.txt').read_text()[-3000:]}"
    for tier, flags in LEARNERS.items():
        home = tmp_path / tier
        summary = json.loads((home / "work" / "results" / "run" / "result.json").read_text())
        assert (summary["tier"], summary["world_size"]) == (tier, 2)
        dumps = sorted(p.name for p in (home / "work" / "results" / "run" / "flight_recorder").glob("rank_*"))
        assert dumps == (["rank_0", "rank_1"] if flags else [])  # each run's own, in its own folder
        assert sorted(p.name for p in (home / "tmp").glob("dtlab-*")) == []
