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


def test_run_all_in_a_live_notebook_holds_the_measurement_until_a_guess(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("dtlab.app.predict.live_frontend", lambda: True)
    p = predict("Which tier is fastest?", ["single", "ddp"])
    p.reveal("single", detail="single 1.9 ms", log=tmp_path / "log.jsonl")
    assert "measured" not in capsys.readouterr().out and p.verdict is None, "Run All must not show the answer"
    assert not (tmp_path / "log.jsonl").exists()
    p.control.value = "single"
    p.lock("single")  # what the Lock in button does
    out = capsys.readouterr().out
    assert "your guess: single" in out and "measured:   single" in out and "✓" in out
    assert p.verdict is True and p.held is None
    assert json.loads((tmp_path / "log.jsonl").read_text())["guess"] == "single"


def test_show_without_guessing_reveals_a_held_measurement(monkeypatch, capsys):
    monkeypatch.setattr("dtlab.app.predict.live_frontend", lambda: True)
    p = predict("All-reduces per step?", low=0, high=10)
    p.reveal(3, log=None)
    button = p.held[-1]
    assert "measured" not in capsys.readouterr().out
    button.click()
    out = capsys.readouterr().out
    assert "your guess: (none)" in out and "measured:   3" in out and "no guess was locked in" in out
    assert button.disabled and p.held is None


def test_without_a_live_front_end_reveal_shows_at_once_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr("dtlab.app.predict.live_frontend", lambda: False)
    p = predict("Which tier is fastest?", ["single", "ddp"])
    p.reveal("single", log=None)
    out = capsys.readouterr().out
    assert "measured:   single" in out and "without a live front-end" in out


def test_a_kernel_is_live_only_when_its_front_end_takes_input(monkeypatch):
    from types import SimpleNamespace

    from dtlab.app import predict as module

    shell = SimpleNamespace(kernel=SimpleNamespace(_allow_stdin=True))
    monkeypatch.setattr(module, "get_ipython", lambda: shell)
    assert module.live_frontend()
    shell.kernel._allow_stdin = False  # how nbclient executes a notebook
    assert not module.live_frontend()
    shell.kernel._allow_stdin = True
    monkeypatch.setenv("DTLAB_REVEAL", "now")
    assert not module.live_frontend()
    monkeypatch.setattr(module, "get_ipython", lambda: None)  # plain Python
    monkeypatch.delenv("DTLAB_REVEAL")
    assert not module.live_frontend()
