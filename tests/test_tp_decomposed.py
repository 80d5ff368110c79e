"""The decomposed tensor-parallel MLP (``tp`` with ``decomposed_mlp=True``) trains what ``tp`` trains at world 2
and 4, moves its partial sums round the ring as the formula says, and the overlap of communication with compute
is measured per rank for ddp's buckets, fsdp's collectives and the ring.

Measured here (one CPU model, x86_64), 20 Adam steps: the mlp at lr 0.01 ends 1.8e-7 (world 2) and 8.9e-8
(world 4) from one device and within 1.3e-7 of tp; the charformer (4 heads, lr 0.003) at world 4 2.4e-7.
On 2 cores the ring buys no speed: what the tests check is the arithmetic and the overlap measure
(``dtlab.read.overlap``). Its > 0 for the ring and ddp and 0 for fsdp follow from the code's order (issue,
compute, wait; fsdp's calls synchronous) whatever the bytes do; the control layout (``ring_overlap=False``:
issue, wait, compute) is the check that could fail, and does on a loaded machine (see its test).
"""

from __future__ import annotations

import functools

import pytest

from dtlab.core.data import SEQ_LEN
from dtlab.core.results import RunResult
from dtlab.read.overlap import overlap_by_rank
from dtlab.tiers import ddp, tp
from dtlab.train import run
from tests.parity import TOL, job, single

pytestmark = pytest.mark.usefixtures("no_survivors")

TEXT = dict(model="charformer", dataset="text", model_heads=4, lr=0.003)


@functools.cache
def tp_run(n: int, decomposed: bool, text: bool = False) -> RunResult:
    cfg = job("adam", tier="tp", world_size=n, tier_options=tp.Options(decomposed_mlp=decomposed),
              **(TEXT if text else {}))
    return run(cfg, progress=False)


@functools.cache
def text_reference() -> RunResult:
    return run(job("adam", **TEXT), progress=False)


@pytest.mark.parametrize("n", [2, 4])
def test_the_decomposed_mlp_trains_what_tp_trains(n):
    result, plain = tp_run(n, True), tp_run(n, False)
    assert result.max_param_diff(plain) <= TOL and result.max_param_diff(single("adam")) <= TOL
    assert list(result.loss_curve()) == pytest.approx(list(plain.loss_curve()), abs=TOL)
    facts = result.ranks[n - 1].strategy
    assert facts["decomposed_mlp"] and facts["shards"]["3.weight"]["placements"] == ["Shard(1)"]
    assert facts["shards"]["1.weight"]["local_shape"] == [64 // n, 64]


def test_the_decomposed_charformer_at_four_ranks():
    result = tp_run(4, True, text=True)
    assert result.max_param_diff(text_reference()) <= TOL


@pytest.mark.parametrize("n", [2, 4])
def test_the_ring_sends_each_chunk_once_per_step(n):
    """Per pair and step: n - 1 partial sums and n - 1 reduced chunks each way (forward). The mlp's first pair
    reads the data, so its backward sends nothing; the all-reduce of tp is gone."""
    result = tp_run(n, True)
    chunk = 4 * (64 // n) * 64  # rows of the global batch (64) over n, times the width, in float32
    for rank in range(n):
        ev = result.events_frame()
        ev = ev[(ev["rank"] == rank) & (ev["step"] >= 1) & (ev["step"] < result.config.steps)]
        assert set(ev["op"]) == {"isend", "irecv"} and set(ev["tag"]) == {"tp_ring:forward:3"}
        per_step = ev.groupby(["step", "op"]).agg(calls=("bytes", "size"), bytes=("bytes", "sum"))
        assert set(per_step["calls"]) == {2 * (n - 1)} and set(per_step["bytes"]) == {2 * (n - 1) * chunk}


def test_the_charformer_ring_runs_in_both_passes():
    ev = tp_run(4, True, text=True).events_frame()
    ev = ev[(ev["rank"] == 0) & (ev["step"] == 1) & ev["tag"].str.startswith("tp_ring")]
    cfg = job("adam", **TEXT)
    chunk = 4 * (cfg.global_batch_size * SEQ_LEN // 4) * cfg.model_size  # a quarter of the rows, whole width
    # per block: 3 sends and 3 receives of the reduce-scatter and of the all-gather, in each pass
    assert ev.groupby("tag")["op"].size().to_dict() == {f"tp_ring:{p}:blocks.{b}.mlp.{i}": 12 for b in (0, 1)
                                                        for p, i in (("forward", 2), ("backward", 0))}
    assert set(ev["bytes"]) == {chunk}


def test_overlap_per_rank_for_ddp_fsdp_and_the_ring():
    """ddp's early buckets run while backward computes; FSDP2 on CPU runs its collectives in the training thread
    (nothing overlaps); the ring's transfers run under the next chunk's GEMM. These bounds hold by the code's
    order alone: the control below is what tells overlap from coincidence."""
    bucketed = run(job("adam", tier="ddp", world_size=2, tier_options=ddp.Options(bucket_cap_mb=0.01)),
                   progress=False)
    fsdp = run(job("adam", tier="fsdp", world_size=2), progress=False)
    for result, low, high in ((bucketed, 0.0, 100.0), (fsdp, 0.0, 0.0), (tp_run(2, True), 0.0, 100.0)):
        table = overlap_by_rank(result)
        assert list(table["rank"]) == [0, 1] and (table["comm_s"] > 0).all()
        assert (table["overlap_pct"] >= low).all() and (table["overlap_pct"] <= high).all()
        if high > 0:
            assert (table["overlapped_s"] > 0).all(), table


@functools.cache
def control_run() -> RunResult:
    """The decomposed MLP with every ring transfer waited for before the next chunk computes."""
    cfg = job("adam", tier="tp", world_size=2, tier_options=tp.Options(decomposed_mlp=True, ring_overlap=False))
    return run(cfg, progress=False)


def test_the_control_layout_computes_what_the_overlapping_ring_computes():
    ring, control = tp_run(2, True), control_run()
    assert control.max_param_diff(ring) == 0.0  # the same sums in the same order: only the waits moved
    tags = [r.events_frame()["tag"].str.startswith("tp_ring:").sum() for r in (ring, control)]
    assert tags[0] == tags[1] > 0


@pytest.mark.xfail(strict=False, reason="the measure counts as compute whatever time passes between a transfer's "
                                        "issue and its wait (a descheduled thread, a slow issuing call): on a "
                                        "loaded 2-core machine the control reads 39-64 %, as much as the ring "
                                        "(docs/figures/overlap.csv)")
def test_the_control_that_cannot_overlap_measures_about_zero_and_the_ring_more():
    ring, control = overlap_by_rank(tp_run(2, True)), overlap_by_rank(control_run())
    assert (control["overlap_pct"] < 5.0).all(), control
    assert (ring["overlap_pct"] > control["overlap_pct"] + 10.0).all(), (ring, control)
