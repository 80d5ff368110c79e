"""The panel's run history: a broken run folder is named and left out, the readable runs are still compared."""

from __future__ import annotations

import ipywidgets as w

from dtlab.app.history import load_history, read_runs
from dtlab.app.widgets import Lab
from dtlab.core.config import RunConfig
from dtlab.core.results import RankResult, RunResult


def save_run(folder, losses):
    """A small finished run saved as the panel saves one (no process started)."""
    steps = [{"step": i, "loss": loss, "total": 0.01} for i, loss in enumerate(losses)]
    rank = RankResult(rank=0, steps=steps, memory={"parameters": 4}, events=[], phases=[], params_checksum=0.0)
    return RunResult(RunConfig(steps=len(losses)), [rank], 1.0).save(folder)


def history_with_broken_runs(tmp_path):
    save_run(tmp_path / "1-good", [2.0, 1.5, 1.0])
    save_run(tmp_path / "2-good", [2.5, 2.0, 1.25])
    (save_run(tmp_path / "3-garbage", [1.0, 1.0]) / "result.json").write_text("{not json")
    (save_run(tmp_path / "4-no-steps", [1.0, 1.0]) / "steps.csv").unlink()
    return load_history(tmp_path)


def test_read_runs_keeps_the_readable_and_names_the_broken(tmp_path):
    readable, broken = read_runs(history_with_broken_runs(tmp_path))
    assert set(readable) == {"1-good", "2-good"}
    assert readable["1-good"].loss.tolist() == [2.0, 1.5, 1.0]
    assert readable["2-good"].summary["final_loss"] == 1.25
    assert broken.keys() == {"3-garbage", "4-no-steps"}
    assert broken["3-garbage"].startswith("result.json:") and broken["4-no-steps"] == "steps.csv: missing"


def test_compare_selected_shows_the_readable_runs_and_names_the_broken_one(tmp_path):
    history_with_broken_runs(tmp_path)
    lab = Lab(history=tmp_path)
    lab.compare_pick.value = tuple(lab.compare_pick.options)  # all four, broken ones included
    lab.compare_button.click()
    table, image, note = lab.compare_out.children
    assert isinstance(image, w.Image) and image.value
    assert "1-good" in table.value and "2-good" in table.value and "1.2500" in table.value
    assert "3-garbage" not in table.value and "4-no-steps" not in table.value
    assert "3-garbage: result.json:" in note.value and "4-no-steps: steps.csv: missing" in note.value
    assert not lab.log.outputs  # nothing failed: the callback did not raise
