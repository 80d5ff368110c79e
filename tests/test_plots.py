"""Every plot renders a readable PNG from a small hand-made DataFrame."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from dtlab import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PHASE_MS = {"data": 2.0, "forward": 8.0, "backward": 15.0, "comm": 5.0, "optimizer": 1.5}
OPS = ("all_reduce", "broadcast")


def assert_png(fig, path):
    """The file is a PNG that decodes and is drawn on (more than a few colours); what is drawn, each test checks
    on the figure's artists."""
    from matplotlib.image import imread

    out = plots.save(fig, path)
    assert out.read_bytes()[:8] == PNG_MAGIC
    pixels = imread(out)[::3, ::3]
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 16


def titles(fig) -> list[str]:
    sup = fig.get_suptitle()
    return [t for t in [sup, *(ax.get_title() for ax in fig.axes)] if t]


def trace(ranks=2, steps=3, t0=1.7e9):
    """Phases and comm events like the Recorder's, on a time.time()-like clock."""
    phases, events = [], []
    for rank in range(ranks):
        t = t0 + 0.0003 * rank
        for step in range(steps):
            for name, ms in PHASE_MS.items():
                phases.append({"rank": rank, "phase": name, "start": t, "end": t + ms / 1e3, "step": step})
                if name == "comm":
                    for i, op in enumerate(OPS):
                        start = t + i * ms / 2e3
                        events.append({"rank": rank, "op": op, "bytes": 4 << 20, "start": start,
                                       "end": start + ms / 2.5e3, "step": step, "tag": f"ddp_bucket:{i}"})
                t += ms / 1e3
    return pd.DataFrame(events), pd.DataFrame(phases)


def test_import_leaves_backend_alone():
    code = "import matplotlib, dtlab.plots; import sys; assert 'matplotlib.pyplot' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_speedup(tmp_path):
    df = pd.DataFrame({
        "tier": ["single", "ddp", "ddp", "ddp", "fsdp", "fsdp", "fsdp"],
        "world_size": [1, 1, 2, 4, 1, 2, 4],
        "samples_per_s": [1000.0, 980.0, 1850.0, 3300.0, 950.0, 1700.0, 2900.0],
    })
    fig = plots.speedup(df)
    assert_png(fig, tmp_path / "speedup.png")
    ax_s, ax_e = fig.axes
    assert any("ideal" in line.get_label() for line in ax_s.get_lines())
    assert "%" in ax_e.get_ylabel() and "processes" in ax_s.get_xlabel()
    assert titles(fig)
    ddp = next(line for line in ax_s.get_lines() if line.get_label() == "ddp")
    np.testing.assert_allclose(ddp.get_ydata(), [0.98, 1.85, 3.3])


def test_speedup_without_single_uses_each_tiers_world_one():
    df = pd.DataFrame({"tier": ["ddp", "ddp"], "world_size": [1, 2], "samples_per_s": [500.0, 900.0]})
    line = next(ln for ln in plots.speedup(df).axes[0].get_lines() if ln.get_label() == "ddp")
    np.testing.assert_allclose(line.get_ydata(), [1.0, 1.8])


def test_step_breakdown(tmp_path):
    df = pd.DataFrame([
        {"label": "single", **{k: v / 1e3 for k, v in PHASE_MS.items()}, "comm": 0.0},
        {"label": "ddp w2", **{k: v / 1e3 for k, v in PHASE_MS.items()}, "idle": 0.004},
        {"label": "fsdp w4", **{k: v / 1e3 for k, v in PHASE_MS.items()}, "comm": 0.012, "idle": 0.002},
    ])
    fig = plots.step_breakdown(df)
    assert_png(fig, tmp_path / "steps.png")
    (ax,) = fig.axes
    assert "ms" in ax.get_xlabel() and titles(fig)
    assert len(ax.patches) == 3 * 6  # three runs, six phases with idle
    # each run's bars add up to its phases in ms (comm and idle as given, missing ones 0)
    per_run = np.zeros(3)
    for bar in ax.patches:
        per_run[round(bar.get_y() + bar.get_height() / 2)] += bar.get_width()
    expected = df.drop(columns="label").fillna(0).sum(axis=1).to_numpy() * 1e3
    assert sorted(per_run) == pytest.approx(sorted(expected))


def test_timeline(tmp_path):
    events, phases = trace()
    fig = plots.timeline(events, phases)
    assert_png(fig, tmp_path / "timeline.png")
    (ax,) = fig.axes
    assert "ms" in ax.get_xlabel() and titles(fig)
    assert len(ax.patches) == len(events) + len(phases)
    labels = fig.legends[0].get_texts()
    assert {t.get_text() for t in labels} == set(PHASE_MS) | set(OPS)


def test_timeline_selects_steps():
    events, phases = trace(ranks=2, steps=4)
    per_step = 2 * (len(PHASE_MS) + len(OPS))
    assert len(plots.timeline(events, phases, step=1).axes[0].patches) == per_step
    assert len(plots.timeline(events, phases, step=range(1, 3)).axes[0].patches) == 2 * per_step
    ax = plots.timeline(events, phases, step=2).axes[0]
    assert min(p.get_x() for p in ax.patches) == pytest.approx(0.0)  # x starts at the shown step


def test_timeline_without_events(tmp_path):
    _, phases = trace()
    for events in (None, pd.DataFrame(), pd.DataFrame(columns=["rank", "op", "start", "end", "step"])):
        fig = plots.timeline(events, phases, step=0)
        assert len(fig.axes[0].patches) == 2 * len(PHASE_MS)
    assert_png(fig, tmp_path / "timeline_no_events.png")


def test_timeline_unknown_step_raises():
    events, phases = trace()
    with pytest.raises(ValueError, match="nothing recorded"):
        plots.timeline(events, phases, step=99)


MIB = 2**20


@pytest.mark.parametrize("scale, unit", [(MIB, "MiB"), (1, "KiB")])
def test_memory_breakdown(tmp_path, scale, unit):
    df = pd.DataFrame({
        "label": ["single rank 0", "ddp w2 rank 0", "fsdp w2 rank 0", "fsdp w2 rank 1"],
        "parameters": [40 * scale, 40 * scale, 20 * scale, 20 * scale],
        "gradients": [40 * scale, 40 * scale, 20 * scale, 20 * scale],
        "optimizer_state": [80 * scale, 80 * scale, 40 * scale, 40 * scale],
        "activations": [120 * scale, 60 * scale, 60 * scale, 60 * scale],
    })
    fig = plots.memory_breakdown(df)
    assert_png(fig, tmp_path / f"memory_{unit}.png")
    assert unit in fig.axes[0].get_xlabel() and titles(fig)
    # stacked bars: the widths per kind are the frame's columns in the axis' unit
    widths = [bar.get_width() for bar in fig.axes[0].patches]
    assert widths == pytest.approx([v for k in ("parameters", "gradients", "optimizer_state", "activations")
                                    for v in df[k] / (MIB if unit == "MiB" else 1024)])


def test_loss_curves(tmp_path):
    steps = np.arange(50)
    base = pd.Series(2.3 * np.exp(-steps / 15) + 0.3, index=steps)
    fig = plots.loss_curves({"single": base, "ddp w2": base, "fsdp w2": base + 0.01})
    assert_png(fig, tmp_path / "loss.png")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "training loss (cross-entropy)"
    assert titles(fig) and len(ax.get_legend().get_texts()) == 3
    fsdp = next(line for line in ax.get_lines() if line.get_label() == "fsdp w2")
    np.testing.assert_allclose(fsdp.get_xdata(), steps)
    np.testing.assert_allclose(fsdp.get_ydata(), base + 0.01)


def test_bandwidth(tmp_path):
    sizes = [2**k for k in range(10, 27, 2)]
    rows = [{"op": op, "bytes": b, "busbw": peak * 1e9 * b / (b + 2**20) * (1 + 0.05 * rep), "group_size": 2}
            for op, peak in (("all_reduce", 9.0), ("all_gather", 7.0)) for b in sizes for rep in range(3)]
    rows.append({"op": "barrier", "bytes": 0, "busbw": np.nan, "group_size": 2})  # skipped: no bytes
    fig = plots.bandwidth(pd.DataFrame(rows), limit_gbps=12.0)
    assert_png(fig, tmp_path / "bandwidth.png")
    (ax,) = fig.axes
    assert "GB/s" in ax.get_ylabel() and "bytes" in ax.get_xlabel() and titles(fig)
    assert ax.get_xscale() == "log"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["all_gather", "all_reduce"] and "memcpy" in labels[2]
    all_reduce = next(ln for ln in ax.get_lines() if ln.get_label() == "all_reduce")
    assert len(all_reduce.get_xdata()) == len(sizes)  # one median point per size


def test_predicted_vs_measured(tmp_path):
    df = pd.DataFrame({
        "label": ["single", "ddp w2", "ddp w4", "fsdp w2"],
        "predicted_s": [0.030, 0.034, 0.040, 0.045],
        "measured_s": [0.031, 0.036, 0.049, 0.044],
    })
    fig = plots.predicted_vs_measured(df)
    assert_png(fig, tmp_path / "pred.png")
    (ax,) = fig.axes
    assert "ms" in ax.get_xlabel() and "ms" in ax.get_ylabel() and titles(fig)
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"single", "ddp w4"} <= labels and any("15" in t for t in labels)


def test_save_creates_parents(tmp_path):
    fig = plots.loss_curves({"run": pd.Series([2.0, 1.0])})
    assert plots.save(fig, tmp_path / "a" / "b" / "loss.png").exists()


def test_missing_column_is_a_clear_error():
    with pytest.raises(ValueError, match="samples_per_s"):
        plots.speedup(pd.DataFrame({"tier": ["ddp"], "world_size": [1]}))


def test_sweep_marks_the_best_point(tmp_path):
    df = pd.DataFrame({"bucket_cap_mb": [0.001, 0.1, 25.0], "median_step_ms": [9.0, 4.0, 5.0], "buckets": [8, 3, 1]})
    fig = plots.sweep(df, "bucket_cap_mb", "median_step_ms", title="DDP step time against bucket size",
                      xlabel="bucket_cap_mb (MB, log)", ylabel="median step time (ms)", annotate="buckets")
    ax = fig.axes[0]
    assert "ms" in ax.get_ylabel() and ax.get_xscale() == "log" and ax.get_title()
    assert ax.get_legend().get_texts()[0].get_text() == "best: 0.1"
    path = plots.save(fig, tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_link_sweep_splits_compute_and_exposed_comm(tmp_path):
    df = pd.DataFrame({"label": ["10 Gbit/s · allreduce", "200 Mbit/s · allreduce", "200 Mbit/s · fp16"],
                       "step_ms": [8.8, 63.4, 36.0], "exposed_comm_ms": [2.9, 50.7, 24.9],
                       "comm_mb_per_step": [1.2, 1.2, 0.6]})
    fig = plots.link_sweep(df)
    assert_png(fig, tmp_path / "links.png")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time per step (ms)"
    widths = [p.get_width() for p in ax.patches]  # compute bars, then exposed-comm bars
    assert widths[3:] == pytest.approx([2.9, 50.7, 24.9])
    assert np.add(widths[:3], widths[3:]) == pytest.approx([8.8, 63.4, 36.0])
    assert "200 Mbit/s · fp16 (0.6 MB/step)" in [t.get_text() for t in ax.get_yticklabels()]


def test_elastic_timeline_shades_attempts_and_marks_the_fault(tmp_path):
    rows = [{"t_s": 0.0, "kind": "node_start", "rank": np.nan, "attempt": np.nan, "world_size": np.nan, "step": np.nan}]
    for attempt, (t0, world) in enumerate([(1.0, 2), (6.0, 2)]):
        for rank in range(world):
            rows.append({"t_s": t0, "kind": "worker_start", "rank": rank, "attempt": attempt, "world_size": world})
            rows.append({"t_s": t0 + 0.5, "kind": "begin" if attempt == 0 else "resume", "rank": rank,
                         "attempt": attempt, "world_size": world, "step": 0 if attempt == 0 else 5})
            first = 0 if attempt == 0 else 5
            rows += [{"t_s": t0 + 1 + 0.1 * s, "kind": "step", "rank": rank, "attempt": attempt,
                      "world_size": world, "step": first + s} for s in range(1, 5)]
    rows.append({"t_s": 2.0, "kind": "fault", "rank": 1, "attempt": 0, "world_size": 2, "step": 7})
    fig = plots.elastic_timeline(pd.DataFrame(rows))
    assert_png(fig, tmp_path / "timeline.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["agents", "rank 0", "rank 1"]
    texts = [t.get_text() for t in ax.texts]
    assert "attempt 0\nworld 2" in texts and "attempt 1\nworld 2" in texts and "step 7" in texts
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"injected fault", "training steps", "resumed from snapshot"} <= set(legend)


def test_elastic_timeline_shows_a_join_as_a_new_world_within_the_same_attempt(tmp_path):
    rows = []
    for world, t0, steps in ((1, 0.0, range(0, 4)), (2, 5.0, range(4, 8))):
        for rank in range(world):
            rows += [{"t_s": t0 + 0.1 * s, "kind": "step", "rank": rank, "attempt": 0, "world_size": world, "step": s}
                     for s in steps]
    fig = plots.elastic_timeline(pd.DataFrame(rows))
    assert_png(fig, tmp_path / "join.png")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "attempt 0\nworld 1" in texts and "attempt 0\nworld 2" in texts
    assert len(fig.axes[0].patches) == 2 + 3  # two shaded phases; step bars: rank 0 twice, rank 1 once
