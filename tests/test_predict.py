"""The predict-then-run widget: a locked guess is compared with the measurement and logged."""

from __future__ import annotations

import json

import pytest

from dtlab.app.predict import predict


def test_a_choice_is_judged_and_logged(tmp_path, capsys):
    p = predict("Which tier is fastest?", ["single", "ddp"])
    p.control.value = "ddp"
    p.lock(p.control.value)
    assert p.control.disabled, "a locked guess cannot change after the measurement appears"
    log = tmp_path / "predictions.jsonl"
    p.reveal("single", detail="single 1.9 ms", log=log)
    assert p.verdict is False
    out = capsys.readouterr().out
    assert "your guess: ddp" in out and "measured:   single" in out and "✗" in out
    row = json.loads(log.read_text().splitlines()[-1])
    assert row["guess"] == "ddp" and row["measured"] == "single" and row["agrees"] is False


def test_a_number_agrees_within_its_relative_tolerance(tmp_path):
    p = predict("All-reduces per step?", low=0, high=10, tolerance=0.2)
    p.lock(3.5)
    p.reveal(3, log=None)
    assert p.verdict is True  # 3.5 is within 20 % of 3
    p.guess = 4.0
    p.reveal(3, log=None)
    assert p.verdict is False


def test_no_guess_is_said_not_counted(capsys):
    p = predict("Which tier is fastest?", ["single", "ddp"])
    p.reveal("single", log=None)
    assert p.verdict is False
    assert "no guess was locked in" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    ({}, "either choices"),
    ({"choices": ["a"]}, "at least two"),
    ({"low": 5, "high": 1}, "must be below"),
    ({"choices": ["a", "b"], "tolerance": 2}, "tolerance"),
])
def test_bad_questions_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        predict("q", **kwargs)


def test_a_guess_outside_the_choices_is_refused():
    with pytest.raises(ValueError, match="not one of the choices"):
        predict("q", ["a", "b"]).lock("c")
