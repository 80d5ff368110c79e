"""Notebook 19's analysis: published runs on one scale, the critical-batch formulas, the check on this machine's
prediction (on a hand-made roofline and link: no process starts), and the two figures drawn from small tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtlab import plots
from dtlab.cost import critical
from dtlab.cost.links import LinkModel
from dtlab.cost.planner import A100_80GB, H100_SXM, LLAMA2_70B, Layout
from dtlab.cost.planner import published as scaling
from dtlab.cost.planner.runs import read_runs
from dtlab.cost.planner.validate import DEFAULT_RUNS
from dtlab.cost.roofline.cpu import GemmCurve, Overhead, Placement, Roofline
from dtlab.cost.roofline.model import Device
from dtlab.cost.roofline.ops import PHASES
from dtlab.experiments import critical_batch
from tests.test_plots import assert_png, titles


@pytest.fixture(scope="module")
def frame():
    runs = read_runs(DEFAULT_RUNS)
    # dp, tp + pp (A100; H100, not scored), FSDP; the committed constants (out of sample: tests/test_validate.py)
    return scaling.published_frame([runs[0], runs[9], runs[14], runs[50]], out_of_sample=False)


def test_families_sort_layouts_by_what_they_split():
    assert scaling.family(Layout(64, 1, 1, 3, "none", 1, "bf16")) == "data parallel, FSDP"
    assert scaling.family(Layout(1, 8, 1, 0, "none", 1, "bf16")) == "tensor parallel"
    assert scaling.family(Layout(6, 8, 64, 0, "full", 1, "bf16")) == "tensor + pipeline parallel"
    assert scaling.family(Layout(8, 8, 16, 0, "none", 1, "bf16", cp=16)) == "tensor + pipeline parallel"


def test_published_runs_share_one_scale_and_a_step_adds_up(frame):
    assert list(frame["model"]) == ["GPT 1.7B", "GPT 1008B", "Llama 3 405B", "MPT-1B"]
    # every metric is proportional to throughput: the published MFU is the predicted one times published / predicted
    assert list(frame["mfu_published"] / frame["mfu_predicted"]) == pytest.approx(
        list(frame["published"] / frame["predicted"]), nan_ok=True)
    assert list(frame["scored"]) == [True, True, False, True]  # Llama 3: no micro-batch and interleave fits
    assert frame["mfu_predicted"].isna().tolist() == [False, False, True, False]
    assert list(frame["replica_tokens"]) == [512 * 2048 // 32, 3072 * 2048 // 6, 2048 * 8192 // 64, 448 * 2048 // 8]
    one_t = frame.iloc[1]
    assert one_t["metric"] == "tflops_per_gpu_hw" and one_t["hfu_published"] == pytest.approx(163 / 312)
    assert one_t["mfu_published"] < one_t["hfu_published"]  # full recomputation: a fourth pass MFU does not count
    llama = frame.iloc[2]
    assert llama["hfu_published"] == pytest.approx(llama["mfu_published"])  # no recomputation
    assert llama["mfu_published"] == pytest.approx(430e12 / 989.4e12)
    parts = scaling.step_parts(frame)
    assert list(parts.sum(axis=1)) == pytest.approx([1.0] * 4)
    assert parts.loc["GPT 1008B, 3072 x A100_80GB", "pipeline bubble"] > 0.05
    assert "pipeline bubble" in parts and "context-parallel comm." not in parts  # parts no run has are left out


def test_the_formulas_of_intensity_and_critical_batches():
    assert critical.gemm_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3)
    assert critical.gemm_intensity(1, 8192, 8192, 2) == pytest.approx(1.0, rel=1e-3)  # one row: a FLOP per byte
    c, w = 312e12, 24e9
    assert critical.critical_tokens("dp", c, w, 2) == pytest.approx(2 * c / (3 * w))
    assert critical.critical_tokens("fsdp", c, w, 2) == pytest.approx(1.5 * critical.critical_tokens("dp", c, w, 2))
    assert critical.critical_tokens("dp", c, w, 2, n=2) == pytest.approx(c / (3 * w))
    with pytest.raises(ValueError, match="strategy='tp' is invalid"):
        critical.critical_tokens("tp", c, w, 2)
    with pytest.raises(ValueError, match="n=1 is invalid"):
        critical.critical_tokens("dp", c, w, 2, n=1)
    # tensor parallelism: the layer's FLOPs over its four all-reduces are equal at the degree the formula gives
    t = critical.tp_degree(LLAMA2_70B, c, 230e9, 2)
    flops_per_token = 6 * LLAMA2_70B.layer_matmul() / t / c
    bytes_per_token = 8 * (t - 1) / t * 2 * LLAMA2_70B.hidden / 230e9
    assert flops_per_token == pytest.approx(bytes_per_token)


def test_the_critical_table_for_a100_and_h100():
    table = critical.critical_table({"A100": A100_80GB, "H100": H100_SXM}, LLAMA2_70B).set_index(["cluster", "link"])
    assert table.loc[("A100", "NVLink"), "GEMM rows (HBM)"] == pytest.approx(312e12 / 2.039e12)
    assert table.loc[("H100", "NIC"), "dp tokens/GPU"] == pytest.approx(2 * 989.4e12 / (3 * 48e9))
    nic, nvlink = table.loc[("A100", "NIC")], table.loc[("A100", "NVLink")]
    assert nic["dp tokens/GPU"] > 9 * nvlink["dp tokens/GPU"]  # a NIC is ~10x slower than NVLink
    assert nvlink["tp degree (Llama 2 70B)"] > 8 > nic["tp degree (Llama 2 70B)"]  # tp stays inside a node


def tiny_roofline(efficiency: float = 0.5, peak: float = 50e9) -> Roofline:
    dims = (8, 4096)
    curve = GemmCurve(dims, tuple(tuple(tuple(efficiency for _ in dims) for _ in dims) for _ in dims))
    device = Device("test CPU", {"fp32": peak}, 10e9, curve)
    zero = Overhead(dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0))
    return Roofline({(1, 2): Placement(1, 2, device, curve, zero, 0.0)}, {"cores": 2})


BATCHES = (2, 8, 32, 128, 512)


def test_the_critical_batch_is_where_the_predicted_compute_meets_the_all_reduces():
    cfg, link = critical_batch.job(width=256), LinkModel(0.0, 1 / 1e9)
    found = critical_batch.predict(cfg, tiny_roofline(), link, BATCHES)
    compute = [critical_batch._compute_s(cfg, tiny_roofline(), b) for b in (found.batch - 1, found.batch)]
    assert compute[0] < found.comm_s <= compute[1]
    assert found.formula_batch == pytest.approx(0.5 * 4 * 50e9 / (3 * 1e9))
    # the formula takes every GEMM at the peak; at half of it a sample's compute takes twice as long, so the
    # compute catches up with the all-reduces at about half the batch
    assert 0.4 * found.formula_batch < found.batch < 0.6 * found.formula_batch
    assert list(found.curve["batch"]) == list(BATCHES)
    # latency: 2 alpha per tensor
    slower = critical_batch.predict(cfg, tiny_roofline(), LinkModel(50e-6, 1 / 1e9), BATCHES)
    assert slower.comm_s == pytest.approx(found.comm_s + 6 * 2 * 50e-6) and slower.batch > 2 * found.batch
    with pytest.raises(ValueError, match="ddp-naive at world_size >= 2"):
        critical_batch.predict(cfg.replace(tier="ddp"), tiny_roofline(), link)
    with pytest.raises(ValueError, match="up to 512 samples per rank: choose a wider model"):
        critical_batch.predict(cfg, tiny_roofline(), LinkModel(1.0, 1 / 1e9), BATCHES)


class Steps:
    """A run's steady steps, as ``RunResult.steady`` gives them."""

    def __init__(self, rows):
        self.rows = pd.DataFrame(rows, columns=["rank", "step", "forward", "backward", "comm"])

    def steady(self):
        return self.rows


def test_a_runs_compute_is_the_ranks_mean_and_its_communication_the_last_arrivals():
    result = Steps([(0, 1, 1.0, 2.0, 5.0), (1, 1, 2.0, 3.0, 1.0), (0, 2, 1.0, 2.0, 6.0), (1, 2, 1.0, 2.0, 2.0),
                    (0, 3, 9.0, 9.0, 9.0), (1, 3, 9.0, 9.0, 9.0)])
    assert critical_batch._medians(result) == (4.0, 2.0)  # compute: 4, 3, 18 -> 4; comm: 1, 2, 9 -> 2


def sides(below=(1e-3, 4e-3), above=(9e-3, 3e-3)):
    rows = [{"side": s, "batch": b, "compute_s": c, "comm_s": m, "bound": "communication" if m > c else "compute"}
            for s, b, (c, m) in (("below", 25, below), ("above", 400, above))]
    return pd.DataFrame(rows)


def test_confirm_passes_either_side_and_names_a_run_on_the_wrong_side():
    line = critical_batch.confirm(sides())
    assert line.startswith("25 samples per rank: the all-reduces took 4.0x the compute")
    assert "400: the compute took 3.0x the all-reduces (compute-bound), as predicted" in line
    with pytest.raises(AssertionError, match="at 25 samples per rank .below the predicted critical batch. the run "
                                             "was compute-bound"):
        critical_batch.confirm(sides(below=(5e-3, 4e-3)))
    with pytest.raises(AssertionError, match="at 400 samples per rank .above"):
        critical_batch.confirm(sides(above=(1e-3, 3e-3)))
    # compute / comm is 1/4 at 25 and 3 at 400: as a power of the batch it is 1 at 25 x 16^(ln 4 / ln 12)
    assert critical_batch.crossing(sides()) == pytest.approx(25 * 16 ** (np.log(4) / np.log(12)))
    with pytest.raises(ValueError, match="below must be communication-bound"):
        critical_batch.crossing(sides(below=(5e-3, 4e-3)))


def test_published_scaling_draws_each_family_side_by_side(frame, tmp_path):
    fig = plots.published_scaling(frame)
    assert titles(fig)[1:] == ["data parallel, FSDP (2 runs)", "tensor + pipeline parallel (2 runs)"]
    drawn = {(round(x), round(y, 6)) for c in fig.axes[1].collections for x, y in c.get_offsets()}
    pipelined = frame.iloc[1:3]  # the second (Llama 3) is not scored: its published point alone
    assert drawn == {(g, round(100 * v, 6)) for g, a, b in zip(pipelined["gpus"], pipelined["mfu_published"],
                                                              pipelined["mfu_predicted"], strict=True)
                     for v in (a, b) if v == v}
    assert_png(fig, tmp_path / "scaling.png")
    with pytest.raises(ValueError, match="missing column"):
        plots.published_scaling(frame.drop(columns="mfu_predicted"))


def test_critical_batch_draws_the_predicted_lines_the_runs_and_the_critical_point(tmp_path):
    curve = pd.DataFrame({"batch": [2, 64, 2048], "compute_s": [1e-4, 2e-3, 6e-2], "comm_s": [4e-3] * 3})
    fig = plots.critical_batch(curve, sides(), 120, formula_batch=90)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["compute, predicted (the roofline)"].get_ydata()) == pytest.approx([0.1, 2.0, 60.0])
    assert list(lines["critical batch, predicted: 120"].get_xdata()) == [120, 120]
    assert "formula (n-1)/n b C / (3W): 90" in lines
    comm = next(c for c in ax.collections if c.get_label() == "all-reduces, measured")
    assert comm.get_offsets().ravel().tolist() == pytest.approx([25, 4.0, 400, 3.0])
    assert_png(fig, tmp_path / "critical.png")


def test_predicted_against_published_draws_a_point_per_scored_run_in_each_panel(tmp_path):
    table = pd.DataFrame({"source": ["a", "a", "b", "c"], "gpu": ["A100_80GB", "H100_SXM", "A100_80GB", "H100_SXM"],
                          "mfu_published": [0.40, 0.50, 0.30, 0.45], "mfu_predicted": [0.44, 0.40, 0.33, np.nan],
                          "mfu_predicted_in_sample": [0.41, 0.48, 0.31, np.nan]})
    fig = plots.predicted_against_published(table)
    left, right = fig.axes[:2]
    for ax, column in ((left, "mfu_predicted"), (right, "mfu_predicted_in_sample")):
        drawn = sorted((round(x, 6), round(y, 6)) for c in ax.collections for x, y in c.get_offsets())
        assert drawn == sorted((round(100 * p, 6), round(100 * q, 6)) for p, q in
                               zip(table["mfu_published"][:3], table[column][:3], strict=True))
    assert left.get_title().startswith("leave-one-source-out: median |error| 10.0 %, worst 20.0 % (3 runs)")
    assert right.get_title().startswith("in-sample:")
    assert "c (not scored)" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(plots.predicted_against_published(table.drop(columns="mfu_predicted_in_sample")).axes) == 1
    assert_png(fig, tmp_path / "against.png")
    with pytest.raises(ValueError, match="missing column"):
        plots.predicted_against_published(table.drop(columns="gpu"))
