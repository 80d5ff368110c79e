"""RPC: the parameter server (sync parity, async staleness), REINFORCE over RPC, recording, binding, errors."""

from __future__ import annotations

import functools
import socket
import time

import psutil
import pytest
import torch
from torch.distributed import rpc

from dtlab import RankError
from dtlab.app import rl
from dtlab.core.net import listening_sockets
from dtlab.instrument.rpc import events_frame
from dtlab.launch.rpc import launch_rpc
from dtlab.read.rpc import call_matrix, staleness_frame
from dtlab.tiers.rpc import Options
from dtlab.train import preflight, run
from tests.parity import TOL, job, single

pytestmark = pytest.mark.usefixtures("no_survivors")


@functools.cache
def ps(optimizer: str, mode: str = "sync"):
    return run(job(optimizer, tier="rpc", world_size=2, tier_options=Options(mode=mode)), progress=False)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_parameter_server_matches_single(optimizer):
    result = ps(optimizer)
    assert result.max_param_diff(single(optimizer)) <= TOL
    strategy = result.ranks[0].strategy
    assert strategy["updates"] == 20  # one averaged step per global batch
    assert set(staleness_frame(result)["staleness"]) == {0}
    assert len(result.loss_curve()) == 20 and result.loss_curve().iloc[-1] < result.loss_curve().iloc[0]


def test_async_applies_every_gradient_and_records_staleness():
    result = ps("sgd", "async")
    st = staleness_frame(result)
    assert result.ranks[0].strategy["updates"] == len(st) == 2 * 20  # each trainer's gradient, on arrival
    assert sorted(st["applied_version"]) == list(range(40))
    assert (st["staleness"] >= 0).all() and (st["staleness"] == st["applied_version"] - st["read_version"]).all()
    assert result.final_loss() < result.loss_curve().iloc[0]


def test_every_call_is_recorded_with_bytes_and_latency(tmp_path):
    result = ps("sgd")
    df = events_frame(result)
    fwd = df[(df["op"] == "rpc_sync") & (df["tag"] == "_forward")]
    assert len(fwd) == 2 * 20 and set(fwd["caller"]) == {"trainer1", "trainer2"} and set(fwd["peer"]) == {"ps"}
    x_bytes, logits_bytes = 32 * 64 * 4, 32 * 10 * 4  # a trainer's half batch of digits, and its logits
    assert (fwd["bytes"] >= x_bytes).all() and (fwd["response_bytes"] == logits_bytes).all()
    assert (fwd["duration_s"] > 0).all()
    assert set(df["op"]) >= {"rpc_sync", "rpc_async", "remote"}
    steps = df[(df["op"] == "rpc_async") & (df["tag"] == "_local_optimizer_step")]  # DistributedOptimizer.step
    assert len(steps) == 2 * 20
    matrix = call_matrix(df)
    assert matrix.loc["trainer1", "ps"] == matrix.loc["trainer2", "ps"] > 3 * 20
    out = result.save(tmp_path)  # the shared RunResult machinery works for this tier
    assert (out / "result.json").exists() and (out / "params.pt").exists()
    assert result.summary()["processes"] == 3


def test_rpc_listens_on_loopback_only():
    for rank in ps("sgd").ranks:
        listening = rank.strategy["listening"]
        assert listening and all(s.startswith("127.0.0.1:") for s in listening), listening


def _listening(worker):
    return listening_sockets()


def test_non_loopback_bind_only_when_asked_and_warned():
    ours = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    other = sorted(a for a in ours if not a.startswith("127."))
    if not other:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.warns(UserWarning, match="deserialises"):
        out = launch_rpc(_listening, ["a", "b"], bind_address=other[0], progress=False)
    assert all(any(s.startswith(other[0] + ":") for s in sockets) for sockets in out)


def test_bad_options_fail_before_any_process():
    with pytest.raises(ValueError, match="mode"):
        job("sgd", tier="rpc", world_size=2, tier_options=Options(mode="hogwild"))
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        job("sgd", tier="rpc", world_size=2, tier_options=Options(rpc_timeout_s=0))
    with pytest.raises(ValueError, match="bind_address"):  # an address of no interface here: the preflight's call
        preflight(job("sgd", tier="rpc", world_size=2, tier_options=Options(bind_address="203.0.113.77")))
    with pytest.raises(ValueError, match="world_size"):
        job("sgd", tier="rpc", world_size=9, global_batch_size=72)
    with pytest.raises(ValueError, match="names"):
        launch_rpc(_listening, ["a", "a"])


def _call_nobody(worker):
    if worker.name == "a":
        rpc.rpc_sync("nobody", torch.add, args=(torch.ones(1), 1))


def test_unknown_worker_name_is_a_clear_error():
    with pytest.raises(RankError, match="unknown RPC worker 'nobody'.*a, b") as info:
        launch_rpc(_call_nobody, ["a", "b"], progress=False)
    assert info.value.rank == 0


def _slow_call(worker):
    if worker.name == "a":
        rpc.rpc_sync("b", time.sleep, args=(3.0,))


def test_rpc_timeout_is_a_clear_error():
    start = time.perf_counter()
    with pytest.raises(RankError, match=r"rpc_sync a -> b \(sleep\) timed out.*rpc_timeout_s=0.5") as info:
        launch_rpc(_slow_call, ["a", "b"], rpc_timeout_s=0.5, progress=False)
    assert info.value.rank == 0 and time.perf_counter() - start < 20


def _fail_in_b(worker):
    if worker.name == "b":
        raise ValueError("b refuses")
    rpc.rpc_sync("b", torch.add, args=(torch.ones(1), 1))  # b may be gone: any error here is a consequence


def test_failing_worker_is_named():
    with pytest.raises(RankError, match="b refuses") as info:
        launch_rpc(_fail_in_b, ["a", "b"], progress=False)
    assert info.value.rank == 1


def test_reinforce_over_rpc_learns():
    result = rl.train(rl.ReinforceConfig(observers=2, iterations=50, seed=0), progress=False)
    assert len(result.rewards) == 100
    assert result.last_mean(20) >= 3 * result.random_reward, (result.last_mean(20), result.random_reward)
    matrix = result.call_matrix()
    assert matrix.loc["observer1", "agent"] > 0 and matrix.loc["agent", "observer2"] > 0
    assert all(s.startswith("127.0.0.1:") for sockets in result.listening.values() for s in sockets)
