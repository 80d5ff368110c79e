"""The figures of tensor, sequence and context parallelism render from small hand-made tables, draw what the tables
say, and name a table that cannot be drawn; the context-parallel formulas they are fed add up."""

from __future__ import annotations

import pandas as pd
import pytest

from dtlab import plots
from dtlab.cost import cp as cp_formula
from dtlab.experiments import cp_work
from dtlab.read import cp as cp_read
from tests.test_plots import assert_png, titles


def test_calls_by_tag_stacks_each_ops_calls_per_tag(tmp_path):
    tp = pd.DataFrame({"all_reduce": [1.0, 2.0]}, index=["CharFormer", "blocks.0.attn"])
    sp = pd.DataFrame({"all_gather_into_tensor": [3.0], "reduce_scatter_tensor": [2.0]}, index=["blocks.0.attn"])
    fig = plots.calls_by_tag({"tp": tp, "tp + SP": sp})
    assert titles(fig) == ["tp", "tp + SP"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["CharFormer", "blocks.0.attn"]
    widths = sorted(p.get_width() for p in fig.axes[1].patches if p.get_width())
    assert widths == [2.0, 3.0]  # tp + SP: the two ops of blocks.0.attn, stacked
    assert_png(fig, tmp_path / "calls.png")
    with pytest.raises(ValueError, match="no runs"):
        plots.calls_by_tag({})


def ring_step():
    events = []
    for k, (rank, peer) in enumerate([(0, 1), (1, 0)]):
        events.append({"rank": rank, "peer": peer, "op": "isend", "tag": "cp:forward", "start": 1.0 + k * 1e-3,
                       "end": 1.002, "seq": 2 * k})
        events.append({"rank": peer, "peer": rank, "op": "irecv", "tag": "cp:forward", "start": 1.0,
                       "end": 1.003 + k * 1e-3, "seq": 2 * k + 1})
    phases = pd.DataFrame([{"rank": r, "phase": "cp_forward", "start": 1.0, "end": 1.004} for r in (0, 1)])
    return pd.DataFrame(events), phases


def test_ring_messages_draws_an_arrow_per_message(tmp_path):
    events, phases = ring_step()
    fig = plots.ring_messages(events, phases, {"cp:forward": "tab:blue"})
    ax = fig.axes[0]
    arrows = [p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]
    assert len(arrows) == 2 and [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert_png(fig, tmp_path / "ring.png")
    with pytest.raises(ValueError, match="has no matching irecv"):
        plots.ring_messages(events[events["op"] == "isend"].assign(seq=[0, 1]), phases, {"cp:forward": "k"})


def test_attention_work_shows_each_balance_and_the_formula(tmp_path):
    table = cp_work.work_table(2, batch=2, heads=2, width=8)
    fig = plots.attention_work(table)
    assert titles(fig)[1:] == ["contiguous", "zigzag"]
    bars = [p.get_height() for p in fig.axes[0].patches]
    assert bars == pytest.approx(list(table[table["balance"] == "contiguous"]["flops"] / 1e6))
    assert_png(fig, tmp_path / "work.png")


def test_cp_bytes_draws_formula_lines_and_measured_points(tmp_path):
    formula = cp_formula.bytes_formula(batch=4, width=8, depth=2, degrees=[2, 4, 8])
    measured = formula[formula["degree"] <= 4]
    fig = plots.cp_bytes(measured, formula)
    assert [ax.get_title() for ax in fig.axes] == ["as counted (an all-to-all: its input)", "leaving the rank"]
    assert len(fig.axes[0].get_lines()) == 4  # a line and the points, per method
    assert_png(fig, tmp_path / "bytes.png")
    with pytest.raises(ValueError, match="cp_bytes: missing column"):
        plots.cp_bytes(measured.drop(columns="sent"), formula)


def test_comm_vs_width_and_checkpointing_render(tmp_path):
    lines = pd.DataFrame([{"width": w, "tier": t, "comm": c * w, "params": w * w}
                          for w in (16, 32, 64) for t, c in (("ddp", 1.0), ("tp", 2.0))])
    measured = lines.rename(columns={"comm": "comm_bytes", "params": "param_bytes"})
    fig = plots.comm_vs_width(lines, measured, {"ddp": 32}, [16, 32, 64], names={"tp": "TP", "ddp": "DDP"})
    assert "TP < DDP\nfrom 32" in [t.get_text() for t in fig.axes[0].texts]
    assert_png(fig, tmp_path / "widths.png")
    runs = pd.DataFrame({"run": ["single", "single + checkpointing"], "activations_MB": [30.0, 3.0],
                         "step_ms": [40.0, 55.0], "recompute_ms": [0.0, 12.0]})
    fig = plots.checkpointing(runs)
    assert sorted(p.get_width() for p in fig.axes[1].patches) == [0.0, 12.0, 40.0, 43.0]
    assert_png(fig, tmp_path / "ac.png")


def test_the_byte_formulas_of_ring_and_ulysses():
    x = 4 * (32 // 4) * 8 * 4  # batch 4, 8 of 32 positions, width 8, float32
    assert cp_formula.attention_bytes("ring", 4, 4, 8, 2) == {"counted": 2 * 2 * 10 * x, "sent": 2 * 2 * 10 * x}
    assert cp_formula.attention_bytes("ulysses", 4, 4, 8, 2) == {"counted": 2 * 8 * x, "sent": 2 * 8 * x * 3 // 4}
    table = cp_formula.bytes_formula(4, 8, 2, [2, 4, 8, 16, 32]).set_index(["method", "degree"])["counted"]
    assert table["ring", 2] == table["ulysses", 2]  # equal at 2 ranks
    assert table["ring", 32] < 6 * 4 * 32 * 8 * 4 * 2 and table["ring"].is_monotonic_increasing
    assert table["ulysses"].is_monotonic_decreasing
    row = {"op": "all_to_all_single", "bytes": 400, "rank": 1, "input_splits": [1, 1, 2]}
    assert cp_read._sent(row) == 300  # all but its own split
    assert cp_read._sent({"op": "isend", "bytes": 400, "rank": 1}) == 400
