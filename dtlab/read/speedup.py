"""Reading the width sweep's curve (``dtlab.experiments.speedup``): its crossover, the verdict, the printed table."""

from __future__ import annotations

import pandas as pd

from dtlab.plots.crossover import crossing

__all__ = ["TOLERANCE", "accuracy", "closest_approach", "crossover", "format_table", "verdict"]

TOLERANCE = 0.30  # the prediction's target: every width's predicted speedup within 30 % of the measured one


def crossover(frame: pd.DataFrame, column: str = "speedup") -> float | None:
    """The width where ``column`` (measured speedup by default) first reaches 1, interpolated in log-width.

    Walking up the widths, the first pair of neighbours with speedup < 1 and
    then >= 1 brackets it; between them the speedup is taken as linear in
    log(width). None if the speedup never reaches 1; the smallest width if it
    is >= 1 already there (data parallelism pays from the first width tried).
    """
    if "width" not in frame.columns or column not in frame.columns:
        raise ValueError(f"crossover: the frame needs columns 'width' and {column!r}; got {list(frame.columns)}")
    df = frame.dropna(subset=["width", column]).sort_values("width")
    return crossing(df["width"].to_numpy(float), df[column].to_numpy(float))


def closest_approach(frame: pd.DataFrame, column: str = "speedup") -> dict[str, float]:
    """The width where ``column`` is largest: {"width", "speedup"} (where the curve comes closest to paying)."""
    df = frame.dropna(subset=[column])
    if df.empty:
        raise ValueError(f"closest_approach: no {column!r} values")
    best = df.loc[df[column].idxmax()]
    return {"width": float(best["width"]), "speedup": float(best[column])}


def verdict(frame: pd.DataFrame) -> str:
    """The answer in a few lines, with this run's numbers: the crossover, or the closest approach; where the
    prediction puts it; and, last, whether the prediction is within ``TOLERANCE`` at every width (``accuracy``)."""
    who = frame.attrs.get("baseline", "ddp vs single")
    measured, predicted = crossover(frame), crossover(frame, "predicted_speedup")
    if measured is not None:
        lines = [f"crossover: ddp beats single from width ≈ {measured:.0f} ({who})"]
    else:
        best = closest_approach(frame)
        row = frame.loc[frame["width"] == best["width"]].iloc[0]
        lines = [f"crossover: none -- ddp never beats single at widths {int(frame['width'].min())}-"
                 f"{int(frame['width'].max())} ({who}); closest at width {best['width']:.0f}: speedup "
                 f"{best['speedup']:.2f} (ddp {row['ddp_ms']:.1f} ms vs single {row['single_ms']:.1f} ms)"]
    lines.append("prediction: " + _predicted_text(frame, predicted))
    if "speedup_vs_1t" in frame.columns:
        one = crossover(frame, "speedup_vs_1t")
        lines.append("against single on 1 thread: " + (f"ddp pays from width ≈ {one:.0f}" if one is not None else
                                                      f"never (at most {frame['speedup_vs_1t'].max():.2f})"))
    if "retimed_error" in frame.columns:
        lines.append("with the compute re-timed instead: " + accuracy(frame, column="retimed_error"))
    if "prediction_error" in frame.columns:
        lines.append(accuracy(frame))
    return "\n".join(lines)


def _predicted_text(frame: pd.DataFrame, predicted: float | None) -> str:
    df = frame.sort_values("width")
    if predicted is None:
        return f"predicts no crossover (at most {df['predicted_speedup'].max():.2f})"
    above = df[df["predicted_speedup"] >= 1]
    if (df.loc[df["width"] >= above["width"].min(), "predicted_speedup"] >= 1).all():
        return f"predicts the crossover at width ≈ {predicted:.0f}"
    where = ", ".join(f"{int(w)} (predicted ddp {p:.3g} ms, measured {m:.3g} ms)"
                      for w, p, m in zip(above["width"], above["predicted_ddp_ms"], above["ddp_ms"]))
    return f"predicts a speedup >= 1 only at width {where}, below 1 elsewhere"


def accuracy(frame: pd.DataFrame, tolerance: float = TOLERANCE, column: str = "prediction_error") -> str:
    """The prediction's verdict in one line: whether every width's predicted speedup is within ``tolerance``
    of the measured one (``column``: ``prediction_error``, or ``retimed_error``), and the worst width with
    its error."""
    err = frame.dropna(subset=[column]).set_index("width")[column]
    if err.empty:
        raise ValueError(f"accuracy: the frame has no {column} values")
    worst = err.abs().idxmax()
    ok = bool((err.abs() <= tolerance).all())
    return (f"every width within {tolerance * 100:g} %: {'yes' if ok else 'no'} "
            f"(worst {int(worst)}: {err[worst] * 100:+.1f} %)")


def format_table(frame: pd.DataFrame) -> str:
    """Per width: the step times, the measured speedup with the rounds' spread, the predicted one and its error."""
    df = frame.copy()
    if {"speedup_min", "speedup_max"} <= set(df.columns):
        df["rounds_min-max"] = [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(df["speedup_min"], df["speedup_max"])]
    cols = ["width", "params", "single_ms", "single_1t_ms", "ddp_ms", "speedup", "rounds_min-max",
            "predicted_speedup", "prediction_error", "retimed_speedup", "retimed_error", "speedup_vs_1t",
            "predicted_single_ms", "predicted_ddp_ms", "retimed_single_ms", "retimed_ddp_ms", "compute_ns_per_byte"]
    fmt = {c: "{:.2f}".format for c in ("single_ms", "single_1t_ms", "ddp_ms", "predicted_single_ms",
                                        "predicted_ddp_ms", "retimed_single_ms", "retimed_ddp_ms", "speedup",
                                        "speedup_vs_1t", "predicted_speedup", "retimed_speedup",
                                        "compute_ns_per_byte")}
    fmt["prediction_error"] = fmt["retimed_error"] = "{:+.0%}".format
    return df[[c for c in cols if c in df.columns]].to_string(index=False, formatters=fmt)
