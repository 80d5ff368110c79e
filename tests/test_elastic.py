"""Elastic DDP under torchrun: faults, restarts from snapshots, a node joining, and nothing lost."""

import os

import psutil
import pytest
import torch

import dtlab
from dtlab.core.config import RunConfig
from dtlab.core.failures import RankError
from dtlab.read import elastic as elastic_runs
from dtlab.tiers import elastic
from dtlab.train import preflight

pytestmark = pytest.mark.usefixtures("nothing_left")
BASE = dict(world_size=2, model_size=64, steps=20, threads_per_rank=1, optimizer="adam")


def _cfg(**options):
    return RunConfig(tier="elastic", **BASE, tier_options=elastic.Options(**options))


def _kinds(result):
    return [e["kind"] for e in result.run_events]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def uninterrupted(snapshots):
    return dtlab.run(_cfg(snapshot_dir=str(snapshots)), progress=False)


def test_uninterrupted_elastic_run_matches_single(uninterrupted):
    single = dtlab.run(RunConfig(tier="single", **{**BASE, "world_size": 1}), progress=False)
    assert uninterrupted.max_param_diff(single) <= 1e-5
    assert "fault" not in _kinds(uninterrupted)
    assert [e["step"] for e in uninterrupted.run_events if e["kind"] == "snapshot"] == [5, 10, 15, 20]


def test_repeated_faults_restart_reliably_and_bitwise(uninterrupted):
    # Three faults in one run, on different ranks, a raised exception between two kills: each attempt must
    # re-rendezvous and resume from the last snapshot.
    result = dtlab.run(_cfg(faults=("sigkill:3:1", "exception:8:0", "sigkill:13:1")), progress=False)
    assert result.max_param_diff(uninterrupted) == 0.0
    assert [e["step"] for e in result.run_events if e["kind"] == "fault"] == [3, 8, 13]
    assert sorted({e["attempt"] for e in result.run_events if e["kind"] == "worker_start"}) == [0, 1, 2, 3]
    assert [e["step"] for e in result.run_events if e["kind"] == "resume" and e["rank"] == 0] == [5, 10]
    errors = [e for e in result.run_events if e["kind"] == "worker_error" and e["rank"] == 0]
    assert [e["message"] for e in errors if "injected" in e["message"]] == [
        "injected fault 1: exception on rank 0 at step 8"]


def test_simulated_oom_halves_the_micro_batch_and_keeps_the_training(uninterrupted):
    result = dtlab.run(_cfg(faults=("oom:6:1",)), progress=False)
    assert result.max_param_diff(uninterrupted) <= 1e-6
    assert {r.strategy["accumulation_steps"] for r in result.ranks} == {2}
    resumed = [e for e in result.run_events if e["kind"] == "resume"]
    assert {e["accumulation_steps"] for e in resumed} == {2}
    assert "oom_answer" in _kinds(result)


def test_failure_beyond_max_restarts_is_reported_and_leaves_no_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RankError, match="injected fault 1"):
        dtlab.run(_cfg(max_restarts=1, faults=("exception:3:1", "exception:4:1")), progress=False)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_snapshot_is_atomic_and_loads_with_weights_only(uninterrupted, snapshots):
    snap = torch.load(snapshots / elastic.SNAPSHOT, weights_only=True)
    assert snap["step"] == 20 and {"model", "optimizer", "rng", "sampler"} <= set(snap)
    assert not list(snapshots.glob("*.tmp"))
    assert uninterrupted.ranks[0].strategy["snapshots"] == [5, 10, 15, 20]


def test_bad_elastic_input_fails_before_start(tmp_path):
    with pytest.raises(ValueError, match="min 2 > max 1"):
        _cfg(nnodes="2:1")
    with pytest.raises(ValueError, match="max_restarts=-1"):
        _cfg(max_restarts=-1)
    with pytest.raises(ValueError, match="step 20 is beyond the run"):
        _cfg(faults=("sigkill:20:1",))
    with pytest.raises(ValueError, match="KIND one of"):
        _cfg(faults=("meteor:3:1",))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # files and folders are the preflight's to look at (dtlab.run calls it before any process starts)
    with pytest.raises(ValueError, match="is not writable"):
        preflight(_cfg(snapshot_dir=str(blocker / "snapshots")))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / elastic.SNAPSHOT).write_bytes(b"not a snapshot")
    with pytest.raises(ValueError, match=f"snapshot {corrupt / elastic.SNAPSHOT} is corrupt"):
        preflight(_cfg(snapshot_dir=str(corrupt)))
    with pytest.raises(ValueError, match="join_at_step"):
        _cfg(nnodes="1:2")


def test_timeline_frame_orders_the_events(uninterrupted):
    df = elastic_runs.timeline(uninterrupted)
    assert df["t_s"].is_monotonic_increasing and df["t_s"].iloc[0] == 0
    assert {"kind", "rank", "attempt", "step"} <= set(df.columns)
    assert os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") is None  # set for the agents only


def test_sigkill_at_world_size_4_resumes_from_dcp_snapshots_and_loses_nothing(tmp_path):
    job = {**BASE, "world_size": 4, "steps": 10, "global_batch_size": 64}
    clean = dtlab.run(RunConfig(tier="elastic", **job, tier_options=elastic.Options()), progress=False)
    dcp = elastic.Options(faults=("sigkill:7:2",), snapshot_format="dcp", snapshot_dir=str(tmp_path))
    killed = dtlab.run(RunConfig(tier="elastic", **job, tier_options=dcp), progress=False)
    assert killed.max_param_diff(clean) <= 1e-6  # DCP's snapshot against the clean run's torch.save ones
    assert (tmp_path / "step-00000005" / ".metadata").exists()
    assert [e["step"] for e in killed.run_events if e["kind"] == "resume" and e["rank"] == 0] == [5]
    assert len(killed.ranks) == 4


def test_a_node_joins_the_world_grows_and_dcp_snapshots_reshard_to_it(tmp_path):
    # One run for both: the join (one rendezvous, the first agent surviving it) and the DCP snapshot the world
    # of 1 saved at step 8, loaded by the world of 2.
    single = dtlab.run(RunConfig(tier="single", **{**BASE, "world_size": 1, "steps": 16}), progress=False)
    options = elastic.Options(nnodes="1:2", join_at_step=8, snapshot_format="dcp", snapshot_dir=str(tmp_path))
    result = dtlab.run(RunConfig(tier="elastic", **{**BASE, "steps": 16}, tier_options=options), progress=False)
    assert result.max_param_diff(single) <= 1e-5
    assert len(result.ranks) == 2
    starts = [e for e in result.run_events if e["kind"] == "worker_start"]
    assert [e["world_size"] for e in starts if e["node"] == 0] == [1, 2]
    nodes = [e for e in result.run_events if e["kind"] == "node_start"]
    assert len({e["rdzv_id"] for e in nodes}) == 1  # one job, one rendezvous: a real join
    # The first node's agent survived the join: both of its workers are its children.
    assert {e["agent_pid"] for e in starts if e["node"] == 0} == {nodes[0]["agent_pid"]}
    assert (tmp_path / "step-00000008" / ".metadata").exists()
    resumed = [e for e in result.run_events if e["kind"] == "resume"]
    assert {e["world_size"] for e in resumed} == {2} and {e["step"] for e in resumed} == {8}
    assert [e["step"] for e in resumed if e["rank"] == 0] == [8]
