"""The tables notebooks 12 and 13 read from runs, on small synthetic inputs: traffic by mesh axis, TP's calls
against the book, the checkpointing table, and the activations figure."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from dtlab import plots
from dtlab.core.config import RunConfig
from dtlab.core.results import RankResult, RunResult
from dtlab.cost.tp import textbook_collectives
from dtlab.read.frames import checkpointing_table, steady_step_s
from dtlab.read.mesh import AXES, axis_of, traffic_by_axis
from dtlab.read.tp import against_book


def _event(rank: int, step: int, op: str, nbytes: int, tag: str = "", seq: int = 0) -> dict:
    return {"rank": rank, "step": step, "op": op, "bytes": nbytes, "tag": tag, "seq": seq, "group_size": 2,
            "peer": 1 - rank if op in ("isend", "irecv") else -1, "start": 0.0, "end": 0.0}


def _result(events: list[dict], steps: int = 2, config: object | None = None, **rank_fields: object) -> RunResult:
    rank = RankResult(rank=0, steps=[{"step": s, "loss": 1.0, "total": 0.01 * (s + 1), "recompute": 0.001}
                                     for s in range(steps)], memory={"activations": 2_000_000}, events=events,
                      phases=[], params_checksum=0.0, evaluation={}, strategy={}, **rank_fields)
    return RunResult(config=config or SimpleNamespace(steps=steps, world_size=1), ranks=[rank], wall_s=1.0)


def test_axis_of_names_the_pipeline_fsdp_and_tp_axes():
    assert axis_of("isend", "") == "pp" and axis_of("irecv", "fsdp:blocks.0") == "pp"
    assert axis_of("all_gather_into_tensor", "fsdp:blocks.0") == "dp"
    assert axis_of("all_reduce", "blocks.0.attn") == "tp"


def test_traffic_by_axis_sums_calls_and_kilobytes_per_step():
    events = [e for s in range(2) for e in (
        _event(0, s, "all_gather_into_tensor", 4000, "fsdp:blocks.0"), _event(0, s, "all_reduce", 1000, "blocks.0"),
        _event(0, s, "all_reduce", 1000, "blocks.1"), _event(0, s, "isend", 500))]
    events += [_event(1, 0, "all_reduce", 9999, "blocks.0"), _event(0, -1, "broadcast", 9999)]  # other rank; set-up
    table = traffic_by_axis(_result(events))
    assert table.loc[(AXES["dp"], "all_gather_into_tensor"), "calls"] == 1.0
    assert table.loc[(AXES["tp"], "all_reduce")].tolist() == [2.0, 2.0]
    assert table.loc[(AXES["pp"], "isend"), "kB"] == 0.5
    only_last = traffic_by_axis(_result(events[:4] + events[4:5]), steps=[1])
    assert only_last.loc[(AXES["dp"], "all_gather_into_tensor"), "kB"] == 4.0
    with pytest.raises(ValueError, match="no steps"):
        traffic_by_axis(_result(events), steps=[])


def test_against_book_lines_up_recorded_calls_with_the_textbook():
    cfg = RunConfig(tier="tp", world_size=2, model="mlp", model_size=32, model_depth=2, steps=2)
    book = textbook_collectives(cfg)
    events = [_event(0, s, op, int(b), seq=i) for s in range(2)
              for i, (op, calls, b) in enumerate(zip(book["op"], book["calls"], book["bytes"])) for _ in range(calls)]
    table = against_book({"tp": _result(events, config=cfg)})
    assert (table["textbook calls"] == table["recorded calls"]).all() and len(table) >= 1
    short = against_book({"tp": _result(events[: len(events) // 2 - 1], config=cfg)})
    assert (short["textbook calls"] != short["recorded calls"]).any()  # a missing call shows as a mismatch


def _saved(value: float) -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.full((2,), value)}, buffer)
    return buffer.getvalue()


def test_checkpointing_table_and_steady_step():
    plain, ac = _result([], steps=3, params=_saved(1.0)), _result([], steps=3, params=_saved(1.5))
    assert steady_step_s(plain) == pytest.approx(0.025)  # steps 1 and 2 (step 0 is warm-up): 0.02, 0.03
    table = checkpointing_table({("single", False): plain, ("single", True): ac})
    assert table["run"].tolist() == ["single", "single + checkpointing"]
    assert table["recompute_ms"].tolist() == [0.0, pytest.approx(1.0)]
    assert table["activations_MB"].tolist() == [2.0, 2.0] and table["diff_vs_without"].tolist() == [0.0, 0.5]
    assert plots.checkpointing(table) is not None


def test_activations_saved_draws_a_bar_per_run_and_refuses_none():
    fig = plots.activations_saved(pd.Series({"single (1 rank)": 4e6, "tp (rank 0)": 3e6, "tp + SP (rank 0)": 2e6}),
                                  title="t")
    ax = fig.axes[0]
    assert len(ax.patches) == 3 and ax.get_xlabel() == "activations saved for backward (MB)"
    with pytest.raises(ValueError, match="no runs"):
        plots.activations_saved(pd.Series(dtype=float))
