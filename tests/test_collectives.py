"""The collective sweep measures what it says: bytes by nccl-tests' convention, positive bandwidth.

And how it turns repeats into one time per size (no processes): the interleaved
plan, the outlier rule and the median of the repeats it keeps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtlab.cost.links import sweep as collectives


@pytest.mark.usefixtures("no_survivors")
def test_sweep_bytes_follow_nccl_tests_conventions():
    sizes = (4096, 65536)
    df = collectives.sweep(2, sizes=sizes, repeats=2)
    assert set(df["op"]) == set(collectives.OPS)
    for op in collectives.OPS:
        assert sorted(df[df["op"] == op]["bytes"]) == list(sizes)  # gathered output, full input, one message
    assert (df["seconds"] > 0).all() and (df["busbw"] > 0).all()
    assert (df["repeats"] == 2).all() and (df["dropped"] == 0).all()  # two repeats: neither is 3 MADs out
    ar = df[df["op"] == "all_reduce"]
    assert (ar["busbw"] == ar["algbw"]).all()  # 2(n-1)/n = 1 at n = 2
    ag = df[df["op"] == "all_gather"]
    assert ag["busbw"].to_numpy() == pytest.approx(ag["algbw"].to_numpy() / 2)


@pytest.mark.usefixtures("no_survivors")
def test_bad_sweeps_fail_before_launch():
    with pytest.raises(ValueError, match="all_to_none"):
        collectives.sweep(2, ops=("all_to_none",))
    with pytest.raises(ValueError, match="world_size"):
        collectives.sweep(1)
    with pytest.raises(ValueError, match="repeats"):
        collectives.sweep(2, repeats=0)
    with pytest.raises(ValueError, match="threads_per_rank"):
        collectives.sweep(2, threads_per_rank=-1)


@pytest.mark.usefixtures("no_survivors")
def test_sweep_ranks_run_with_the_threads_asked_for():
    from dtlab.launch.local import launch

    for threads in (1, 2):
        per_rank = launch(collectives.sweep_rank, 2, args=(("all_reduce",), (4096,), 1, threads), record=True,
                          progress=False)
        assert {row["threads"] for rows in per_rank for row in rows} == {threads}


@pytest.mark.usefixtures("no_survivors")
def test_memcpy_bandwidth_is_plausible():
    assert 1e8 < collectives.memcpy_bandwidth(8 * 2**20, repeats=3) < 1e12


# -- repeats into one time per size (no processes) -------------------------------------------------------------
def test_plan_interleaves_rounds_and_every_rank_draws_the_same_order():
    ops, sizes = ("all_reduce", "broadcast"), (1024, 4096, 16384)
    plan = collectives.sweep_plan(ops, sizes, 4)
    assert plan == collectives.sweep_plan(ops, sizes, 4)  # deterministic: the ranks must agree
    assert len(plan) == 4 * len(ops) * len(sizes)
    rounds = [plan[i * 6:(i + 1) * 6] for i in range(4)]
    for rep, rnd in enumerate(rounds):  # each round runs every (op, size) once
        assert {r for r, _, _ in rnd} == {rep}
        assert sorted((op, s) for _, op, s in rnd) == sorted((op, s) for op in ops for s in sizes)
    assert len({tuple((op, s) for _, op, s in rnd) for rnd in rounds}) > 1  # shuffled from round to round


def test_outlier_rule_scaled_mad_with_a_floor():
    base = np.array([1.00, 1.01, 0.99, 1.02, 0.98, 1.00, 1.01])
    assert not collectives.outliers(base).any()
    assert not collectives.outliers(base * [1, 1, 1, 1, 1, 1, 1.04]).any()  # 5 % off: inside the floor's 6 %
    hit = base * [1, 1, 1, 3, 1, 1, 1]
    assert list(np.flatnonzero(collectives.outliers(hit))) == [3]
    assert not collectives.outliers(base * [1, 0.5, 1, 1, 1, 1, 1]).any()  # one-sided: interference only adds time
    # never more than half: even a bimodal set keeps its larger mode
    assert collectives.outliers([1, 1, 1, 1, 5, 5, 5]).sum() <= 3


def test_per_size_takes_the_slowest_rank_drops_outliers_and_takes_the_median():
    rows = []
    for rep, t in enumerate([1.0, 1.02, 0.98, 1.01, 9.0]):  # repeat 4: a hiccup
        rows += [{"rank": 0, "op": "all_reduce", "bytes": 4096, "group_size": 2, "repeat": rep, "seconds": t},
                 {"rank": 1, "op": "all_reduce", "bytes": 4096, "group_size": 2, "repeat": rep, "seconds": t / 2}]
    marked = collectives.mark_outliers(pd.DataFrame(rows))
    assert list(marked["seconds"]) == [1.0, 1.02, 0.98, 1.01, 9.0]  # rank 0, the slower, counts
    assert list(marked["outlier"]) == [False, False, False, False, True]
    out = collectives.per_size(pd.DataFrame(rows)).iloc[0]
    assert out["seconds"] == pytest.approx(1.005)  # the median of the four kept (the plain median: 1.01)
    assert (out["repeats"], out["dropped"]) == (5, 1)
    assert out["algbw"] == pytest.approx(4096 / 1.005) and out["busbw"] == pytest.approx(out["algbw"])
