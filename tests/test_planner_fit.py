"""What the planner does with what a source left out (``planner.prediction``), and how its constants are fitted and
validated (``planner.fit``): the advice is the fastest layout that fits, never a faster one that does not; a row
with nothing that fits is not scored; leaving a source out of the fit changes what predicts it."""

from __future__ import annotations

import math

import pytest

from dtlab.cost.planner import fit as F
from dtlab.cost.planner import prediction as P
from dtlab.cost.planner import runs as R
from dtlab.cost.planner.layout import divisors
from dtlab.cost.planner.search import evaluate
from dtlab.cost.planner.validate import DEFAULT_RUNS
from dtlab.cost.roofline import devices
from tests.test_validate import GOOD, _write

BIG = {**GOOD, "model": "GPT 175B", "layers": "96", "hidden": "12288", "heads": "96", "kv_heads": "96",
       "ffn": "49152", "gpus": "16", "tp": "8", "dp": "2", "global_batch": "64"}


def _runs(tmp_path, rows):
    return R.read_runs(_write(tmp_path / "runs.csv", rows))


def test_an_unpublished_micro_batch_is_the_fastest_that_fits_never_a_faster_one_that_does_not(tmp_path):
    (run,) = _runs(tmp_path, [{**GOOD, "recompute": "none", "global_batch": "2048"}])
    layouts = P.candidates(run)
    assert [lay.micro_batch for lay in layouts] == divisors(2048 // 8)  # every legal micro-batch, 1 to 256
    rows = [evaluate(run.model, run.cluster, lay, run.global_batch) for lay in layouts]
    fastest = min(rows, key=lambda r: r["step_s"])
    fitting = [r for r in rows if r["feasible"]]
    assert not fastest["feasible"]  # the fastest choice does not fit: it must not be the prediction
    p = P.predict(run)
    assert p["scored"] and p["fits"] and p["micro_batch"] == min(fitting, key=lambda r: r["step_s"])["micro_batch"]
    assert p["feasible_count"] == len(fitting) < p["candidates"] == len(rows)
    assert p["low"] < p["predicted"] == p["high"]  # the advice is the top of the range over what fits
    assert P.metric_value(run, fastest) > p["predicted"]


def test_every_legal_interleave_is_a_candidate(tmp_path):
    """28 layers on 2 stages: 14 a stage, so 1, 2, 7 and 14 chunks (7 and 14 were outside the old fixed list)."""
    (run,) = _runs(tmp_path, [{**GOOD, "layers": "28", "gpus": "16", "tp": "2", "pp": "2", "dp": "4",
                               "micro_batch": "1", "zero": "1"}])
    assert P.unpublished(run) == ["interleave"]
    assert sorted({lay.interleave for lay in P.candidates(run)}) == [1, 2, 7, 14]
    assert P.predict(run)["interleave"] in (1, 2, 7, 14)


def test_a_row_whose_open_choices_never_fit_is_reported_and_not_scored(tmp_path):
    open_run, published = _runs(tmp_path, [BIG, {**BIG, "micro_batch": "1"}])
    p = P.predict(open_run)
    assert not p["scored"] and math.isnan(p["predicted"]) and math.isnan(p["error"]) and p["feasible_count"] == 0
    assert "not scored" in p["note"] and "micro_batch" in p["note"]
    # the same layout published in full is predicted at it (nothing is chosen), its misfit said
    q = P.predict(published)
    assert q["scored"] and not q["fits"] and q["predicted"] > 0 and "memory model" in q["note"]
    assert q["mfu_published"] == pytest.approx(p["mfu_published"])  # the published figure, on one scale


def test_the_weighted_median_and_what_a_fit_weighs():
    assert F.weighted_median([1.0, 2.0, 3.0], [1, 1, 1]) == 2.0
    assert F.weighted_median([1.0, 2.0, 3.0, 10.0], [1 / 3, 1 / 3, 1 / 3, 1.0]) == 3.0  # a one-row source weighs 1
    with pytest.raises(ValueError):
        F.weighted_median([], [])


def _three_sources(tmp_path):
    """Two A100 sources that disagree by about 20 % and one H100 source: every row's layout published in full."""
    pinned = {**GOOD, "micro_batch": "4"}
    rows = [{**pinned, "source": "fast paper, Table 1", "value": "21000"},
            {**pinned, "source": "fast paper, Table 1", "seq": "1024", "value": "22000"},
            {**pinned, "source": "slow paper, Table 2", "value": "17000"},
            {**pinned, "source": "slow paper, Table 2", "seq": "1024", "value": "18000"},
            {**pinned, "source": "hopper report, Table 3", "gpu": "H100_SXM", "value": "50000"}]
    return _runs(tmp_path, rows)


def test_a_fit_zeroes_its_rows_median_error_per_die(tmp_path):
    runs = _three_sources(tmp_path)
    committed = dict(devices.SUSTAINED)
    fold = F.fit(runs)
    assert devices.SUSTAINED == committed  # a fit tries values, then puts the committed ones back
    assert fold.fitted_on == {"A100": (1, 2, 3, 4), "H100": (5,)} and not fold.borrowed
    with F.sustained(fold.constants):
        h100 = P.predict(runs[4])["error"]
        a100 = sorted(P.predict(run)["error"] for run in runs[:4])
    assert abs(h100) < 0.002 and a100[1] < 0.002 < a100[2]  # the weighted median's row is zeroed
    moved = F.fit(runs[:4] + _runs(tmp_path, [{**GOOD, "micro_batch": "4", "gpu": "H100_SXM", "value": "60000"}]))
    assert moved.constants["A100"] == fold.constants["A100"] and moved.constants["H100"] > fold.constants["H100"]


def test_leaving_a_source_out_refits_without_it_and_differs_from_in_sample(tmp_path):
    runs = _three_sources(tmp_path)
    loso, inside = F.out_of_sample(runs), F.in_sample(runs)
    fast = loso[0]["fold"]
    assert fast.held_out == "fast paper" and fast.fitted_on["A100"] == (3, 4)  # only the other source's rows
    assert fast.constants == F.fit(runs, held_out="fast paper").constants
    assert fast.constants["A100"] < inside[0]["fold"].constants["A100"]  # fitted on the slower source alone
    for row in loso:  # no row is predicted by a constant fitted on its own source
        assert row["run"].index not in row["fold"].fitted_on.get(F.die_of(row["run"]), ())
    assert [abs(r["error"]) for r in loso[:4]] > [abs(r["error"]) for r in inside[:4]]
    assert loso[0]["error"] < inside[0]["error"] < 0 < inside[2]["error"] < loso[2]["error"]
    # the H100 source was its die's only one: out of sample, its constant is the A100's mean, and says so
    hopper = loso[4]["fold"]
    assert hopper.borrowed == ("H100",) and hopper.constants["H100"] == hopper.constants["A100"]
    with pytest.raises(ValueError, match="at least two sources"):
        F.out_of_sample(runs[:2])
    with pytest.raises(ValueError, match="A100: no value in .* zeroes"):
        F.fit(_runs(tmp_path, [{**GOOD, "micro_batch": "4", "value": "90000"}]))  # a figure no GEMM rate explains


def test_the_committed_constants_are_the_fit_of_the_committed_table():
    fold = F.fit(R.read_runs(DEFAULT_RUNS))
    assert fold.constants == devices.SUSTAINED and not fold.borrowed
    assert set(fold.fitted_on) == {"A100", "H100"}
