"""``python -m dtlab.cost.planner.validate``: the planner against the committed table of published runs (out of
sample first, then in-sample), on any CSV in the schema with the committed constants, and a malformed CSV named
by row and column (run in-process: no subprocess)."""

from __future__ import annotations

import contextlib
import csv
import io
import re

import pandas as pd
import pytest

from dtlab.cost.planner import runs as R
from dtlab.cost.planner import validate as V
from dtlab.cost.roofline import devices

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


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """``python -m dtlab.cost.planner.validate --out DIR`` on the committed table, run once: its lines and its CSV."""
    out = tmp_path_factory.mktemp("validation")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert V.main(["--out", str(out)]) == 0
    return printed.getvalue().rstrip().splitlines(), pd.read_csv(out / "planner_validation.csv"), out


def test_the_committed_table_is_validated_out_of_sample_first(committed):
    lines, frame, out = committed
    runs = R.read_runs(V.DEFAULT_RUNS)
    assert all(("Table" in run.source or "table" in run.source) for run in runs)
    first, second = lines[0].split(": ", 1), lines[1].split(": ", 1)
    assert first[0].startswith("leave-one-source-out") and second[0].startswith("in-sample")
    loso, inside = SUMMARY.match(first[1]), SUMMARY.match(second[1])
    assert loso and inside and loso[1] == inside[1] == str(int(frame["scored"].sum()))
    assert (loso[2], loso[3]) != (inside[2], inside[3])  # refitting without a source changes what predicts it
    assert frame["error"].notna().sum() == frame["scored"].sum()  # an unscored row has no error
    assert float(loso[2]) == pytest.approx(100 * frame.loc[frame["scored"], "error"].abs().median(), abs=0.051)
    sources = set(frame.loc[frame["scored"], "source"])
    assert {line.split(":")[0].strip() for line in lines if line.startswith("  ") and " run(s)" in line} == sources
    assert (out / "planner_validation.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.xfail(strict=True, reason="not met: out of sample the H100 runs borrow the A100's constant, small models "
                                       "and the GPU count's costs are missed (docs/measurement.md, 'The planner')")
def test_the_out_of_sample_targets(committed):
    """The targets set for the planner: leave-one-source-out median |error| <= 8 %, worst <= 20 %. Recorded as
    failing, not loosened: a model that meets them turns this test red until the marker goes."""
    lines, _, _ = committed
    loso = SUMMARY.match(lines[0].split(": ", 1)[1])
    assert float(loso[2]) <= 100 * V.TARGETS[0] and abs(float(loso[3])) <= 100 * V.TARGETS[1]


def test_the_docs_show_what_the_command_writes(committed):
    """docs/figures/planner_validation.csv is this command's output on the committed table, number for number."""
    _, frame, _ = committed
    shown = pd.read_csv(V.DEFAULT_RUNS.parents[1] / "docs" / "figures" / "planner_validation.csv")
    assert list(shown.columns) == list(frame.columns) and len(shown) == len(frame)
    for column in ("error", "error_in_sample", "predicted", "low", "high"):
        assert list(shown[column].fillna(-1)) == pytest.approx(list(frame[column].fillna(-1)), rel=1e-9), column


def test_a_runs_file_is_predicted_with_the_committed_constants_never_fitted_on(tmp_path, capsys):
    big = {**GOOD, "model": "GPT 175B", "layers": "96", "hidden": "12288", "heads": "96", "kv_heads": "96",
           "ffn": "49152", "gpus": "16", "tp": "8", "dp": "2", "global_batch": "64"}
    rows = [{**GOOD, "micro_batch": "4"}, {**GOOD, "micro_batch": "4", "value": "40000"}, big]
    path = _write(tmp_path / "runs.csv", rows)
    committed = dict(devices.SUSTAINED)
    assert V.main(["--runs", str(path)]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert devices.SUSTAINED == committed
    match = SUMMARY.match(out[-1])
    assert match and match[1] == "2"  # the third row's choices never fit: listed, not counted
    assert any(line.startswith("  row 3: GPT 175B") and "not scored" in line for line in out)
    expected = V.validate(R.read_runs(path))  # the committed constants, as they are
    assert float(match[2]) == pytest.approx(100 * expected["error"].abs().median(), abs=0.051)
    assert not any(line.startswith(("leave-one-source-out", "in-sample")) for line in out)


def test_any_csv_in_the_schema_is_predicted_at_its_layout(tmp_path):
    fixed = {**GOOD, "micro_batch": "4", "metric": "mfu", "value": "0.5", "attention": "materialised"}
    runs = R.read_runs(_write(tmp_path / "runs.csv", [GOOD, fixed]))
    assert runs[1].model.flash_attention is False and runs[0].model.flash_attention is True
    assert runs[0].model.gated_mlp is False and runs[0].micro_batch is None
    free, pinned = V.predict(runs[0]), V.predict(runs[1])
    assert free["feasible"] and 256 // 8 % free["micro_batch"] == 0 and pinned["micro_batch"] == 4
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


def test_an_empty_attention_is_unpublished_taken_as_the_stated_default_and_said(tmp_path):
    pinned = {**GOOD, "micro_batch": "4"}
    runs = R.read_runs(_write(tmp_path / "runs.csv", [pinned, {**pinned, "attention": ""}]))
    assert runs[0].attention_published and not runs[1].attention_published
    assert runs[1].model.flash_attention is (R.ATTENTION[R.ATTENTION_DEFAULT])
    stated, taken = V.predict(runs[0]), V.predict(runs[1])
    assert taken["predicted"] == stated["predicted"] and stated["note"] == ""
    assert taken["note"] == f"attention not published: taken as {R.ATTENTION_DEFAULT}"


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
    ("attention", "fused", "is not one of flash, materialised (or empty: not published, taken as flash)"),
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
