"""The learner's progress: checks record their verdicts under results/, and progress() reads them back.

Every test runs in its own working directory (``results/`` is relative to it,
as in a notebook). Only the last test launches ranks.
"""

from __future__ import annotations

import json
import warnings

import pytest

from dtlab import exercises
from dtlab.app.predict import Prediction
from dtlab.exercises import CheckResult, _progress, bugzoo


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    """A fresh working directory, and the one-warning flag reset."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_progress, "_warned", False)
    return tmp_path


def status(progress, kind, name):
    row = progress.checks[(progress.checks["kind"] == kind) & (progress.checks["name"] == name)]
    assert len(row) == 1
    return row.iloc[0]


def test_every_exercise_and_bug_is_listed_and_not_tried_before_any_check(workdir):
    progress = exercises.progress()
    assert list(progress.checks.columns) == ["kind", "name", "status", "attempts", "last_checked"]
    assert list(progress.checks["name"]) == [*exercises.names(), *bugzoo.names()]
    assert set(progress.checks["status"]) == {"not tried"} and set(progress.checks["attempts"]) == {0}
    assert progress.predictions.empty and list(progress.predictions.columns) == [
        "question", "guess", "measured", "agrees", "revealed"]
    assert progress.summary() == (f"0 of {len(exercises.names())} exercises and 0 of {len(bugzoo.names())} bugs "
                                  "passed; no prediction yet.")
    assert not (workdir / "results").exists()  # reading writes nothing


def test_passed_and_failed_checks_show_as_passed_and_not_yet(workdir):
    _progress.record("exercise", "ring_allreduce", False)
    _progress.record("exercise", "ring_allreduce", True)
    _progress.record("exercise", "ring_allreduce", False)  # a later experiment does not take the pass back
    _progress.record("exercise", "naive_ddp", False)
    _progress.record("bug", "seed", False)
    progress = exercises.progress()
    ring, naive, seed = (status(progress, "exercise", "ring_allreduce"), status(progress, "exercise", "naive_ddp"),
                         status(progress, "bug", "seed"))
    assert (ring.status, ring.attempts) == ("passed", 3)
    assert (naive.status, naive.attempts) == ("not yet", 1) and naive.last_checked.startswith("20")
    assert (seed.status, seed.attempts) == ("not yet", 1)
    assert status(progress, "exercise", "zero1_step").status == "not tried"
    lines = (workdir / "results" / "progress.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) | {"time": "t"} == {"time": "t", "kind": "exercise", "name": "ring_allreduce",
                                                    "passed": True}
    assert progress.summary().startswith(f"1 of {len(exercises.names())} exercises and 0 of")
    assert "not yet" in progress._repr_html_() and "<table" in progress._repr_html_()
    assert repr(progress).startswith(progress.summary())


def test_exercise_and_bug_checks_record_their_verdict(workdir, monkeypatch):
    monkeypatch.setattr(exercises, "run_check", lambda ex, fn, sizes, timeout: CheckResult(ex.name, False, "no"))
    monkeypatch.setattr(bugzoo, "_check", lambda bug, fn, timeout: CheckResult(bug.name, True, "fixed"))
    assert not exercises.check("naive_ddp", lambda model: None)
    assert bugzoo.check("seed", lambda info: None)
    with pytest.raises(TypeError):  # no verdict, nothing recorded
        exercises.check("naive_ddp", "not a function")
    progress = exercises.progress()
    assert status(progress, "exercise", "naive_ddp").status == "not yet"
    assert status(progress, "exercise", "naive_ddp").attempts == 1
    assert status(progress, "bug", "seed").status == "passed"


def test_revealed_predictions_with_a_guess_are_listed_latest_first_asked(workdir):
    log = workdir / "results" / "predictions.jsonl"
    for question, guess, measured in (("Which tier is fastest?", "ddp", "single"), ("Speedup at 4 ranks?", 3.0, 2.9),
                                      ("Which tier is fastest?", "single", "single")):
        p = Prediction(question, choices=["single", "ddp"] if isinstance(guess, str) else None)
        p.guess = guess
        p.reveal(measured, log=log)  # what dtlab.predict writes
    Prediction("Nobody guessed?", choices=["a", "b"]).reveal("a", log=log)  # no guess: not a prediction
    with log.open("a") as f:
        f.write('{"question": "cut short\n')  # a damaged line is skipped
    progress = exercises.progress()
    rows = progress.predictions.to_dict("records")
    assert [(r["question"], r["guess"], r["measured"], r["agrees"]) for r in rows] == [
        ("Speedup at 4 ranks?", 3.0, 2.9, True), ("Which tier is fastest?", "single", "single", True)]
    assert progress.summary().endswith("2 predictions, 2 agreeing with the measurement.")
    assert "Speedup at 4 ranks?" in progress._repr_html_()


def test_other_log_paths_can_be_given(workdir):
    _progress.record("bug", "straggler", True, path=workdir / "mine.jsonl")
    assert status(exercises.progress(), "bug", "straggler").status == "not tried"
    assert status(exercises.progress(progress_log=workdir / "mine.jsonl"), "bug", "straggler").status == "passed"


def test_an_unwritable_results_folder_warns_once_and_the_check_still_answers(workdir, monkeypatch):
    (workdir / "results").write_text("a file where the folder should be")
    monkeypatch.setattr(exercises, "run_check", lambda ex, fn, sizes, timeout: CheckResult(ex.name, True, "ok"))
    with pytest.warns(RuntimeWarning, match="could not record this check in results/progress.jsonl"):
        assert exercises.check("naive_ddp", lambda model: None).passed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second failure stays silent
        assert exercises.check("naive_ddp", lambda model: None).passed
    assert status(exercises.progress(), "exercise", "naive_ddp").status == "not tried"


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_a_real_check_of_the_stub_is_recorded_as_not_yet(workdir):
    result = exercises.check("naive_ddp", exercises.stub("naive_ddp"), world_sizes=[2])
    assert not result.passed and "NotImplementedError" in result.feedback
    row = status(exercises.progress(), "exercise", "naive_ddp")
    assert (row.status, row.attempts) == ("not yet", 1)
