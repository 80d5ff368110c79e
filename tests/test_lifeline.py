"""Nothing outlives its kernel: a parent killed mid-run (SIGKILL, SIGTERM) leaves no process, namespace or folder.

Each parent is a fresh Python process that runs ``dtlab.run`` with an environment marker, its own TMPDIR and
its own working folder; every process it starts inherits the marker, so the test finds the run's processes
anywhere on the machine (orphans are nobody's descendants) and nobody else's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

import dtlab
from dtlab.app import cli
from dtlab.core.failures import RankError
from dtlab.launch import lifeline, netns
from dtlab.launch.ft import launch_ft
from dtlab.launch.rpc import launch_rpc
from dtlab.launch.torchrun import Node, launch_torchrun

REPO = Path(dtlab.__file__).resolve().parents[1]
STEP_TIMEOUT_S = 240.0  # starting torch in every process on a busy machine: generous, and left as soon as it steps
GONE_WITHIN_S = 10.0
ROOT = os.geteuid() == 0

PARENT = textwrap.dedent("""
    import dtlab
    from dtlab import RunConfig
    from dtlab.tiers import {tier_module}

    def show(info):
        print("step", info.get("step"), flush=True)

    options = {tier_module}.Options({options})
    dtlab.run(RunConfig(tier={tier!r}, world_size=2, steps=100000, model_size=32, threads_per_rank=1,
                        tier_options=options), progress=show)
""")
TIERS = {  # tier -> (module, options): one per launcher
    "ddp": ("ddp", ""),  # dtlab's forkserver launcher
    "elastic": ("elastic", ""),  # torchrun: an agent and its workers
    "multinode": ("multinode", "network='netns'"),  # torchrun agents inside network namespaces
    "ft": ("ft", ""),  # replica groups around torchft's lighthouse
    "rpc": ("rpc", ""),  # named RPC workers
}


def marked(marker: str) -> list[psutil.Process]:
    """Every live process (not a zombie) whose environment holds the marker."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("DTLAB_TEST_RUN") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            continue
    return out


def leftovers(parent: int, marker: str, tmpdir: Path) -> dict[str, list[str]]:
    left = {"processes": describe(marked(marker)), "folders": sorted(p.name for p in tmpdir.glob("dtlab-*"))}
    if ROOT:
        left["namespaces"] = [n for n in netns.leftovers() if n.startswith(f"{netns.PREFIX}{parent}-")]
    return {k: v for k, v in left.items() if v}


def start_parent(tier: str, tmp_path: Path) -> tuple[subprocess.Popen, str, Path, Path]:
    module, options = TIERS[tier]
    marker, tmpdir, work = uuid.uuid4().hex, tmp_path / "tmp", tmp_path / "work"
    tmpdir.mkdir(parents=True)
    work.mkdir()
    out = tmp_path / "parent.log"
    env = {**os.environ, "DTLAB_TEST_RUN": marker, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO),
           "PYTHONUNBUFFERED": "1"}
    code = PARENT.format(tier=tier, tier_module=module, options=options)
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, marker, tmpdir, out


def wait_for_steps(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while "step" not in out.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the parent never stepped (exit {proc.poll()}):\n{out.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("tier", list(TIERS))
def test_a_parent_killed_mid_run_leaves_nothing(tier, tmp_path):
    """Two parents run the tier side by side; one is killed by SIGKILL, the other by SIGTERM."""
    if tier == "multinode" and not netns.available()[0]:
        pytest.skip(netns.available()[1])
    signals = (signal.SIGKILL, signal.SIGTERM)
    parents = {sig: start_parent(tier, tmp_path / sig.name) for sig in signals}
    try:
        for proc, marker, _, out in parents.values():
            wait_for_steps(proc, out)
            assert marked(marker), "the test cannot see the run's processes"
        for sig, (proc, *_) in parents.items():
            os.kill(proc.pid, sig)
        for proc, *_ in parents.values():
            proc.wait(10)
        killed_at = time.monotonic()
        for sig, (proc, marker, tmpdir, _) in parents.items():
            while (left := leftovers(proc.pid, marker, tmpdir)) and time.monotonic() - killed_at < GONE_WITHIN_S:
                time.sleep(0.2)
            assert not left, f"{GONE_WITHIN_S:g} s after the parent's {sig.name}, left behind: {left}"
            print(f"{tier}: nothing left {time.monotonic() - killed_at:.2f} s after the parent's {sig.name}")
    finally:  # whatever happened: nothing of this test stays on the machine
        for proc, marker, *_ in parents.values():
            proc.kill()
            proc.wait()
            for p in marked(marker):
                p.kill()
        if ROOT:
            netns.remove_stale()


# -- a killed agent, the reaper on its own ---------------------------------------------------------------------------
def sleeps_forever(info):
    dtlab.report(step=1, total=1)
    time.sleep(600)


@pytest.mark.slow
def test_a_killed_torchrun_agent_takes_its_workers_with_it():
    """torchrun's workers run in sessions of their own: only their parent-death signal ends them with their agent."""
    marker, killed = uuid.uuid4().hex, []

    def kill_the_agent(info):
        agent = next(p for p in marked(marker) if "torch.distributed.run" in " ".join(p.cmdline()))
        killed.append(len([p for p in marked(marker) if "dtlab.launch.worker" in " ".join(p.cmdline())]))
        agent.kill()

    with pytest.raises(RankError):
        launch_torchrun(sleeps_forever, 2, progress=kill_the_agent, env={"DTLAB_TEST_RUN": marker})
    deadline = time.monotonic() + 5
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = describe(marked(marker))
    for p in marked(marker):
        p.kill()
    assert killed and killed[0] >= 1, "the agent was killed before its workers were seen"
    assert not left, f"workers outlived their agent: {left}"
    assert lifeline.reaper_pid() is None  # nothing stays registered once the launch has ended


REAPED = textwrap.dedent("""
    import importlib.util, subprocess, sys, time
    spec = importlib.util.spec_from_file_location("lifeline", {path!r})
    lifeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifeline)
    gone, kept = lifeline.temporary_folder("dtlab-test-"), lifeline.temporary_folder("dtlab-kept-")
    (gone / "inside").mkdir()
    lifeline.forget("folder", str(kept))  # the caller keeps this one
    child = subprocess.Popen(lifeline.dying_with_parent(["sleep", "300"]))
    group = subprocess.Popen(["sh", "-c", "sleep 301 & wait"], start_new_session=True)
    lifeline.watch_process(group.pid)
    print(gone, kept, child.pid, group.pid, lifeline.reaper_pid(), flush=True)
    time.sleep(300)
""")


@pytest.mark.slow
def test_the_reaper_removes_what_a_killed_process_registered_and_nothing_else(tmp_path):
    out = tmp_path / "out.txt"
    code = REAPED.format(path=lifeline.__file__)
    with open(out, "w") as f:
        parent = subprocess.Popen([sys.executable, "-c", code], stdout=f, env={**os.environ, "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    gone, kept, *pids = out.read_text().split()
    family = [psutil.Process(int(p)) for p in pids] + psutil.Process(int(pids[1])).children()
    assert len(family) == 4 and all(p.is_running() for p in family)
    parent.kill()
    parent.wait()
    _, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, f"still running after their parent's SIGKILL: {describe(alive)}"
    assert not Path(gone).exists() and Path(kept).is_dir()


def test_stale_folders_are_only_this_users_folders_of_dead_processes(tmp_path):
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    stale = tmp_path / f"dtlab-launch-{dead}-ab_3defg"
    live = tmp_path / f"dtlab-torchrun-{os.getpid()}-abcdefgh"
    other = tmp_path / f"dtlab-cluster-{dead}"  # a notebook's own folder: not named like a run's
    for path in (stale, live, other):
        path.mkdir()
    assert lifeline.stale_folders(tmp_path) == [stale]
    assert lifeline.sweep_folders(tmp_path) == [stale]
    assert not stale.exists() and live.is_dir() and other.is_dir()


def test_dtlab_clean_removes_the_folders_of_dead_runs_and_says_what_it_did_not_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(netns, "available", lambda: (False, "simulated hosts need root"))
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    stale, live = tmp_path / f"dtlab-elastic-{dead}-abcdefgh", tmp_path / f"dtlab-launch-{os.getpid()}-abcdefgh"
    stale.mkdir()
    live.mkdir()
    assert cli.main(["clean"]) == 0
    out = capsys.readouterr().out
    assert f"removed {stale}\n" in out and "1 left-over(s) removed" in out
    assert "network namespaces not checked: simulated hosts need root" in out
    assert not stale.exists() and live.is_dir()


def test_the_reaper_refuses_what_it_cannot_remove():
    with pytest.raises(ValueError, match="kind='file' is invalid"):
        lifeline.watch("file", "/tmp/x")


# -- temporary folders: gone after each launcher's normal and failed runs -------------------------------------------
def rank_value(info, *args):
    return info.rank


def rank_one_fails(info, *args):
    if info.rank == 1:
        raise ValueError("rank one fails")
    dist.barrier()


def every_group_fails(info):
    raise ValueError("this replica group fails")  # each ft group is a world of one rank: rank 0


def rpc_value(worker):
    return worker.name


def rpc_fails(worker):
    if worker.rank == 1:
        raise ValueError("worker one fails")
    return worker.name


def _on_hosts(fn, **kwargs):
    with netns.SimulatedHosts(2) as hosts:
        return launch_torchrun(fn, 1, nodes=[Node(h.addr, h.ifname, h.netns) for h in hosts], **kwargs)


LAUNCHERS = {  # launcher -> (a run that succeeds, one that fails)
    "forkserver": lambda ok: dtlab.launch(rank_value if ok else rank_one_fails, 2, progress=False,
                                          flight_recorder=True),
    "torchrun": lambda ok: launch_torchrun(rank_value if ok else rank_one_fails, 2, progress=False,
                                           flight_recorder=True),
    "multinode": lambda ok: _on_hosts(rank_value if ok else rank_one_fails, progress=False),
    "ft": lambda ok: launch_ft(rank_value if ok else every_group_fails, 2, 1, max_restarts=0, progress=False),
    "rpc": lambda ok: launch_rpc(rpc_value if ok else rpc_fails, ["a", "b"], progress=False),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_no_temporary_folder_stays_after_a_normal_or_a_failed_run(launcher, tmp_path, monkeypatch, no_survivors):
    if launcher == "multinode" and not netns.available()[0]:
        pytest.skip(netns.available()[1])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's launchers
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # and what they start
    assert len(LAUNCHERS[launcher](True)) == 2
    assert sorted(p.name for p in tmp_path.glob("dtlab-*")) == []
    with pytest.raises(RankError, match="fails"):
        LAUNCHERS[launcher](False)
    assert sorted(p.name for p in tmp_path.glob("dtlab-*")) == []
    assert lifeline.reaper_pid() is None  # nothing stays registered


def test_a_scratch_folder_name_is_checked_before_anything_is_made():
    with pytest.raises(ValueError, match="name='My Folder' is invalid: lower-case letters"):
        dtlab.scratch_folder("My Folder")


@pytest.mark.slow
def test_a_scratch_folder_lives_as_long_as_its_process_however_that_ends(tmp_path):
    code = ("import sys, time, dtlab; print(dtlab.scratch_folder('notes'), flush=True); "
            "sys.argv[1] == 'exit' or time.sleep(300)")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    for how in ("exit", "sigkill"):
        parent = subprocess.Popen([sys.executable, "-c", code, how], stdout=subprocess.PIPE, text=True, env=env)
        folder = Path(parent.stdout.readline().strip())
        assert folder.is_dir() and folder.name.startswith(f"dtlab-notes-{parent.pid}-")
        if how == "sigkill":
            parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not folder.exists(), f"{folder} outlived its process ({how})"
