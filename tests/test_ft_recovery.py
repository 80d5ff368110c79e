"""ft_recovery's parts, checks and formulas on hand-made runs: no processes."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from matplotlib.colors import to_rgb

from dtlab.core.config import RunConfig, parse_slow_rank
from dtlab.core.ft import TIMEOUTS, TORCHFT_TIMEOUTS, TUNED_TIMEOUTS, timeouts
from dtlab.core.results import RankResult, RunResult, params_to_bytes
from dtlab.cost import goodput as breakeven
from dtlab.launch import lighthouse
from dtlab.plots.recovery import PART_COLORS, recovery_timeline
from dtlab.read import recovery
from dtlab.tiers import ft
from dtlab.train.ft import replica_agreement
from tests import bench_scripts


def _benchmark():
    return bench_scripts.load("ft_recovery")


def _rank(replica: int, params: dict[str, torch.Tensor] | None) -> RankResult:
    return RankResult(rank=replica, steps=[], memory={}, events=[], phases=[], params_checksum=0.0,
                      params=None if params is None else params_to_bytes(params), strategy={"replica": replica})


def _result(*ranks: RankResult, events: list[dict] | None = None) -> RunResult:
    return RunResult(config=None, ranks=list(ranks), wall_s=1.0, run_events=events or [])


W = {"w": torch.ones(3)}


def test_agreement_compares_every_rank_of_every_group_not_only_their_first():
    def member(replica: int, rank: int, params: dict[str, torch.Tensor] | None) -> RankResult:
        r = _rank(replica, params)
        r.rank = 2 * replica + rank  # the run's numbering: replica x ranks_per_replica + rank
        return r

    off = {"w": torch.tensor([1.0, 1.25, 1.0])}
    same = [member(g, r, W) for g in range(2) for r in range(2)]
    assert replica_agreement(_result(*same), 2, ranks_per_replica=2) == 0.0
    # the groups' first ranks agree; the second rank of group 1 (or of group 0) does not
    assert replica_agreement(_result(*same[:3], member(1, 1, off)), 2, ranks_per_replica=2) == 0.25
    assert replica_agreement(_result(same[0], member(0, 1, off), *same[2:]), 2, ranks_per_replica=2) == 0.25
    # a rank that returned no parameters, or a group short of a rank, cannot agree
    assert math.isnan(replica_agreement(_result(*same[:3], member(1, 1, None)), 2, ranks_per_replica=2))
    assert math.isnan(replica_agreement(_result(*same[:3]), 2, ranks_per_replica=2))


def test_agreement_needs_every_group_a_lone_group_is_nan_and_fails_the_benchmark_check():
    assert replica_agreement(_result(_rank(0, W), _rank(1, {"w": torch.ones(3)})), 2) == 0.0
    assert replica_agreement(_result(_rank(0, W), _rank(1, {"w": torch.tensor([1.0, 1.0, 1.5])})), 2) == 0.5
    assert math.isnan(replica_agreement(_result(_rank(0, W)), 2))  # one group finished: no agreement by default
    assert math.isnan(replica_agreement(_result(_rank(0, W), _rank(1, None)), 2))
    check = _benchmark().check_ft
    with pytest.raises(RuntimeError, match=r"replica groups \[0\] finished, not all 2"):
        check(_result(_rank(0, W)), 2, None)
    with pytest.raises(RuntimeError, match="different parameters"):
        check(_result(_rank(0, W), _rank(1, {"w": torch.zeros(3)})), 2, None)
    with pytest.raises(RuntimeError, match="different parameters.*nan"):  # a group's parameters never came
        check(_result(_rank(0, W), _rank(1, None)), 2, None)
    check(_result(_rank(0, W), _rank(1, {"w": torch.ones(3)})), 2, None)  # both equal, nobody killed: passes


def _ft_events(rejoin: bool = True) -> list[dict]:
    """Group 1 killed at step 3 (t=1.0): group 0's step 3 fails at 1.02, commits at 1.50; group 1 restarted."""
    out = [{"time": 0.0, "kind": "lighthouse_start"}]

    def step(t, replica, attempt, s, committed=True, participants=2, healing=False):
        out.append({"time": t, "kind": "ft_step", "replica": replica, "attempt": attempt, "step": s,
                    "committed": committed, "participants": participants, "healing": healing, "quorum_id": 1})

    for s in range(3):
        step(0.1 * (s + 7), 0, 0, s)
        step(0.1 * (s + 7), 1, 0, s)
    out += [{"time": 1.0, "kind": "fault", "replica": 1, "attempt": 0, "step": 3},
            {"time": 1.05, "kind": "replica_failed", "replica": 1, "attempt": 0},
            {"time": 1.06, "kind": "replica_start", "replica": 1, "attempt": 1}]
    step(1.02, 0, 0, 3, committed=False)
    if rejoin:
        out += [{"time": 1.20, "kind": "ft_manager_ready", "replica": 1, "attempt": 1},
                {"time": 1.40, "kind": "ft_begin", "replica": 1, "attempt": 1, "step": 3, "healing": True},
                {"time": 1.45, "kind": "ft_state_loaded", "replica": 1, "attempt": 1}]
        step(1.50, 0, 0, 3, participants=1)
        step(1.50, 1, 1, 3, participants=1, healing=True)
        step(1.60, 0, 0, 4)
        step(1.60, 1, 1, 4)
    else:
        step(1.50, 0, 0, 3, participants=1)
        step(1.60, 0, 0, 4, participants=1)
    return out


def test_ft_parts_split_the_fault_into_known_intervals():
    parts = recovery.ft_parts(_result(events=_ft_events()), label="ft")
    got = {(r.lane, r.part): (round(r.start_s, 6), round(r.end_s, 6)) for r in parts.itertuples()}
    assert got == {("ft: live group", "detection"): (0.0, 0.02), ("ft: live group", "quorum"): (0.02, 0.4),
                   ("ft: live group", "redone steps"): (0.4, 0.5),  # one ordinary step (0.1 s) run again
                   ("ft: restarted group", "detection"): (0.0, 0.05),
                   ("ft: restarted group", "restart"): (0.05, 0.2), ("ft: restarted group", "quorum"): (0.2, 0.4),
                   ("ft: restarted group", "state transfer"): (0.4, 0.45)}
    with pytest.raises(ValueError, match="ft_manager_ready"):  # the killed group never came back
        recovery.ft_parts(_result(events=_ft_events(rejoin=False)))
    # a short run can end before the group is back: on request, its lane says so up to the run's last event
    lost = recovery.ft_parts(_result(events=_ft_events(rejoin=False)), label="ft", unfinished=True)
    lane = lost[lost["lane"] == "ft: restarted group"]
    assert lane["part"].tolist() == ["detection", recovery.NOT_BACK]
    assert lane["end_s"].tolist() == pytest.approx([0.05, 0.6])
    assert recovery_timeline(lost) is not None


def test_the_benchmark_check_fails_when_the_killed_group_did_not_rejoin():
    check = _benchmark().check_ft
    both = (_rank(0, W), _rank(1, {"w": torch.ones(3)}))
    check(_result(*both, events=_ft_events()), 2, killed=1)
    with pytest.raises(RuntimeError, match="group 1 was killed and did not rejoin"):
        check(_result(*both, events=_ft_events(rejoin=False)), 2, killed=1)


def test_a_quick_run_paces_every_variant_to_leave_a_restart_seconds_after_the_fault():
    bench = _benchmark()
    _, delay_s = parse_slow_rank(bench.QUICK_PACE)
    # a restart took about 1 s with 8 CPU hogs; unpaced, the live group's 28 steps after the fault took 0.3 s
    assert (bench.STEPS - bench.FAULT_STEP) * delay_s >= 2.0
    quick, full = bench.configs(bench.STEPS, bench.QUICK_PACE), bench.configs(bench.STEPS)
    assert quick.keys() == full.keys()
    for name, cfg in quick.items():
        assert cfg.slow_rank == bench.QUICK_PACE and full[name].slow_rank == "", name
        assert cfg.replace(slow_rank="") == full[name], name  # the pace is the only difference


def test_elastic_parts_from_fault_to_the_interrupted_step_done_again():
    ev = [{"time": 0.0, "kind": "worker_start", "rank": 0, "attempt": 0}]
    ev += [{"time": 0.1 * s, "kind": "step", "rank": 0, "attempt": 0, "step": s} for s in range(1, 8)]
    ev += [{"time": 0.55, "kind": "snapshot", "rank": 0, "attempt": 0, "step": 5},
           {"time": 0.75, "kind": "fault", "rank": 1, "attempt": 0, "step": 7},
           {"time": 0.80, "kind": "worker_error", "rank": 0, "attempt": 0, "error_type": "DistBackendError",
            "message": "x"},
           {"time": 3.0, "kind": "worker_start", "rank": 0, "attempt": 1},
           {"time": 3.1, "kind": "worker_start", "rank": 1, "attempt": 1},
           {"time": 3.5, "kind": "process_group_ready", "rank": 0, "attempt": 1},
           {"time": 3.6, "kind": "process_group_ready", "rank": 1, "attempt": 1},
           {"time": 3.7, "kind": "resume", "rank": 0, "attempt": 1, "step": 5},
           {"time": 3.8, "kind": "step", "rank": 0, "attempt": 1, "step": 6},
           {"time": 3.9, "kind": "step", "rank": 0, "attempt": 1, "step": 7}]
    parts = recovery.elastic_parts(_result(events=ev)).set_index("part")["seconds"].round(6).to_dict()
    assert parts == {"detection": 0.05, "restart": 2.2, "rendezvous": 0.6, "snapshot load": 0.1,
                     "redone steps": 0.2}


def test_break_even_and_samples_lost_on_known_numbers():
    # elastic loses 3.0 s per fault, ft 0.5 s; ft's step costs 5 ms more: even at one fault per 500 steps
    assert breakeven.break_even_steps(0.005, 2.5) == pytest.approx(500.0)
    assert breakeven.break_even_hours(500.0, 1.8) == pytest.approx(0.25)
    assert breakeven.break_even_steps(0.005, -2.0) == 0.0  # loses more per fault: never pays
    assert breakeven.break_even_steps(-0.005, 2.5) == math.inf  # cheaper steps too: always pays
    # 4 groups, batch 64: a step with 3 leaves out 16 samples, one with 2 leaves 32
    assert breakeven.samples_lost([4, 3, 4, 2], groups=4, global_batch=64) == 48.0
    for bad, match in (((float("inf"), 0.5), "extra_step_s=inf"), ((0.01, float("nan")), "saved_per_fault_s=nan"),
                       ((0.01, "2"), "saved_per_fault_s='2'")):
        with pytest.raises(ValueError, match=match):
            breakeven.break_even_steps(*bad)
    with pytest.raises(ValueError, match="participants 5"):
        breakeven.samples_lost([5], groups=4, global_batch=64)


def test_timeouts_are_torchfts_defaults_or_tuned_and_reach_the_lighthouse_command():
    assert TIMEOUTS == {"torchft": TORCHFT_TIMEOUTS, "tuned": TUNED_TIMEOUTS}
    assert (TORCHFT_TIMEOUTS.heartbeat_timeout_ms, TORCHFT_TIMEOUTS.join_timeout_ms,
            TORCHFT_TIMEOUTS.quorum_tick_ms, TORCHFT_TIMEOUTS.heartbeat_interval_ms) == (5000, 60000, 100, 100)
    cmd = lighthouse.command(Path("x.py"), "127.0.0.1", 0, 1, timeouts=timeouts("torchft"))
    assert cmd[cmd.index("--heartbeat_timeout_ms") + 1] == "5000" and cmd[cmd.index("--join_timeout_ms") + 1] == "60000"
    cmd = lighthouse.command(Path("x.py"), "127.0.0.1", 0, 1)
    assert cmd[cmd.index("--heartbeat_timeout_ms") + 1] == "300"
    cfg = RunConfig(tier="ft", world_size=2, tier_options=ft.Options(timeouts="torchft"))
    assert ft.plan(cfg).timeouts == "torchft"
    with pytest.raises(ValueError, match=r"^ft tier_options.timeouts='fast' is invalid: choose one of 'torchft', "):
        RunConfig(tier="ft", world_size=2, tier_options=ft.Options(timeouts="fast"))


def test_recovery_timeline_draws_each_part_where_the_frame_says():
    frame = pd.DataFrame([{"lane": "a", "part": "detection", "start_s": 0.0, "end_s": 1.0},
                          {"lane": "a", "part": "restart", "start_s": 1.0, "end_s": 3.0},
                          {"lane": "b", "part": "quorum", "start_s": 0.0, "end_s": 0.5}])
    fig = recovery_timeline(frame)
    ax = fig.axes[0]
    bars = [(round(p.get_x(), 6), round(p.get_width(), 6), round(p.get_y() + p.get_height() / 2, 6))
            for p in ax.patches]
    assert bars == [(0.0, 1.0, 0.0), (1.0, 2.0, 0.0), (0.0, 0.5, 1.0)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert ax.patches[2].get_facecolor()[:3] == pytest.approx(to_rgb(PART_COLORS["quorum"]))
    with pytest.raises(ValueError, match="unknown part"):
        recovery_timeline(frame.assign(part="nap"))


def test_every_part_the_analysis_names_has_a_colour():
    # the plots layer cannot import the read layer's names, so the two spell the parts apart
    assert set(PART_COLORS) == set(recovery.PARTS)
