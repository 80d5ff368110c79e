"""The course on a busy machine (dtlab.app.busy): rows per notebook, the hogs gone afterwards, the figure."""

from __future__ import annotations

import pandas as pd
import psutil
import pytest
from nbclient.exceptions import CellExecutionError

from dtlab.app import busy
from dtlab.plots import busy as busy_plots


def _fake_run(path, folder, timeout_s):
    if path.stem.startswith("01"):
        raise CellExecutionError("trace", "ValueError", "ValueError: calibrate: no fit")
    return None


def test_a_failed_notebook_is_a_row_naming_its_error_and_the_run_exits_1(monkeypatch, tmp_path):
    monkeypatch.setattr(busy, "run_quick", _fake_run)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = busy.main(["--hogs", "2", "--only", "00_overview,01_single_device", "--out", str(tmp_path)])
    assert code == 1

    table = pd.read_csv(tmp_path / "busy_notebooks.csv")
    assert list(table.notebook) == ["00_overview", "01_single_device"] and list(table.passed) == [True, False]
    assert "calibrate: no fit" in table.failure.iloc[1]
    assert (tmp_path / "busy_notebooks.png").stat().st_size > 0
    spinning = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert spinning == []  # the hogs ended with the run


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        busy.main(["--only", "99_nothing"])
    assert "--only: no notebook 99_nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        busy.main(["--hogs", "-1"])
    assert "--hogs -1 must be >= 0" in capsys.readouterr().err


def test_the_figure_colours_pass_and_fail():

    fig = busy_plots.notebook_seconds(pd.DataFrame({"notebook": ["a", "b"], "passed": [True, False],
                                                    "seconds": [10.0, 20.0]}), hogs=4, cores=2)
    bars = fig.axes[0].patches
    assert [round(b.get_width()) for b in bars] == [10, 20]
    assert bars[0].get_facecolor() != bars[1].get_facecolor()
    assert "1 of 2 notebooks passed beside 4 CPU hogs on 2 cores" in fig.axes[0].get_title()
