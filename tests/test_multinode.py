"""Multi-node DDP: torchrun agents as nodes, on loopback and as simulated hosts with capped links."""

import os

import pytest

import dtlab
from dtlab.core.config import RunConfig
from dtlab.core.failures import RankError
from dtlab.launch import netns
from dtlab.launch.torchrun import Node, launch_torchrun
from dtlab.tiers import multinode
from dtlab.train import preflight
from dtlab.train.runner import resolve_network

from .parity import TOL as TOLERANCE

pytestmark = pytest.mark.usefixtures("nothing_left")
ROOT = os.geteuid() == 0
BASE = dict(world_size=2, model_size=256, steps=20, threads_per_rank=1, optimizer="sgd")


def _cfg(**options):
    return RunConfig(tier="multinode", **BASE, tier_options=multinode.Options(nnodes=2, **options))


def _namespaces_required():
    if not ROOT:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: the namespace tests must run there")
        pytest.skip("simulated hosts need root")


@pytest.fixture(scope="module")
def single():
    return dtlab.run(RunConfig(tier="single", **{**BASE, "world_size": 1}), progress=False)


def test_loopback_nodes_give_global_and_local_ranks_and_match_single(single):
    result = dtlab.run(_cfg(network="loopback"), progress=False)
    where = sorted((r.strategy["global_rank"], r.strategy["node"], r.strategy["local_rank"]) for r in result.ranks)
    assert where == [(0, 0, 0), (1, 1, 0)]
    assert result.max_param_diff(single) <= TOLERANCE
    assert {e["kind"] for e in result.run_events} >= {"node_start", "worker_start", "process_group_ready"}


def test_slow_link_makes_the_ddp_step_slower(single):
    _namespaces_required()
    fast = dtlab.run(_cfg(network="netns", link_mbit=10_000), progress=False)
    slow = dtlab.run(_cfg(network="netns", link_mbit=200), progress=False)
    assert [r.strategy["addr"] for r in slow.ranks] == ["10.213.0.1", "10.213.0.2"]
    assert all(r.strategy["network"] == "netns" for r in slow.ranks)
    # 85k float gradients = 340 KB per step: ~14 ms on the wire at 200 Mbit/s, well under 1 ms at 10 Gbit/s.
    # DDP overlaps part of it with the backward, so a step is longer by less than that (7 ms measured); a
    # third of the wire time is still far above a step's jitter here
    wire_s = sum(t.numel() * t.element_size() for t in slow.params().values()) * 8 / 200e6
    assert slow.median_step_s() - fast.median_step_s() > wire_s / 3, (slow.median_step_s(), fast.median_step_s())
    assert slow.max_param_diff(single) <= TOLERANCE
    assert netns.leftovers() == []


def ranks_fail(info):
    raise ValueError(f"rank {info.rank} fails inside its namespace")


def test_failure_in_namespaces_leaves_nothing_behind():
    _namespaces_required()
    with pytest.raises(RankError, match="fails inside its namespace"):
        with netns.SimulatedHosts(2, link_mbit=1000) as hosts:
            launch_torchrun(ranks_fail, 1, nodes=[Node(h.addr, h.ifname, h.netns) for h in hosts], progress=False)
    assert netns.leftovers() == []


def test_interrupt_removes_namespaces():
    _namespaces_required()
    with pytest.raises(KeyboardInterrupt), netns.SimulatedHosts(3, link_mbit=100) as hosts:
        assert len(netns.leftovers()) == 4  # three namespaces and the bridge
        assert [h.addr for h in hosts] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        raise KeyboardInterrupt
    assert netns.leftovers() == []


def test_stale_namespaces_of_dead_processes_are_removed():
    _namespaces_required()
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}{dead.pid}-abcdef-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netns.remove_stale()
    assert netns.leftovers() == []


def test_without_root_it_says_so_and_falls_back(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, reason = netns.available()
    assert not ok and "root" in reason and "loopback" in reason
    assert resolve_network(multinode.agents(_cfg())) == ("loopback", reason)
    netns_job = _cfg(network="netns")  # valid as a description: whether it can run here is the preflight's call
    with pytest.raises(ValueError, match="network='netns' cannot run here"):
        preflight(netns_job)


def test_bad_multinode_options_fail_before_start():
    with pytest.raises(ValueError, match="must be a multiple"):
        RunConfig(tier="multinode", world_size=3, global_batch_size=63,
                  tier_options=multinode.Options(nnodes=2, network="loopback"))
    with pytest.raises(ValueError, match="network='bogus'"):
        _cfg(network="bogus")
    with pytest.raises(ValueError, match="link_mbit=100 needs network='netns'"):
        _cfg(network="loopback", link_mbit=100)
    with pytest.raises(ValueError, match="nodes=0"):
        netns.SimulatedHosts(0)
    with pytest.raises(ValueError, match="link_delay_ms=2 needs network='netns'"):
        _cfg(network="loopback", link_delay_ms=2)
    with pytest.raises(ValueError, match="link_delay_ms=-1"):
        _cfg(link_delay_ms=-1)
    with pytest.raises(ValueError, match="delay_ms=-1"):
        netns.SimulatedHosts(2, delay_ms=-1)
    # the delay reaches the hosts' plan
    assert multinode.agents(_cfg(network="netns", link_mbit=200, link_delay_ms=2)).link_delay_ms == 2


PING = """
import socket, statistics, sys, time
peer, port, role = sys.argv[1], 5599, sys.argv[2]
if role == "server":
    s = socket.create_server((peer, port)); c, _ = s.accept()
    while (d := c.recv(1)):
        c.sendall(d)
else:
    for _ in range(50):
        try:
            c = socket.create_connection((peer, port)); break
        except OSError:
            time.sleep(0.1)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(6):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
    print(statistics.median(rtts[1:]))
"""


def test_delayed_link_holds_every_message_its_delay_each_way():
    """No netem here: the relay that joins the hosts holds each frame 5 ms, so a round trip takes >= 10 ms."""
    _namespaces_required()
    import subprocess
    import sys

    with netns.SimulatedHosts(2, link_mbit=1000, delay_ms=5) as hosts:
        server = subprocess.Popen(netns.SimulatedHosts.command(hosts[1], [sys.executable, "-c", PING,
                                                                          hosts[1].addr, "server"]))
        try:
            out = subprocess.run(netns.SimulatedHosts.command(hosts[0], [sys.executable, "-c", PING, hosts[1].addr,
                                                                         "client"]),
                                 capture_output=True, text=True, timeout=60, check=True)
        finally:
            server.kill()
            server.wait()
        during = netns.leftovers()
    rtt = float(out.stdout)
    assert 0.010 <= rtt < 0.030, rtt
    assert len(during) == 2 and netns.leftovers() == []  # two namespaces, no bridge; all gone after


def test_link_sweep_shows_compression_recovering_a_slow_link():
    _namespaces_required()
    from dtlab.experiments import linksweep

    base = RunConfig(tier="ddp", **{**BASE, "steps": 10})
    df = linksweep.link_sweep(base, caps_mbit=(200,), hooks=("allreduce", "fp16"), progress=None)
    full, half = (df[df["comm_hook"] == h].iloc[0] for h in ("allreduce", "fp16"))
    assert full["comm_mb_per_step"] == pytest.approx(2 * half["comm_mb_per_step"], rel=0.01)
    # 340 KB per step at 200 Mbit/s is ~14 ms of exposed communication; fp16 sends half of it.
    assert full["exposed_comm_ms"] > 8 and half["exposed_comm_ms"] < 0.8 * full["exposed_comm_ms"]
    assert (df["compute_ms"] + df["exposed_comm_ms"]).to_numpy() == pytest.approx(df["step_ms"].to_numpy())
    assert list(df["label"]) == ["200 Mbit/s · allreduce", "200 Mbit/s · fp16"]
    # each row carries the held-out loss of its trained model (10 SGD steps barely move it from ln(10) = 2.30,
    # so only finiteness is asked of its level) and fp16's rounding of the gradients barely moves it
    assert df["eval_loss"].between(1.0, 4.0).all() and (df["link_delay_ms"] == 0).all()
    assert half["eval_loss"] == pytest.approx(full["eval_loss"], rel=0.01)
    assert netns.leftovers() == []


def test_link_sweep_refuses_bad_input_and_says_why_without_root(monkeypatch):
    from dtlab.experiments import linksweep

    base = RunConfig(tier="ddp", **BASE)
    with pytest.raises(ValueError, match="caps_mbit"):
        linksweep.link_configs(base, caps_mbit=(0,))
    with pytest.raises(ValueError, match="hooks=\\('zip',\\)"):
        linksweep.link_configs(base, hooks=("zip",))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="needs simulated hosts: simulated hosts need root"):
        linksweep.link_configs(base)
