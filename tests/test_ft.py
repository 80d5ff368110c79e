"""torchft per step (``ft``): replica groups that average every step, lose a group, go on and take it back."""

import sys
import threading

import psutil
import pytest

import dtlab
from dtlab.app import commands
from dtlab.app.cli import main
from dtlab.core.config import RunConfig
from dtlab.core.failures import RankError
from dtlab.launch import lighthouse
from dtlab.launch.contract import LaunchStopped
from dtlab.read import ft as ft_runs
from dtlab.read import recovery as fault_parts
from dtlab.tiers import ft
from dtlab.tiers.parts import ft as replica_groups
from dtlab.train import preflight

BASE = dict(world_size=2, model_size=64, steps=24, threads_per_rank=1, optimizer="adam")
PARAM_BYTES = (64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10) * 4  # the width-64 mlp on digits, fp32


def _cfg(**options):
    return RunConfig(tier="ft", **BASE, tier_options=ft.Options(**options))


@pytest.fixture(scope="module")
def ddp():
    return dtlab.run(RunConfig(tier="ddp", **BASE), progress=False)


# -- bad input: one line, before anything starts ------------------------------------------------
@pytest.mark.parametrize("options,message", [
    (dict(replicas=0), "ft tier_options.replicas=0 is invalid: must be an integer >= 1"),
    (dict(ranks_per_replica=3), "ranks_per_replica=3 does not divide world_size=2"),
    (dict(replicas=1), "replicas=1 x ranks_per_replica=1 must equal world_size=2 (give replicas=2)"),
    (dict(faults=("kill:5:2",)), "replica group 2 does not exist (0..1)"),
    (dict(faults=("kill:24:1",)), "step 24 is beyond the run (steps 0..23)"),
    (dict(faults=("meteor:3:1",)), "KIND one of kill, sigkill, exception"),
    (dict(faults=("kill:3",)), "write KIND:STEP:REPLICA"),
    (dict(min_replicas=3), "min_replicas=3 is invalid: the run has 2 replica groups"),
    (dict(link_mbit=200.0), "link_mbit=200 needs network='netns'"),
    (dict(network="wifi"), "network='wifi' is invalid"),
    (dict(lighthouse_port=-1), "lighthouse_port=-1 is invalid"),
])
def test_bad_ft_input_is_refused_by_the_config(options, message):
    with pytest.raises(ValueError) as caught:
        _cfg(**options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_faults_need_a_peer_to_recover_from():
    with pytest.raises(ValueError, match="faults need replicas >= 2"):
        RunConfig(tier="ft", **{**BASE, "world_size": 1}, tier_options=ft.Options(replicas=1, faults=("kill:3:0",)))


@pytest.fixture
def nothing_runs(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(commands, "run", refuse)


@pytest.mark.parametrize("argv,message", [
    (["--opt", "replicas=0"], "--opt replicas=0: ft tier_options.replicas=0 is invalid"),
    (["--opt", "faults=kill:99:1"], "step 99 is beyond the run"),
    (["--opt", "comm_hook=fp16"], "--opt comm_hook=fp16: tier 'ft' has no option 'comm_hook'"),
])
def test_bad_ft_input_on_the_command_line_is_one_line_and_exit_2(argv, message, capsys, nothing_runs):
    assert main(["run", "--tier", "ft", "--world-size", "2", "--steps", "20", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_without_torchft_the_tier_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    with pytest.raises(ValueError) as caught:
        preflight(_cfg())
    assert str(caught.value) == f"the ft tier needs torchft, which is not installed: {replica_groups.INSTALL}"


def test_a_lighthouse_port_in_use_is_one_line_before_anything_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"lighthouse_port={port}: 127.0.0.1:{port} is already in use"):
            preflight(_cfg(lighthouse_port=port))


@pytest.mark.slow
def test_the_lighthouse_starts_on_loopback_says_a_clash_in_one_line_and_stops(tmp_path):
    with lighthouse.running(log_dir=tmp_path) as first:
        assert first.addr.startswith("http://127.0.0.1:") and first.proc.poll() is None
        with pytest.raises(ValueError) as clash:
            lighthouse.start(port=first.port, log_dir=tmp_path / "..")
        assert str(clash.value).count("\n") == 0 and "is already in use" in str(clash.value)
    assert first.proc.poll() is not None
    # a launcher killed without a word: its end of the pipe closes, and the lighthouse goes with it
    orphan = lighthouse.start(log_dir=tmp_path)
    server = psutil.Process(orphan.proc.pid).children()
    orphan.proc.stdin.close()
    assert orphan.proc.wait(timeout=5) == 0
    psutil.wait_procs(server, timeout=5)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in server)


# -- runs -----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("nothing_left")
def test_without_faults_ft_trains_ddps_parameters_and_records_the_cross_replica_all_reduces(ddp):
    result = dtlab.run(_cfg(), progress=False)
    assert result.max_param_diff(ddp) <= 1e-5
    assert result.ranks[0].strategy["replicas_max_param_diff"] == 0.0
    cross = result.events_frame()
    cross = cross[cross["tag"] == "ft_cross_replica"]
    # the Manager's gloo group is not torch.distributed's: dtlab records its methods (one bucket per step)
    assert len(cross) == 2 * BASE["steps"] and set(cross["bytes"]) == {PARAM_BYTES}
    assert set(cross["group_size"]) == {2}
    assert set(ft_runs.participants(result)) == {2}
    assert ft_runs.missed_steps(result) == {0: [], 1: []}


@pytest.mark.usefixtures("nothing_left")
def test_a_killed_replica_group_rejoins_from_its_peer_and_the_groups_end_equal():
    # Each group's rank sleeps 100 ms a step, so the 15 steps after the fault outlast a restart on a busy
    # machine (unpaced, 20 ms steps ended before the restarted group was back, 7 in 8 runs with 3 CPU hogs).
    result = dtlab.run(_cfg(faults=("kill:8:1",)).replace(slow_rank="0:100ms"), progress=False)
    report = ft_runs.report(result)
    assert report["replicas_equal"] and report["replicas_finished"] == [0, 1]
    (r,) = report["recovery"]
    assert r["replica"] == 1 and r["fault_step"] == 8 and 8 <= r["rejoin_step"] < BASE["steps"]
    # group 0 alone from the fault until the restarted group has healed (at once, or some steps later on
    # a busy machine: it joins the first quorum after it asks); both groups in every other step
    alone = list(range(8, r["rejoin_step"] + 1))
    assert [s for s, n in report["participants"].items() if n == 1] == alone
    assert set(report["participants"].values()) == {1, 2}
    assert report["missed_steps"] == {0: [], 1: alone}
    # 1 when group 0's step-8 all-reduce met the dead group; 0 when group 1 died before asking for that quorum
    assert r["redone_steps"] in (0, 1)
    assert 0 < r["recovery_s"] < 30 and 0 <= r["others_lost_s"] < r["recovery_s"] + 1
    kinds = [e["kind"] for e in result.run_events]
    assert {"lighthouse_start", "replica_failed", "lighthouse_stop"} <= set(kinds)
    # its state came over the Manager's process group, from the live group
    recovery = result.events_frame()
    # torchft's transport calls its group's send/recv methods, which return a Work: non-blocking transfers
    assert set(recovery[recovery["tag"] == "ft_recovery"]["op"]) == {"isend", "irecv"}
    restarted = [r for r in result.ranks if r.strategy["replica"] == 1][0].strategy
    assert restarted["attempt"] == 1 and restarted["healed_at"] == r["rejoin_step"]
    # the fault's parts, read from the events the restarted group emits on its way back, in order
    parts = fault_parts.ft_parts(result)
    assert list(parts["part"]) == ["detection", "quorum", "redone steps", "detection", "restart", "quorum",
                                   "state transfer"]
    assert (parts["seconds"] >= 0).all() and parts["end_s"].max() < 30
    (started,) = [e for e in result.run_events if e["kind"] == "lighthouse_start"]
    assert started["heartbeat_timeout_ms"] == 300  # the tuned timeouts, the default


@pytest.mark.usefixtures("nothing_left")
def test_two_ranks_per_replica_group_still_train_ddps_parameters():
    job = {**BASE, "world_size": 4, "steps": 8}
    ddp4 = dtlab.run(RunConfig(tier="ddp", **job), progress=False)
    result = dtlab.run(RunConfig(tier="ft", **job, tier_options=ft.Options(ranks_per_replica=2)), progress=False)
    assert result.max_param_diff(ddp4) <= 1e-5
    assert [r.rank for r in result.ranks] == [0, 1, 2, 3]
    # every rank of both groups returned its parameters, and the agreement compared all four
    assert all(r.params is not None for r in result.ranks)
    assert result.ranks[0].strategy["replicas_max_param_diff"] == 0.0
    intra = result.events_frame()
    assert (intra["tag"] == "ft_intra_replica").sum() == 4 * 8


@pytest.mark.usefixtures("nothing_left")
def test_a_run_whose_groups_all_fail_raises_and_leaves_nothing_behind():
    with pytest.raises(RankError, match="injected fault"):
        dtlab.run(_cfg(max_restarts=0, faults=("exception:2:0", "exception:2:1")), progress=False)


@pytest.mark.usefixtures("nothing_left")
def test_a_run_that_times_out_waiting_for_a_quorum_leaves_nothing_behind():
    cfg = _cfg(min_replicas=2, max_restarts=0, faults=("kill:3:1",)).replace(timeout_s=3.0)
    with pytest.raises(RankError):
        dtlab.run(cfg, progress=False)


@pytest.mark.usefixtures("nothing_left", "default_sigint")
def test_a_stopped_run_leaves_no_lighthouse_manager_or_rank():
    stop = threading.Event()

    def progress(info):
        if info.get("step", 0) >= 3:
            stop.set()

    with pytest.raises(LaunchStopped):
        dtlab.run(_cfg().replace(steps=400), progress=progress, stop=stop)
