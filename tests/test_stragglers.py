"""A slow rank is named from when each rank enters each collective, not from step times."""

from __future__ import annotations

import pytest

from dtlab import RunConfig
from dtlab.core.results import RankResult, RunResult
from dtlab.read.stragglers import arrivals, straggler
from dtlab.train import run

DELAY_S = 0.02


def _events(rank: int, starts: list[float]) -> list[dict]:
    return [{"rank": rank, "seq": i, "op": "all_reduce", "bytes": 4, "dtype": "float32", "group_size": 2,
             "peer": None, "start": s, "end": s + 0.001, "wait_s": 0.0, "async": True, "tag": "", "step": i // 2}
            for i, s in enumerate(starts)]


def _result(starts0: list[float], starts1: list[float]) -> RunResult:
    ranks = [RankResult(rank=r, steps=[], memory={}, events=_events(r, s), phases=[], params_checksum=0.0)
             for r, s in enumerate((starts0, starts1))]
    return RunResult(RunConfig(tier="ddp", world_size=2), ranks, 1.0)


def test_arrivals_line_up_the_kth_collective_of_each_step():
    # two collectives per step over three steps; rank 1 enters each 5 ms after rank 0
    base = [0.0, 0.01, 1.0, 1.01, 2.0, 2.01]
    df = arrivals(_result(base, [t + 0.005 for t in base]))
    assert len(df) == 12 and set(df["index"]) == {0, 1}
    assert df.loc[df["rank"] == 0, "wait_s"].round(6).eq(0.005).all()
    assert df.loc[df["rank"] == 1, "last"].all()
    named = straggler(_result(base, [t + 0.005 for t in base]))
    assert named["rank"] == 1 and named["last_share"] == 1.0
    assert named["cost_per_step_s"] == pytest.approx(0.005)


@pytest.mark.parametrize("text", ["1", "x:5ms", "1:5", "1:-3ms", "1:120s", "2:5ms"])
def test_bad_slow_rank_names_the_field(text):
    with pytest.raises(ValueError, match="slow_rank"):
        RunConfig(tier="ddp", world_size=2, slow_rank=text)


@pytest.mark.usefixtures("no_survivors")
def test_a_delayed_rank_is_named_with_its_cost():
    cfg = RunConfig(tier="ddp", world_size=2, steps=12, global_batch_size=64, threads_per_rank=1,
                    slow_rank=f"1:{DELAY_S * 1e3:g}ms")
    slow = run(cfg, progress=False)
    named = straggler(slow)
    assert named["rank"] == 1 and named["last_share"] >= 0.8
    assert 0.5 * DELAY_S <= named["cost_per_step_s"] <= 2 * DELAY_S
    # step times cannot tell: both ranks' steps last as long (they wait in the same all-reduce)
    per_rank = slow.steps_frame().query("step >= 1").groupby("rank")["total"].median()
    assert per_rank[0] == pytest.approx(per_rank[1], rel=0.25)
    # the straggler's forward is longer on the timeline
    ph = slow.phases_frame().query("phase == 'forward' and step >= 1")
    forward = (ph["end"] - ph["start"]).groupby(ph["rank"]).median()
    assert forward[1] - forward[0] >= 0.8 * DELAY_S
    even = straggler(run(cfg.replace(slow_rank=""), progress=False))
    assert even["cost_per_step_s"] < 0.5 * DELAY_S
