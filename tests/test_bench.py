"""Every benchmark runs (smoke mode); their numbers are checked by running them, not here."""

from __future__ import annotations

import pytest

from dtlab.app.bench import parse, run_all, scripts

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


def test_readme_table_is_regenerated_between_the_markers(tmp_path):
    from dtlab.app.bench import README_BEGIN, README_END, update_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nold table\n{README_END}\n\nafter\n")
    update_readme(readme, "| new | table |\n")
    assert readme.read_text() == f"# x\n\n{README_BEGIN}\n| new | table |\n{README_END}\n\nafter\n"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="no <!-- bench:begin -->"):
        update_readme(readme, "t")


def test_readme_needs_the_full_run():
    from dtlab.app.cli import main

    assert main(["bench", "--quick", "--readme"]) == 2
