"""The command line writes the four result files, and refuses bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from dtlab.cli import main
from dtlab.results import load_params

pytestmark = pytest.mark.usefixtures("no_survivors")


def test_single_tier_writes_all_files_and_they_load(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dtlab", "run", "--tier", "single", "--world-size", "1",
                           "--steps", "12", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "result.json").read_text())
    assert summary["tier"] == "single" and summary["world_size"] == 1 and summary["steps"] == 12
    for key in ("median_step_s", "samples_per_s", "final_loss", "test_accuracy", "comm", "memory_rank0"):
        assert key in summary
    assert {"parameters", "gradients", "optimizer_state", "activations", "peak_rss"} <= set(summary["memory_rank0"])
    assert summary["provenance"]["torch"] == torch.__version__
    events = pd.read_csv(out / "events.csv")
    assert list(events.columns[:4]) == ["rank", "seq", "op", "bytes"]
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("name") == "forward" for e in trace["traceEvents"])
    params = load_params(out / "params.pt")
    assert set(params) == {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
    assert not list(out.glob("*.tmp"))


def test_ddp_tier_options_and_comm_counts(tmp_path, capsys):
    out = tmp_path / "ddp"
    code = main(["run", "--tier", "ddp", "--world-size", "2", "--steps", "5", "--out", str(out), "--quiet",
                 "--opt", "bucket_cap_mb=0.01", "--threads", "1"])
    assert code == 0
    summary = json.loads((out / "result.json").read_text())
    assert summary["config"]["tier_options"]["bucket_cap_mb"] == 0.01
    buckets = summary["strategy"]["num_buckets"]
    assert buckets > 1
    # steps 1-4 reduce every bucket once; step 0 runs before DDP rebuilds its buckets (one bucket)
    assert summary["comm"]["all_reduce"]["calls"] == 1 + 4 * buckets
    assert "ddp x2" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["run", "--tier", "ddp", "--world-size", "0"], "world_size"),
    (["run", "--tier", "ddp", "--opt", "bucket_cap_mb=-1"], "bucket_cap_mb"),
    (["run", "--tier", "ddp", "--opt", "no_such=1"], "bucket_cap_mb"),  # lists the valid options
    (["run", "--model", "nowhere.module:factory"], "model"),
    (["compare", "--tiers", "single,teleport"], "teleport"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_compare_reports_parity_for_each_tier(tmp_path, capsys):
    code = main(["compare", "--tiers", "single,ddp-naive,ddp", "--world-sizes", "2", "--steps", "6", "--out",
                 str(tmp_path), "--quiet", "--threads", "1"])
    assert code == 0
    table = pd.read_csv(tmp_path / "compare.csv")
    assert list(table["tier"]) == ["single", "ddp-naive", "ddp"]
    assert (table["max_param_diff_vs_single"] <= 1e-5).all()
    assert (tmp_path / "ddp-w2" / "result.json").exists()
