"""Every benchmark runs (smoke mode); their numbers are checked by running them, not here."""

from __future__ import annotations

import pytest

from dtlab.app.bench import parse, run_all, scripts
from tests import bench_scripts

pytestmark = pytest.mark.usefixtures("no_survivors")


def test_result_lines_parse():
    rows = parse("noise\nscaling: measured 0.867 (target >= 0.7) pass -- weak-scaling efficiency\n"
                 "x.y: measured 3.056 (target none: > 1 means bucketing pays) [quick smoke run: not a measurement]\n"
                 "ft[step without faults, ft / ddp]: measured 1.774 (target informational) -- medians\n")
    assert [(r["name"], r["value"], r["verdict"]) for r in rows] == [
        ("scaling", "0.867", " pass"), ("x.y", "3.056", None), ("ft[step without faults, ft / ddp]", "1.774", None)]


def test_unknown_benchmark_is_named():
    with pytest.raises(ValueError, match="nope"):
        scripts(["nope"])


def test_a_failed_benchmark_names_its_last_output_lines(tmp_path, monkeypatch):
    # where only the exception survives (a CI log), its message must carry the script's own error
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('ok: measured 1.0 (target none)')\nsys.exit('broken: the fit failed')\n")
    monkeypatch.setattr("dtlab.app.bench.scripts", lambda only=None: [script])
    with pytest.raises(RuntimeError, match=r"broken \(exit 1;[\s\S]*broken: the fit failed"):
        run_all(tmp_path / "out", quick=True)


def test_a_smoke_group_runs_every_script_in_one_interpreter_and_names_each_ones_failure(tmp_path, monkeypatch):
    # one interpreter for the three (the pid each writes), an exception and an exit code each kept to its script
    made = []
    for name, body in (("a_raises", "raise RuntimeError('a is broken')"), ("b_exits", "sys.exit(3)"),
                       ("c_works", "print('c: measured 1.5 (target none)')")):
        script = tmp_path / f"{name}.py"
        script.write_text(f"import os, sys\nprint('pid', os.getpid(), sys.argv[1:])\n{body}\n")
        made.append(script)
    monkeypatch.setattr("dtlab.app.bench.scripts", lambda only=None: made)
    with pytest.raises(RuntimeError) as failed:
        run_all(tmp_path / "out", quick=True, jobs=1)
    assert "a_raises (exit 1;" in str(failed.value) and "RuntimeError: a is broken" in str(failed.value)
    assert "b_exits (exit 3;" in str(failed.value) and "c_works" not in str(failed.value)
    logs = [(tmp_path / "out" / f"{s.stem}.log").read_text() for s in made]
    assert len({log.split()[1] for log in logs}) == 1  # the same pid
    assert all(f"['--out', '{tmp_path / 'out'}', '--quick']" in log for log in logs)


def test_every_benchmark_runs_in_smoke_mode(tmp_path):
    rows = run_all(tmp_path, quick=True)
    assert {r["script"] for r in rows} == {p.stem for p in scripts()}
    assert (tmp_path / "summary.md").read_text().count("\n| `") == len(rows)


def test_bench_table_is_regenerated_between_the_markers(tmp_path):
    from dtlab.app.bench import BENCH_BEGIN, BENCH_END, update_doc

    page = tmp_path / "measurement.md"
    page.write_text(f"# x\n\n{BENCH_BEGIN}\nold table\n{BENCH_END}\n\nafter\n")
    update_doc(page, "| new | table |\n")
    assert page.read_text() == f"# x\n\n{BENCH_BEGIN}\n| new | table |\n{BENCH_END}\n\nafter\n"
    page.write_text("no markers")
    with pytest.raises(ValueError, match="no <!-- bench:begin -->"):
        update_doc(page, "t")


def test_the_bench_table_lives_in_the_measurement_page():
    from dtlab.app.bench import BENCH_BEGIN, BENCH_DOC, BENCH_END

    assert BENCH_DOC.name == "measurement.md" and BENCH_DOC.parent.name == "docs"
    text = BENCH_DOC.read_text()
    assert text.index(BENCH_BEGIN) < text.index(BENCH_END)


@pytest.mark.parametrize("flag", ["--docs", "--readme"])
def test_the_docs_table_needs_the_full_run(flag):
    from dtlab.app.cli import main

    assert main(["bench", "--quick", flag]) == 2


def _common():
    return bench_scripts.load("_common")


def test_median_interval_from_ten_rounds_is_a_90_percent_bootstrap_and_says_when_a_target_is_resolved():
    common = _common()
    noisy = [1.0 + 0.1 * ((7 * i) % 11 - 5) / 5 for i in range(11)]  # 0.9 .. 1.1, median 1.0
    lo, hi, label = common.median_interval(noisy)
    assert label == "90 % bootstrap"
    assert 0.9 < lo < 1.0 < hi < 1.1 and hi - lo < 0.2  # inside the rounds' range: not their min-max
    many_lo, many_hi, _ = common.median_interval(noisy * 9)  # the same spread, nine times the rounds
    assert many_hi - many_lo < (hi - lo) / 2
    assert common.median_interval(noisy) == (lo, hi, label)  # seeded: the same rows give the same interval
    assert common.resolution(noisy, 0.98) == "the target 0.98 lies inside the 90 % bootstrap: not resolved by this run"
    assert "90 % bootstrap" in common.ratio_text(noisy) and "11 rounds" in common.ratio_text(noisy)
    with pytest.raises(ValueError, match="level"):
        common.median_interval(noisy, level=90)


@pytest.mark.parametrize("rounds", [2, 3, 9])
def test_median_interval_from_fewer_than_ten_rounds_is_their_min_max_and_says_so(rounds):
    common = _common()
    values = [1.0 + 0.01 * ((5 * i) % rounds) for i in range(rounds)]
    interval = common.median_interval(values)
    assert (interval.lo, interval.hi) == (min(values), max(values))
    assert interval.label == f"min-max of {rounds} rounds"
    text = common.ratio_text(values)
    assert f"[min-max of {rounds} rounds " in text and "90 %" not in text
    assert common.resolution(values, 1.0) == \
        f"the target 1 lies inside the min-max of {rounds} rounds: not resolved by this run"
    assert common.resolution(values, 0.98) == f"the min-max of {rounds} rounds excludes the target 0.98"


def test_median_interval_of_one_round_is_none():
    common = _common()
    assert common.resolution([1.0], 0.98) == "one round: no interval"
    assert common.ratio_text([1.0]) == "1.000"


def test_interleave_reverses_every_other_round():
    common = _common()
    rows = common.interleave({"a": lambda r: {}, "b": lambda r: {}, "c": lambda r: {}}, 2, warmup_rounds=1)
    order = [(row["round"], row["variant"]) for row in rows]
    assert order == [(-1, "c"), (-1, "b"), (-1, "a"), (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


def test_a_result_line_the_runner_cannot_read_fails_where_it_is_written(capsys):
    common = _common()
    line = common.result_line("ft[tuned timeouts]", 0.14, "<= 0.2", quick=False, passed=True, detail="medians")
    assert parse(line)[0]["name"] == "ft[tuned timeouts]"
    with pytest.raises(ValueError, match="'ft tuned'"):
        common.result_line("ft tuned", 0.14, "<= 0.2", quick=True)
