"""The speedup-vs-width sweep: where ddp starts to beat one process, its crossover and its plot."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dtlab.analysis import costmodel
from dtlab.analysis import speedup as sp
from dtlab.plots import save
from dtlab.plots.crossover import crossing, speedup_curve

WIDTHS = [64, 128, 256, 512, 1024]


def frame(speedups, predicted=None, widths=WIDTHS) -> pd.DataFrame:
    df = pd.DataFrame({"width": widths[:len(speedups)], "speedup": speedups})
    df["single_ms"] = 10.0
    df["ddp_ms"] = df["single_ms"] / df["speedup"]
    df["gradient_bytes"] = [4 * (w * w + 74 * w + 10) for w in df["width"]]
    if predicted is not None:
        df["predicted_speedup"] = predicted
    return df


# -- crossover ---------------------------------------------------------------------------------------------------
def test_crossover_interpolates_in_log_width():
    # 0.8 at 128, 1.2 at 256: halfway in speedup is halfway in log-width, the geometric mean
    assert sp.crossover(frame([0.5, 0.8, 1.2, 1.5, 1.6])) == pytest.approx(math.sqrt(128 * 256))
    # a quarter of the way: 0.9 -> 1.3 reaches 1 at 1/4
    assert sp.crossover(frame([0.5, 0.9, 1.3, 1.5, 1.6])) == pytest.approx(128 * 2 ** 0.25)


def test_no_crossover_is_none():
    assert sp.crossover(frame([0.2, 0.4, 0.6, 0.8, 0.95])) is None


def test_crossover_between_the_last_two_points():
    assert sp.crossover(frame([0.2, 0.4, 0.6, 0.9, 1.1])) == pytest.approx(math.sqrt(512 * 1024))


def test_crossover_exactly_at_a_point_and_from_the_start():
    assert sp.crossover(frame([0.5, 1.0, 1.2])) == pytest.approx(128)
    assert sp.crossover(frame([1.1, 1.2, 1.3])) == 64  # pays from the first width tried


def test_crossover_is_the_first_one_and_ignores_row_order():
    df = frame([0.5, 1.5, 0.9, 1.2, 1.3]).iloc[::-1]  # dips below again at 256: the first crossing counts
    assert sp.crossover(df) == pytest.approx(math.sqrt(64 * 128))


def test_crossover_of_another_column_and_a_missing_one():
    df = frame([0.2, 0.4, 0.6, 0.8, 0.9], predicted=[0.5, 0.8, 1.2, 1.5, 1.6])
    assert sp.crossover(df) is None
    assert sp.crossover(df, "predicted_speedup") == pytest.approx(math.sqrt(128 * 256))
    with pytest.raises(ValueError, match="speedup_vs_1t"):
        sp.crossover(df, "speedup_vs_1t")


def test_crossing_checks_its_input():
    with pytest.raises(ValueError, match="ascending"):
        crossing([128, 64], [0.5, 1.5])
    with pytest.raises(ValueError, match="> 0"):
        crossing([0, 64], [0.5, 1.5])


def test_closest_approach_and_verdict():
    df = frame([0.3, 0.6, 0.8, 0.7, 0.65], predicted=[0.4, 0.7, 0.9, 0.95, 0.97])
    assert sp.closest_approach(df) == {"width": 256.0, "speedup": 0.8}
    text = sp.verdict(df)
    assert "never beats single" in text and "closest at width 256: speedup 0.80" in text
    assert "predicts no crossover (at most 0.97)" in text
    assert "beats single from width ≈ 181" in sp.verdict(frame([0.5, 0.8, 1.2, 1.5, 1.6], predicted=[1] * 5))


def test_a_prediction_that_crosses_and_falls_back_is_not_called_a_crossover():
    df = frame([0.3, 0.35, 0.4, 0.6, 0.7], predicted=[0.9, 1.1, 0.7, 0.7, 0.8])
    df["predicted_ddp_ms"] = df["single_ms"] / df["predicted_speedup"]
    text = sp.verdict(df)
    assert "predicts a speedup >= 1 only at width 128 (predicted ddp 9.09 ms, measured 28.6 ms)" in text
    labels = [ln.get_label() for ln in speedup_curve(df).axes[0].get_lines()]
    assert "cost model prediction, ≥ 1 only at width 128" in labels


# -- the plot ----------------------------------------------------------------------------------------------------
def _break_even(ax):
    return [ln for ln in ax.get_lines() if ln.get_label().startswith("break-even")]


def test_plot_marks_the_crossover(tmp_path):
    df = frame([0.5, 0.8, 1.2, 1.5, 1.6], predicted=[0.6, 0.9, 1.1, 1.4, 1.5])
    df.attrs["baseline"] = "ddp: 2 ranks × 1 thread vs single: 1 process × 2 threads"
    fig = speedup_curve(df)
    ax = fig.axes[0]
    assert "width" in ax.get_xlabel() and "speedup" in ax.get_ylabel()
    assert ax.get_xscale() == "log"
    (line,) = _break_even(ax)
    assert list(line.get_ydata()) == [1, 1]
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert any(label.startswith("measured break-even: width ≈ 181") for label in labels)
    assert any(label.startswith("cost model prediction, break-even at width ≈") for label in labels)
    assert ax.get_title() == df.attrs["baseline"]
    assert save(fig, tmp_path / "crossover.png").stat().st_size > 0


def test_plot_annotates_the_closest_approach_without_a_crossover():
    fig = speedup_curve(frame([0.3, 0.6, 0.8, 0.7, 0.65]))
    ax = fig.axes[0]
    assert _break_even(ax)
    assert not any(ln.get_label().startswith("measured break-even") for ln in ax.get_lines())
    notes = [t.get_text() for t in ax.texts]
    assert any(n.startswith("closest: ×0.80 at width 256") for n in notes)


def test_plot_needs_width_and_speedup():
    with pytest.raises(ValueError, match="speedup"):
        speedup_curve(pd.DataFrame({"width": [64]}))


# -- the sweep ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [({"world_size": 1}, "at least 2 ranks"), ({"steps": 3}, "steps=3"),
                                        ({"global_batch": 30}, "divisible"), ({"widths": []}, "widths")])
def test_sweep_rejects_bad_arguments_before_starting(bad, match):
    kwargs = {"widths": [16], "steps": 6, "global_batch": 32, **bad}
    with pytest.raises(ValueError, match=match):
        sp.speedup_sweep(kwargs.pop("widths"), **kwargs)


@pytest.mark.slow
def test_sweep_on_two_tiny_widths(no_survivors):
    link = costmodel.LinkModel(alpha_s=2e-4, beta_s_per_byte=1.5e-9)  # given: no calibration sweep
    lines = []
    df = sp.speedup_sweep([32, 16], global_batch=32, steps=5, rounds=1, link=link, progress=lines.append)
    assert list(df.columns) == list(sp.COLUMNS)
    assert list(df["width"]) == [16, 32]
    for col in ("single_ms", "single_1t_ms", "ddp_ms", "compute_ms", "predicted_ddp_ms"):
        assert (df[col] > 0).all(), col
    assert df["speedup"].to_numpy() == pytest.approx((df["single_ms"] / df["ddp_ms"]).to_numpy())
    assert df["speedup_vs_1t"].to_numpy() == pytest.approx((df["single_1t_ms"] / df["ddp_ms"]).to_numpy())
    assert df["predicted_speedup"].to_numpy() == pytest.approx((df["single_ms"] / df["predicted_ddp_ms"]).to_numpy())
    # an MLP 64 -> w -> w -> 10 has 64w + w + w^2 + w + 10w + 10 parameters, all-reduced as fp32
    assert list(df["params"]) == [w * w + 76 * w + 10 for w in (16, 32)]
    assert list(df["gradient_bytes"]) == [4 * p for p in df["params"]]
    # a prediction has at least one all-reduce in it: alpha twice on 2 ranks, plus the bytes
    assert (df["predicted_comm_ms"] >= 2 * link.alpha_s * 1e3).all()
    assert "2 ranks" in df.attrs["baseline"] and df.attrs["global_batch"] == 32
    assert lines and lines[-1].startswith("round 1/1")


@pytest.mark.slow
def test_main_calibrates_and_writes_the_table_and_figure(tmp_path, capsys, no_survivors):
    out = tmp_path / "demo"
    assert sp.main(["--out", str(out), "--widths", "16", "--steps", "5", "--rounds", "1", "--global-batch", "32"]) == 0
    table = pd.read_csv(out / "crossover.csv")
    assert list(table.columns) == list(sp.COLUMNS) and len(table) == 1
    assert (out / "crossover.png").stat().st_size > 0
    assert not (out / "speedup.png").exists()  # compare writes its own speedup.png into the same folder
    printed = capsys.readouterr().out
    assert "link: gloo loopback all_reduce, calibrated at n=2" in printed
    assert "crossover:" in printed and "cost model:" in printed
