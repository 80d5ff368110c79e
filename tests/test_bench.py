"""Every benchmark runs (smoke mode); their numbers are checked by running them, not here."""

from __future__ import annotations

import pytest

from dtlab.bench import parse, run_all, scripts

pytestmark = pytest.mark.usefixtures("no_survivors")


def test_result_lines_parse():
    rows = parse("noise\nscaling: measured 0.867 (target >= 0.7) pass -- weak-scaling efficiency\n"
                 "x.y: measured 3.056 (target none: > 1 means bucketing pays) [quick smoke run: not a measurement]\n")
    assert [(r["name"], r["value"], r["verdict"]) for r in rows] == [("scaling", "0.867", " pass"),
                                                                     ("x.y", "3.056", None)]


def test_unknown_benchmark_is_named():
    with pytest.raises(ValueError, match="nope"):
        scripts(["nope"])


def test_every_benchmark_runs_in_smoke_mode(tmp_path):
    rows = run_all(tmp_path, quick=True)
    assert {r["script"] for r in rows} == {p.stem for p in scripts()}
    assert (tmp_path / "summary.md").read_text().count("\n| `") == len(rows)
