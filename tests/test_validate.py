"""``python -m dtlab.cost.planner.validate``: the planner against the committed table of published runs, on any
CSV in the schema, and a malformed CSV named by row and column (run in-process: no subprocess)."""

from __future__ import annotations

import csv
import re
import statistics

import pytest

from dtlab.cost.planner import runs as R
from dtlab.cost.planner import validate as V

SUMMARY = re.compile(r"^published runs: (\d+); median \|error\| ([\d.]+) %; worst ([+-][\d.]+) % \((row \d+: .+)\)$")
GOOD = {"source": "a paper, Table 9", "model": "GPT 1.3B", "layers": "24", "hidden": "2048", "heads": "16",
        "kv_heads": "16", "ffn": "8192", "vocab": "50304", "seq": "2048", "experts": "0", "top_k": "0",
        "mlp": "plain", "attention": "flash", "gpu": "A100_80GB", "gpus": "16", "tp": "2", "pp": "1", "dp": "8",
        "cp": "1", "ep": "1", "interleave": "", "zero": "1", "recompute": "selective", "micro_batch": "",
        "global_batch": "256", "precision": "bf16", "metric": "tokens_per_s_per_gpu", "value": "20000"}


def _write(path, rows, header=R.SCHEMA):
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row in rows:
            writer.writerow([row.get(c, "") for c in header] if isinstance(row, dict) else row)
    return path


def test_the_committed_table_meets_its_target(capsys):
    runs = R.read_runs(V.DEFAULT_RUNS)
    assert len(runs) >= 15 and len({run.source.split(",")[0] for run in runs}) >= 4
    assert all(("Table" in run.source or "table" in run.source) for run in runs)
    assert V.main([]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    match = SUMMARY.match(out[-1])
    assert match, out[-1]
    n, median, worst = int(match[1]), float(match[2]), float(match[3])
    assert n == len(runs) and median <= 10.0 and abs(worst) <= 25.0
    assert sum(1 for line in out if re.search(r"[+-]\d+\.\d %$", line)) == n  # a line per run, with its error


def test_any_csv_in_the_schema_is_predicted_at_its_layout(tmp_path):
    fixed = {**GOOD, "micro_batch": "4", "metric": "mfu", "value": "0.5", "attention": "materialised"}
    runs = R.read_runs(_write(tmp_path / "runs.csv", [GOOD, fixed]))
    assert runs[1].model.flash_attention is False and runs[0].model.flash_attention is True
    assert runs[0].model.gated_mlp is False and runs[0].micro_batch is None
    free, pinned = V.predict(runs[0]), V.predict(runs[1])
    assert free["feasible"] and free["micro_batch"] in V.MICRO_BATCHES and pinned["micro_batch"] == 4
    assert (free["tp"], free["dp"], free["zero"], free["checkpointing"]) == (2, 8, 1, "selective")
    assert pinned["predicted"] == pytest.approx(pinned["mfu"]) and 0.2 < pinned["mfu"] < 0.8
    assert free["error"] == pytest.approx(free["tokens_per_s"] / 16 / 20000 - 1)
    assert V.main(["--runs", str(tmp_path / "runs.csv")]) == 0


def test_the_attention_and_mlp_columns_change_the_prediction(tmp_path):
    """Both switches are read from their columns (never from a name), and each changes the time predicted."""
    pinned = {**GOOD, "micro_batch": "4"}
    rows = [pinned, {**pinned, "attention": "materialised"}, {**pinned, "mlp": "gated"},
            {**pinned, "model": "GPT 1.3B [materialised attention]"}]
    runs = R.read_runs(_write(tmp_path / "runs.csv", rows))
    flash, materialised, gated, named = (V.predict(run)["predicted"] for run in runs)
    assert materialised < 0.95 * flash  # the s x s scores' traffic costs time at a sequence of 2,048
    assert gated != pytest.approx(flash, rel=0.02)  # a third MLP matrix
    assert named == flash and runs[3].model.flash_attention  # a name is a name


@pytest.mark.parametrize("column,value,why", [
    ("tp", "two", "is not an integer >= 1"),
    ("gpu", "V100", "is not one of H100_SXM, H200_SXM, A100_80GB"),
    ("recompute", "some", "is not one of none, selective, full"),
    ("gpus", "24", "is not tp x pp x dp x cp = 16"),
    ("metric", "speed", "is not one of tflops_per_gpu_hw"),
    ("value", "-3", "is not a number > 0"),
    ("heads", "15", "is invalid"),
    ("experts", "1", "write 0 for a dense model"),
    ("zero", "4", "is not a ZeRO stage 0-3"),
    ("micro_batch", "0", "is not an integer >= 1"),
    ("source", "", "is empty"),
    ("attention", "fused", "is not one of flash, materialised"),
    ("mlp", "", "is empty"),
    ("mlp", "swiglu", "is not one of gated, plain"),
])
def test_a_malformed_csv_is_one_line_naming_row_and_column(tmp_path, capsys, column, value, why):
    path = _write(tmp_path / "bad.csv", [GOOD, {**GOOD, column: value}])
    with pytest.raises(ValueError) as info:
        R.read_runs(path)
    message = str(info.value)
    assert "\n" not in message and f"row 2 (line 3), column {column}:" in message and why in message
    assert V.main(["--runs", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and f"column {column}" in err


def test_a_malformed_header_or_row_shape_is_named(tmp_path):
    with pytest.raises(ValueError, match="header: column value is missing"):
        R.read_runs(_write(tmp_path / "a.csv", [], header=R.SCHEMA[:-1]))
    with pytest.raises(ValueError, match="header: column speed is not in the schema"):
        R.read_runs(_write(tmp_path / "b.csv", [], header=(*R.SCHEMA, "speed")))
    with pytest.raises(ValueError, match=r"row 1 \(line 2\): 27 columns where the schema has 28"):
        R.read_runs(_write(tmp_path / "c.csv", [[GOOD[c] for c in R.SCHEMA[:-1]]]))
    with pytest.raises(ValueError, match="no runs"):
        R.read_runs(_write(tmp_path / "d.csv", []))
    with pytest.raises(ValueError, match="cannot read it"):
        R.read_runs(tmp_path / "missing.csv")


def test_the_fit_zeroes_the_median_error_of_its_source(tmp_path):
    other = {**GOOD, "source": "another paper, Table 2", "value": "25000"}
    runs = R.read_runs(_write(tmp_path / "runs.csv", [GOOD, {**GOOD, "value": "18000"}, other]))
    value = V.fit_sustained(runs, "a paper")
    with V.sustained(value):
        errors = [V.predict(run)["error"] for run in runs[:2]]
    assert abs(statistics.median(errors)) < 0.01 and 0.4 < value < 1.2
    with pytest.raises(ValueError, match="no run's source starts with it"):
        V.fit_sustained(runs, "nobody")
