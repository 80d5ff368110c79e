"""The speedup-vs-width sweep: where ddp starts to beat one process, its crossover and its plot."""

from __future__ import annotations

import dataclasses
import inspect
import math
import types

import pandas as pd
import pytest

from dtlab.cost import links as costmodel
from dtlab.cost.estimate import calibration, step
from dtlab.cost.links.alpha_beta import coefficients
from dtlab.cost.links.bound import BOUND_NOTE, bounding_link
from dtlab.cost.links.linkset import calibrate_ops
from dtlab.cost.roofline.cpu import Roofline
from dtlab.experiments import speedup as sp
from dtlab.plots import save
from dtlab.plots.crossover import PREDICTION_LABEL, RETIMED_LABEL, crossing, speedup_curve
from tests import bench_scripts

NO_ROOFLINE = Roofline({})  # where the estimator's step rule is replaced, the roofline is never read

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
    assert f"{PREDICTION_LABEL};\n≥ 1 only at width 128" in labels


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
    assert any(label.startswith(f"{PREDICTION_LABEL};\nbreak-even at width ≈") for label in labels)
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
                                        ({"global_batch": 31}, "divisible"), ({"widths": []}, "widths")])
def test_sweep_rejects_bad_arguments_before_starting(bad, match):
    kwargs = {"widths": [16], "steps": 6, "global_batch": 32, **bad}
    with pytest.raises(ValueError, match=match):
        sp.speedup_sweep(kwargs.pop("widths"), **kwargs)


def _measured(cfg) -> dict:
    """A measured run's numbers without a process: single 10 ms, ddp 20 ms, the rest 12 ms."""
    step_s = {"single": 0.010, "ddp": 0.020}.get(cfg.tier, 0.012)
    sizes = [4 * cfg.model_size ** 2] if cfg.tier == "ddp" else []
    return {"step_s": step_s, "bucket_sizes_bytes": sizes, "params": cfg.model_size ** 2}


def test_the_prediction_is_the_estimators_step_rule_on_a_link_calibrated_in_the_run(monkeypatch):
    calls = []

    def predict(cfg, model, link, compute):  # the estimator's step rule, as estimate() calls it
        calls.append((cfg.tier, cfg.world_size, cfg.resolved_threads, link.busy_s, compute == "timed"))
        if compute != "timed":
            assert compute is NO_ROOFLINE  # the sweep's roofline, handed on as the estimator's compute
        # predicted compute: single 10 ms, ddp 16 ms; re-timed: single 12 ms, ddp 15 ms
        return {("single", False): 0.010, ("ddp", False): 0.016, ("single", True): 0.012,
                ("ddp", True): 0.015}[(cfg.tier, compute == "timed")], []

    monkeypatch.setattr(step, "predict", predict)
    monkeypatch.setattr(sp, "_numbers", _measured)
    link = costmodel.LinkModel(alpha_s=2e-4, beta_s_per_byte=1.5e-9)
    monkeypatch.setattr(sp, "calibrate_link", lambda n, ops, quick: link)
    busy = iter([0.001, 0.002])  # measured again as each round starts
    monkeypatch.setattr(calibration, "with_busy", lambda lk, n, rounds: dataclasses.replace(lk, busy_s=next(busy)))
    df = sp.speedup_sweep([16], global_batch=32, steps=5, rounds=2, cores=2, roofline=NO_ROOFLINE)
    assert sorted(calls) == sorted([("single", 1, 2, b, t) for b in (0.001, 0.002) for t in (False, True)]
                                   + [("ddp", 2, 1, b, t) for b in (0.001, 0.002) for t in (False, True)])
    assert list(df["predicted_single_ms"]) == pytest.approx([10.0])
    assert list(df["predicted_ddp_ms"]) == pytest.approx([16.0])
    assert list(df["predicted_speedup"]) == pytest.approx([0.625])
    assert list(df["speedup"]) == pytest.approx([0.5])
    assert list(df["prediction_error"]) == pytest.approx([0.25])  # 0.625 / 0.5 - 1
    assert list(df["retimed_speedup"]) == pytest.approx([0.8]) and list(df["retimed_error"]) == pytest.approx([0.6])
    assert df.attrs["busy_ms"] == "1.00/2.00" and list(df["rounds"]) == [2]
    assert len(df.attrs["load"].split("/")) == 3  # the load average at the start and after each round
    lines = sp.verdict(df).splitlines()
    assert lines[-2] == "with the compute re-timed instead: every width within 30 %: no (worst 16: +60.0 %)"
    assert lines[-1] == "every width within 30 %: yes (worst 16: +25.0 %)"


def test_the_sweep_has_no_prediction_rule_of_its_own():
    source = inspect.getsource(sp)
    for gone in ("predict_ddp_step", "ddp_overhead", "overhead_single", "costmodel.calibrate("):
        assert gone not in source, gone
    assert not hasattr(sp, "_overhead_plan") and not hasattr(sp, "CALIBRATION_SIZES")
    assert sp.calibrate_link is calibration.calibrate_link  # the calibration benchmarks/estimate_error.py uses


def test_accuracy_names_the_worst_width():
    df = frame([0.5, 0.6, 0.7], predicted=[0.55, 0.5, 0.9])
    df["prediction_error"] = df["predicted_speedup"] / df["speedup"] - 1
    assert sp.accuracy(df) == "every width within 30 %: yes (worst 256: +28.6 %)"
    df.loc[1, "prediction_error"] = -0.4
    assert sp.accuracy(df) == "every width within 30 %: no (worst 128: -40.0 %)"
    assert sp.verdict(df).splitlines()[-1] == sp.accuracy(df)


def test_plot_shades_the_rounds_and_says_what_the_prediction_includes():
    df = frame([0.5, 0.8, 1.2], predicted=[0.6, 0.9, 1.1])
    df["speedup_min"], df["speedup_max"] = df["speedup"] - 0.1, df["speedup"] + 0.1
    df.attrs["rounds"] = 3
    fig = speedup_curve(df)
    ax = fig.axes[0]
    (band,) = [c for c in ax.collections if c.get_label().startswith("measured: min-max")]
    assert band.get_label() == "measured: min-max of 3 rounds"
    lo, hi = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (lo, hi) == pytest.approx((0.4, 1.3))
    legend = " ".join(t.get_text() for t in fig.legends[0].get_texts()).replace("\n", " ")
    for part in ("dtlab.estimate", "compute on this machine's roofline", "link calibrated in this run",
                 "wake-up excess", "min-max of 3 rounds"):
        assert part in legend, part
    assert "re-timed" not in legend  # no re-timed column, no re-timed line
    assert "(×)" in ax.get_ylabel() and "hidden units" in ax.get_xlabel()


def test_the_re_timed_comparison_is_drawn_and_named():
    df = frame([0.5, 0.8, 1.2], predicted=[0.6, 0.9, 1.1])
    df["retimed_speedup"] = [0.4, 0.7, 1.3]
    ax = speedup_curve(df).axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == RETIMED_LABEL]
    assert line.get_linestyle() == "--" and list(line.get_ydata()) == [0.4, 0.7, 1.3]
    assert "re-timed" in RETIMED_LABEL and "roofline" in PREDICTION_LABEL
    df["prediction_error"], df["retimed_error"] = [0.1, -0.2, 0.05], [-0.35, 0.1, 0.0]
    assert sp.verdict(df).splitlines()[-2:] == [
        "with the compute re-timed instead: every width within 30 %: no (worst 64: -35.0 %)",
        "every width within 30 %: yes (worst 128: -20.0 %)"]
    assert "retimed_speedup" in sp.format_table(df) and "retimed_error" in sp.format_table(df)


@pytest.mark.slow
def test_sweep_on_two_tiny_widths(monkeypatch, no_survivors):
    # measured for real; the prediction's compute is fixed here (main's test below times it for real)
    monkeypatch.setattr(step, "predict", lambda cfg, model, link, compute: (0.004 * cfg.world_size, []))
    link = costmodel.LinkModel(alpha_s=2e-4, beta_s_per_byte=1.5e-9)  # given: no calibration sweep
    lines = []
    df = sp.speedup_sweep([32, 16], global_batch=32, steps=5, rounds=1, link=link, roofline=NO_ROOFLINE,
                          progress=lines.append)
    assert list(df.columns) == list(sp.COLUMNS)
    assert list(df["width"]) == [16, 32]
    for col in ("single_ms", "single_1t_ms", "ddp_ms", "compute_ms", "predicted_ddp_ms"):
        assert (df[col] > 0).all(), col
    # one round: its speedup is the median, the min and the max
    assert df["speedup"].to_numpy() == pytest.approx((df["single_ms"] / df["ddp_ms"]).to_numpy())
    assert df["speedup_min"].to_numpy() == pytest.approx(df["speedup_max"].to_numpy())
    assert df["speedup_vs_1t"].to_numpy() == pytest.approx((df["single_1t_ms"] / df["ddp_ms"]).to_numpy())
    assert list(df["predicted_speedup"]) == pytest.approx([0.5, 0.5])
    # an MLP 64 -> w -> w -> 10 has 64w + w + w^2 + w + 10w + 10 parameters, all-reduced as fp32
    assert list(df["params"]) == [w * w + 76 * w + 10 for w in (16, 32)]
    assert list(df["gradient_bytes"]) == [4 * p for p in df["params"]]
    assert "2 ranks" in df.attrs["baseline"] and df.attrs["global_batch"] == 32
    assert lines and lines[-1].startswith("round 1/1")


@pytest.mark.slow
def test_main_calibrates_and_writes_the_table_and_figure(monkeypatch, tmp_path, capsys, no_survivors):
    # the link is calibrated and busy_s measured for real; the prediction's compute timing is fixed (it spawns
    # processes for seconds; notebook 11, executed by the test suite, runs the sweep with it for real)
    monkeypatch.setattr(step, "predict", lambda cfg, model, link, compute: (0.004 * cfg.world_size + link.busy_s,
                                                                            []))
    out = tmp_path / "demo"
    saved = NO_ROOFLINE.save(tmp_path / "roofline.json")  # measuring one is tests/test_roofline.py's
    assert sp.main(["--out", str(out), "--widths", "16", "--steps", "5", "--rounds", "1", "--global-batch", "32",
                    "--roofline", str(saved), "--quick", "--runs", "2"]) == 0
    table = pd.read_csv(out / "crossover.csv")
    assert list(table.columns) == list(sp.COLUMNS) and len(table) == 1
    runs = pd.read_csv(out / "crossover_runs.csv")  # every run kept, the last one the table and the figure's
    assert list(runs["run"]) == [1, 2] and list(runs.columns[:len(sp.COLUMNS)]) == list(sp.COLUMNS)
    assert runs.iloc[-1]["speedup"] == pytest.approx(table.iloc[0]["speedup"])
    assert table[["predicted_single_ms", "predicted_ddp_ms", "prediction_error", "retimed_speedup",
                  "retimed_error"]].notna().all().all()
    assert (out / "crossover.png").stat().st_size > 0
    assert not (out / "speedup.png").exists()  # compare writes its own speedup.png into the same folder
    printed = capsys.readouterr().out
    assert "link: all_reduce:" in printed and "round 1: busy_s" in printed
    assert "crossover:" in printed and "prediction:" in printed and "run 1/2:" in printed
    assert printed.strip().splitlines()[-1].startswith("every width within 30 %: ")


def _synthetic_sweep(beta: float) -> pd.DataFrame:
    sizes = (4096, 65536, 1 << 20, 4 << 20)
    return pd.DataFrame([{"op": op, "bytes": b, "group_size": 2, "repeat": r, "seconds": 1e-4 + beta * b,
                          "outlier": False} for op in calibration.LINK_OPS for b in sizes for r in range(3)])


def test_an_unfittable_calibration_sweep_is_swept_once_more_then_named(monkeypatch):
    sweeps = iter([_synthetic_sweep(-1e-12), _synthetic_sweep(1e-9)])  # a stalled sweep, then a sound one
    monkeypatch.setattr(calibration.collectives, "sweep", lambda *a, **k: next(sweeps))
    with pytest.warns(UserWarning, match="sweep 1 could not be fitted.*sweeping again"):
        link = calibration.calibrate_link(2, quick=True)
    assert link.links["all_reduce"].beta_s_per_byte == pytest.approx(1e-9, rel=1e-3)
    # loaded twice: the link is bounded (alpha from the smallest message, beta from the largest), said in one line
    monkeypatch.setattr(calibration.collectives, "sweep", lambda *a, **k: _synthetic_sweep(-1e-12))
    with pytest.warns(UserWarning, match="sweep 2 could not be fitted either .*going on with the bounded"):
        bounded = calibration.calibrate_link(2, quick=True)
    ar = bounded.links["all_reduce"]
    a, b = coefficients("all_reduce", 2)
    assert ar.alpha_s == pytest.approx((1e-4 - 1e-12 * 4096) / a) and ar.beta_s_per_byte > 0
    assert ar.beta_s_per_byte == pytest.approx((1e-4 - 1e-12 * (4 << 20)) / (b * (4 << 20)))
    assert BOUND_NOTE in ar.label
    # without a fallback the caller still gets the error
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no positive per-byte cost"):
        calibration.fitted_sweep(lambda: _synthetic_sweep(-1e-12), lambda f: calibrate_ops(f, ("all_reduce",)))


def test_a_loaded_sweep_gives_a_bounded_link_and_no_traceback():
    loaded = _synthetic_sweep(-1e-12)
    link = bounding_link(loaded, "all_gather")
    a, b = coefficients("all_gather", 2)
    assert link.alpha_s == pytest.approx((1e-4 - 1e-12 * 4096) / a) and link.beta_s_per_byte > 0
    assert link.predict("all_gather", 4 << 20) >= 1e-4 - 1e-12 * (4 << 20)  # never below what the largest took
    with pytest.raises(ValueError, match="no broadcast on more than one rank"):
        bounding_link(loaded[loaded["op"] != "broadcast"], "broadcast")


def test_the_cost_model_benchmark_sweeps_its_calibration_again_where_the_first_cannot_be_fitted(monkeypatch):
    bench = bench_scripts.load("costmodel_error")
    sweeps = iter([_synthetic_sweep(-1e-12), _synthetic_sweep(2e-9)])
    monkeypatch.setattr(bench.collectives, "sweep", lambda *a, **k: next(sweeps))
    with pytest.warns(UserWarning, match="sweep 1 could not be fitted"):
        link, fit, sweep = bench.calibrate(types.SimpleNamespace(quick=True))
    assert link.beta_s_per_byte == pytest.approx(2e-9, rel=1e-3) and len(fit) and len(sweep)
