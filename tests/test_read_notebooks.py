"""The run readers behind notebooks 07 (multi-node), 08 (elastic) and 09 (RPC), on small synthetic inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from dtlab.core.results import RankResult, RunResult
from dtlab.experiments import linksweep
from dtlab.read import elastic, multinode, rpc


def _rank(rank: int, strategy: dict | None = None, losses: tuple[float, ...] = (1.0,), accuracy: float = 0.5,
          phases: list | None = None) -> RankResult:
    steps = [{"step": i, "loss": loss, "total": 0.01} for i, loss in enumerate(losses)]
    return RankResult(rank=rank, steps=steps, memory={}, events=[], phases=phases or [], params_checksum=0.0,
                      evaluation={"accuracy": accuracy}, strategy=strategy or {})


def _result(ranks: list[RankResult], config: object = None, run_events: list | None = None) -> RunResult:
    return RunResult(config=config, ranks=ranks, wall_s=1.0, run_events=run_events or [])


# -- 07: multi-node -------------------------------------------------------------------------------------------

def test_placement_keeps_the_asked_keys_in_rank_order():
    where = [{"global_rank": g, "node": g // 2, "local_rank": g % 2, "addr": f"10.0.0.{g // 2 + 1}", "ifname": "lo",
              "network": "loopback"} for g in range(4)]
    result = _result([_rank(g, w) for g, w in enumerate(where)])
    df = multinode.placement(result)
    assert list(df.columns) == list(multinode.PLACEMENT)
    assert df["local_rank"].tolist() == [0, 1, 0, 1] and df["node"].tolist() == [0, 0, 1, 1]
    assert df["addr"].iloc[3] == "10.0.0.2"
    assert multinode.placement(result, ("node", "network")).shape == (4, 2)


def test_launch_reads_agents_rendezvous_and_each_workers_parent():
    events = [{"time": 0.0, "kind": "node_start", "node": 0, "agent_pid": 100, "rdzv_id": "job"},
              {"time": 0.1, "kind": "node_start", "node": 1, "agent_pid": 200, "rdzv_id": "job"},
              {"time": 1.0, "kind": "worker_start", "rank": 3, "agent_pid": 200},
              {"time": 1.1, "kind": "worker_start", "rank": 0, "agent_pid": 100},
              {"time": 1.2, "kind": "worker_start", "rank": 2, "agent_pid": 200},
              {"time": 1.3, "kind": "worker_start", "rank": 1, "agent_pid": 100}]
    info = multinode.launch(_result([], run_events=events))
    assert info["agent_pids"] == [100, 200] and info["rdzv_ids"] == ["job"]
    assert list(info["parents"].items()) == [(0, 100), (1, 100), (2, 200), (3, 200)]
    assert multinode.launch([]) == {"agent_pids": [], "rdzv_ids": [], "parents": {}}


def _sweep() -> pd.DataFrame:
    # cap-major, as link_sweep returns it: 10 Gbit/s then 200 Mbit/s, three hooks each
    rows = []
    for cap, numbers in ((10_000.0, {"allreduce": (10.0, 8.0, 2.0, 4.0), "fp16": (12.0, 10.0, 1.0, 2.0),
                                     "powersgd": (15.0, 14.0, 0.5, 0.08)}),
                         (200.0, {"allreduce": (200.0, 8.0, 190.0, 4.0), "fp16": (110.0, 10.0, 95.0, 2.0),
                                  "powersgd": (20.0, 14.0, 4.0, 0.08)})):
        for hook, (step, compute, exposed, mb) in numbers.items():
            rows.append({"link_mbit": cap, "comm_hook": hook, "world_size": 2, "nnodes": 2, "step_ms": step,
                         "comm_ms": exposed + 1.0, "exposed_comm_ms": exposed, "compute_ms": compute,
                         "comm_mb_per_step": mb, "final_loss": {"allreduce": 0.5, "fp16": 0.5001,
                                                                "powersgd": 0.7}[hook] + (cap < 1000) * 0.01,
                         "steps_measured": 8, "label": f"{linksweep.mbit_label(cap)} · {hook}"})
    return pd.DataFrame(rows)


def test_hook_comparison_puts_each_run_beside_allreduce_at_its_cap():
    cmp = linksweep.hook_comparison(_sweep())
    assert cmp.loc[("fp16", 200.0), "step_ratio"] == pytest.approx(110 / 200)
    assert cmp.loc[("powersgd", 10_000.0), "step_ratio"] == pytest.approx(1.5)
    assert cmp.loc[("fp16", 200.0), "bytes_ratio"] == pytest.approx(0.5)
    assert cmp.loc[("powersgd", 200.0), "bytes_ratio"] == pytest.approx(0.02)
    assert cmp.loc[("allreduce", 200.0), "exposed_share"] == pytest.approx(0.95)
    assert cmp.loc[("powersgd", 200.0), "baseline_compute_ms"] == 8.0
    assert (cmp.loc["allreduce", "step_ratio"] == 1.0).all()
    with pytest.raises(ValueError, match="not in the sweep"):
        linksweep.hook_comparison(_sweep(), baseline="bf16")


def test_sweep_summary_says_what_the_numbers_say():
    text = linksweep.sweep_summary(_sweep(), single_loss=0.49).splitlines()
    assert text[0] == ("allreduce: 200.0 ms per step at 200 Mbit/s against 10.0 ms at 10000 Mbit/s; exposed "
                       "communication 190.0 ms (95% of the step) against 2.0 ms (20%)")
    assert text[1].startswith("fp16: sends 50.0% of allreduce's bytes; at 10000 Mbit/s step 1.20x allreduce's, "
                              "compute 10.0 ms (allreduce 8.0); at 200 Mbit/s step 0.55x")
    assert text[2].startswith("powersgd: sends 2.0% of allreduce's bytes")
    # the first row of each hook (the first cap swept) gives its loss
    assert text[3] == "final loss: allreduce 0.5000, fp16 0.5001, powersgd 0.7000 (single device 0.4900)"
    assert linksweep.sweep_summary(_sweep()).splitlines()[-1].endswith("powersgd 0.7000")


def test_fastest_hook_and_step_times_at_a_cap():
    assert linksweep.fastest_hook(_sweep(), 200) == "powersgd"
    assert linksweep.fastest_hook(_sweep(), 10_000) == "allreduce"
    assert linksweep.step_ms_at(_sweep(), 200).to_dict() == {"powersgd": 20.0, "fp16": 110.0, "allreduce": 200.0}
    with pytest.raises(ValueError, match="not in the sweep"):
        linksweep.step_ms_at(_sweep(), 1_000)


def test_beta_terms_is_the_bandwidth_share_of_the_measured_allreduce():
    terms = linksweep.beta_terms(_sweep())
    slow = terms.set_index("label").loc["200 Mbit/s · allreduce"]
    # 2-rank ring: each rank sends its 4 MB once; 4e6 B * 8 bit / 200e6 bit/s = 160 ms
    assert slow["beta_term_ms"] == pytest.approx(160.0)
    assert slow["measured_comm_ms"] == 191.0 and slow["rest_ms"] == pytest.approx(31.0)
    assert terms.set_index("label").loc["10 Gbit/s · fp16", "beta_term_ms"] == pytest.approx(1.6)
    assert list(terms.columns) == ["label", "MB_per_step", "beta_term_ms", "measured_comm_ms", "rest_ms"]


def test_allreduce_sizes_lists_one_ranks_allreduces_per_step_in_order():
    ev = pd.DataFrame({"rank": [0, 0, 1, 0, 0, 0, 0], "op": ["all_reduce", "all_reduce", "all_reduce", "broadcast",
                                                            "all_reduce", "all_reduce", "all_reduce"],
                       "step": [0, 0, 0, 1, 1, 1, 1], "bytes": [100, 50, 100, 8, 40, 20, 30]})
    sizes = linksweep.allreduce_sizes(SimpleNamespace(events_frame=lambda: ev))
    assert sizes.to_dict() == {0: [100, 50], 1: [40, 20, 30]}
    assert linksweep.allreduce_sizes(SimpleNamespace(events_frame=lambda: ev), rank=1).to_dict() == {0: [100]}


# -- 08: elastic ----------------------------------------------------------------------------------------------

def _ev(t, kind, rank=None, attempt=0, step=None, world_size=2, **extra):
    return {"time": 100.0 + t, "kind": kind, "rank": rank, "attempt": attempt, "step": step,
            "world_size": world_size, **extra}


def _killed_run_events():
    return [_ev(0.0, "node_start", node=0), _ev(0.5, "worker_start", 0), _ev(0.6, "worker_start", 1),
            _ev(1.0, "begin", 0, step=0, per_rank_batch=32, accumulation_steps=1),
            *[_ev(1.0 + 0.1 * s, "step", 0, step=s) for s in range(1, 8)],
            _ev(1.5, "snapshot", 0, step=5),
            _ev(1.8, "fault", 1, step=7, fault="sigkill"),
            _ev(2.0, "worker_error", 0, error_type="DistBackendError",
                message="[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1. More text\n2nd"),
            _ev(4.0, "worker_start", 0, attempt=1), _ev(4.1, "worker_start", 1, attempt=1),
            _ev(5.0, "resume", 1, attempt=1, step=5, per_rank_batch=16, accumulation_steps=2),
            _ev(5.2, "resume", 0, attempt=1, step=5, per_rank_batch=16, accumulation_steps=2),
            _ev(5.5, "step", 0, attempt=1, step=6), _ev(5.6, "step", 0, attempt=1, step=7),
            _ev(5.9, "snapshot", 0, attempt=1, step=10)]


def test_restart_reads_the_fault_the_victim_and_the_resume():
    r = elastic.restart(elastic.timeline(_killed_run_events()))
    assert (r["fault_t"], r["fault_rank"], r["fault_step"], r["fault_attempt"]) == (pytest.approx(1.8), 1, 7, 0)
    assert r["victim"] == {"t": pytest.approx(2.0), "rank": 0, "error_type": "DistBackendError",
                           "message": "Connection closed by peer [127.0.0.1]:1"}
    assert r["restart_t"] == pytest.approx(4.0) and r["restarted_workers"] == 2
    assert r["resume_t"] == pytest.approx(5.2) and r["resume_step"] == 5  # rank 0's resume
    assert r["first_step_t"] == pytest.approx(5.5) and r["cost_s"] == pytest.approx(3.7)
    assert r["recomputed_steps"] == 2
    # the run itself works as well as its timeline; without a fault there is nothing to read
    assert elastic.restart(_result([], run_events=_killed_run_events()))["fault_step"] == 7
    with pytest.raises(ValueError, match="no fault"):
        elastic.restart([e for e in _killed_run_events() if e["kind"] != "fault"])


def test_restart_without_a_victim_says_none():
    events = [e for e in _killed_run_events() if e["kind"] != "worker_error"]
    assert elastic.restart(events)["victim"] is None


def test_snapshot_steps_and_batching_before_and_after():
    result = _result([], config=SimpleNamespace(world_size=2), run_events=_killed_run_events())
    assert elastic.snapshot_steps(result) == [5, 10]
    b = elastic.batching(result)
    assert b["before"] == {"attempt": 0, "step": 0, "per_rank_batch": 32, "accumulation_steps": 1,
                           "micro_batch": 32, "global_batch": 64}
    assert b["after"] == {"attempt": 1, "step": 5, "per_rank_batch": 16, "accumulation_steps": 2,
                          "micro_batch": 8, "global_batch": 32}
    with pytest.raises(ValueError, match="resume"):
        elastic.batching(_result([], config=SimpleNamespace(world_size=2), run_events=_killed_run_events()[:5]))


def test_membership_follows_a_world_growing_from_one_to_two():
    events = [_ev(0.0, "node_start", node=0, world_size=None), _ev(0.5, "worker_start", 0, world_size=1),
              *[_ev(1.0 + 0.1 * s, "step", 0, step=s, world_size=1) for s in range(5)],
              _ev(1.4, "snapshot", 0, step=5, world_size=1),
              _ev(2.0, "node_start", node=1, world_size=None),
              _ev(3.5, "worker_start", 1, world_size=2), _ev(3.0, "worker_start", 0, world_size=2),
              _ev(4.0, "resume", 1, step=5), _ev(4.1, "resume", 0, step=5),
              *[_ev(4.5 + 0.1 * s, "step", r, step=5 + s) for s in range(3) for r in (0, 1)]]
    m = elastic.membership(events)
    assert m["world_sizes"] == [1, 2] and m["steps_per_world"] == {1: 5, 2: 6}
    assert m["last_agent_t"] == pytest.approx(2.0) and m["largest_world_delay_s"] == pytest.approx(1.0)
    assert m["attempts"] == [0] and m["resume_step"] == 5


def test_agreement_names_identical_rounding_and_different():
    assert elastic.agreement(0.0) == "bitwise identical"
    assert elastic.agreement(3e-7) == "equal up to float rounding"
    assert elastic.agreement(2e-3) == "different"
    assert elastic.agreement(2e-3, rounding=1e-2) == "equal up to float rounding"
    assert {elastic.agreement(d) for d in (0.0, 1e-6, 1.0)} == set(elastic.AGREEMENT)


# -- 09: RPC --------------------------------------------------------------------------------------------------

def _rpc_run(mode: str | None, trainers: int, losses: tuple[float, ...], accuracy: float,
             staleness: tuple[int, ...] = ()) -> RunResult:
    tier = "single" if mode is None else "rpc"
    config = SimpleNamespace(tier=tier, world_size=trainers, tier_options=SimpleNamespace(mode=mode) if mode else None)
    rows = [(1 + i % trainers, i, i, i + s, s) for i, s in enumerate(staleness)]
    return _result([_rank(0, {"staleness": rows}, losses=losses, accuracy=accuracy)], config=config)


def _runs():
    return {0.1: {"single": _rpc_run(None, 1, (2.0, 1.0), 0.80),
                  "rpc sync, 2 trainers": _rpc_run("sync", 2, (2.0, 1.0), 0.80, (0, 0, 0, 0)),
                  "rpc async, 2 trainers": _rpc_run("async", 2, (2.0, 0.8), 0.85, (0, 1, 0, 1)),
                  "rpc async, 4 trainers": _rpc_run("async", 4, (2.0, 0.6), 0.90, (0, 1, 2, 3, 3, 0, 2, 1))},
            0.5: {"rpc sync, 2 trainers": _rpc_run("sync", 2, (2.0, 0.5), 0.95, (0, 0)),
                  "rpc async, 2 trainers": _rpc_run("async", 2, (2.0, 0.7), 0.90, (0, 2))}}


def test_runs_table_summarises_loss_accuracy_and_staleness():
    table = rpc.runs_table(_runs())
    assert table.index.names == ["lr", "run"] and len(table) == 6
    a4 = table.loc[(0.1, "rpc async, 4 trainers")]
    assert a4["final_loss"] == pytest.approx(0.6) and a4["test_accuracy"] == 0.90
    assert a4["updates"] == 8 and a4["mean_staleness"] == pytest.approx(1.5) and a4["max_staleness"] == 3
    assert a4["stale_share"] == pytest.approx(0.75)
    assert pd.isna(table.loc[(0.1, "single"), "stale_share"])  # not an rpc run: no staleness
    assert list(table.columns) == ["final_loss", "test_accuracy", "updates", "mean_staleness", "max_staleness",
                                   "stale_share"]


def test_async_vs_sync_compares_each_async_run_with_its_groups_sync_run():
    cmp = rpc.async_vs_sync(_runs())
    assert list(cmp.index) == [(0.1, 2), (0.1, 4), (0.5, 2)]
    assert cmp.loc[(0.1, 2), "verdict"] == "lower" and cmp.loc[(0.5, 2), "verdict"] == "higher"
    assert cmp.loc[(0.5, 2), "sync_loss"] == pytest.approx(0.5) and cmp.loc[(0.5, 2), "sync_accuracy"] == 0.95
    assert cmp.loc[(0.1, 4), "stale_share"] == pytest.approx(0.75) and cmp.loc[(0.5, 2), "max_staleness"] == 2
    with pytest.raises(ValueError, match="one sync rpc run"):
        rpc.async_vs_sync({0.1: {k: v for k, v in _runs()[0.1].items() if "sync," not in k}})


def test_trainer_calls_per_call_sizes_and_latencies():
    calls = pd.DataFrame({"caller": ["trainer1", "trainer1", "trainer2", "trainer2", "trainer2"],
                          "callee": ["ps"] * 5, "op": ["rpc_sync"] * 5,
                          "function": ["_forward", "_local_optimizer_step", "_forward", "_local_optimizer_step",
                                       "_setup"],
                          "calls": [10, 10, 10, 10, 2], "request_bytes": [10 * 2048, 100, 10 * 4096, 100, 10],
                          "response_bytes": [10 * 512, 50, 10 * 512, 50, 5],
                          "median_latency_ms": [1.0, 0.2, 3.0, 0.4, 9.0]})
    s = rpc.trainer_calls(calls)
    assert (s["calls_min"], s["calls_max"]) == (20, 22)
    assert s["forward_kib_out"] == pytest.approx(3.0) and s["forward_kib_back"] == pytest.approx(0.5)
    assert s["forward_median_ms"] == pytest.approx(2.0) and s["step_median_ms"] == pytest.approx(0.3)


def test_action_requests_latency_bytes_and_the_policys_share():
    events = pd.DataFrame({"tag": ["_select_action"] * 3 + ["_run_episode"],
                           "duration_s": [0.001, 0.002, 0.004, 0.5], "bytes": [300, 320, 310, 100],
                           "response_bytes": [40, 40, 42, 900]})
    phases = [{"rank": 0, "phase": "forward", "start": 0.0, "end": 0.0002, "step": 0},
              {"rank": 0, "phase": "forward", "start": 1.0, "end": 1.0004, "step": 0},
              {"rank": 0, "phase": "forward", "start": 2.0, "end": 2.0009, "step": 0},
              {"rank": 1, "phase": "forward", "start": 0.0, "end": 0.5, "step": 0},
              {"rank": 0, "phase": "optimizer", "start": 3.0, "end": 3.5, "step": 0}]
    a = rpc.action_requests(events, phases)
    assert a["requests"] == 3 and a["latency_ms"] == pytest.approx(2.0)
    assert a["bytes_out"] == 310 and a["bytes_back"] == 40
    assert a["policy_ms"] == pytest.approx(0.4)
    assert rpc.action_requests(events, pd.DataFrame(phases))["policy_ms"] == pytest.approx(0.4)
