"""The collective sweep measures what it says: bytes by nccl-tests' convention, positive bandwidth."""

from __future__ import annotations

import pytest

from dtlab.analysis import collectives

pytestmark = pytest.mark.usefixtures("no_survivors")


def test_sweep_bytes_follow_nccl_tests_conventions():
    sizes = (4096, 65536)
    df = collectives.sweep(2, sizes=sizes, repeats=2)
    assert set(df["op"]) == set(collectives.OPS)
    for op in collectives.OPS:
        assert sorted(df[df["op"] == op]["bytes"]) == list(sizes)  # gathered output, full input, one message
    assert (df["seconds"] > 0).all() and (df["busbw"] > 0).all()
    ar = df[df["op"] == "all_reduce"]
    assert (ar["busbw"] == ar["algbw"]).all()  # 2(n-1)/n = 1 at n = 2
    ag = df[df["op"] == "all_gather"]
    assert ag["busbw"].to_numpy() == pytest.approx(ag["algbw"].to_numpy() / 2)


def test_bad_sweeps_fail_before_launch():
    with pytest.raises(ValueError, match="all_to_none"):
        collectives.sweep(2, ops=("all_to_none",))
    with pytest.raises(ValueError, match="world_size"):
        collectives.sweep(1)


def test_memcpy_bandwidth_is_plausible():
    assert 1e8 < collectives.memcpy_bandwidth(8 * 2**20, repeats=3) < 1e12
