"""Predict, then run: a one-line guess widget placed before a headline measurement.

    guess = predict("Which tier is fastest on this job?", ["single", "ddp", "zero"])
    ...                                       # the cells that measure it
    guess.reveal("single", detail="single 1.9 ms, ddp 3.1 ms per step")

The learner picks an answer and presses **Lock in** (the choice is then frozen,
so it cannot drift after the measurement appears); ``reveal`` shows the guess
beside what was measured and says whether they agree. Numeric questions take a
``(low, high)`` range and a relative ``tolerance``. Every revealed prediction is
appended to ``results/predictions.jsonl``, so an instructor can read a class's
guesses afterwards.

Run All cannot spoil a prediction: in a live notebook, ``reveal`` before a guess
is locked in holds the measurement back behind the widget above it; it appears
when the learner presses **Lock in**, or **Show without guessing**. Without a
live front-end (a notebook run by nbclient: the tests, the rendered course)
nobody can guess, so ``reveal`` shows the measurement at once and says why.
``DTLAB_REVEAL=now`` asks for that in a live notebook too.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as w
from IPython import get_ipython
from IPython.display import HTML, display

LOG = Path("results/predictions.jsonl")
NO_GUESS = "—"
HEADLESS_NOTE = "shown at once: this notebook runs without a live front-end, where nobody can lock in a guess"


def live_frontend() -> bool:
    """Whether a person can answer the widgets: a kernel whose front-end takes input (JupyterLab, VS Code).

    nbclient (the tests, the rendered course) executes with ``allow_stdin`` off, and ipykernel keeps that flag
    per request; plain Python has no kernel at all. ``DTLAB_REVEAL=now`` says "not live" explicitly.
    """
    if os.environ.get("DTLAB_REVEAL") == "now":
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    return bool(getattr(kernel, "_allow_stdin", False))


@dataclass
class Prediction:
    """One question, the learner's locked-in answer (None until locked) and, once revealed, the verdict."""

    question: str
    choices: Sequence[str] | None = None
    low: float | None = None
    high: float | None = None
    tolerance: float = 0.25
    guess: Any = None
    control: Any = field(default=None, repr=False)
    verdict: bool | None = None
    held: Any = field(default=None, repr=False)  # a measurement waiting for a guess: (measured, detail, log, output)

    def lock(self, value: Any) -> None:
        """Freeze the guess (what the Lock in button does; callable from code too); shows a held measurement."""
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"guess {value!r} is not one of the choices {list(self.choices)}")
        self.guess = value
        if self.control is not None:
            self.control.disabled = True
        self.show_held()

    def agrees(self, measured: Any) -> bool:
        """A choice must match; a number must lie within ``tolerance`` (relative) of the measurement."""
        if self.guess is None:
            return False
        if self.choices is not None:
            return str(self.guess) == str(measured)
        scale = max(abs(float(measured)), 1e-12)
        return abs(float(self.guess) - float(measured)) <= self.tolerance * scale

    def reveal(self, measured: Any, detail: str = "", log: Path | None = LOG) -> None:
        """Show the guess beside the measurement and set ``verdict`` (None returned: nothing echoes after it).

        In a live notebook with no guess locked in yet, the measurement is held back until the learner
        locks one in or presses "Show without guessing" (Run All must not spoil the question).
        """
        if self.guess is None and self.control is not None and live_frontend():
            self._hold(measured, detail, log)
            return
        note = "" if self.guess is not None or self.control is None else HEADLESS_NOTE
        self._print(measured, detail, log, note)

    def show_held(self) -> None:
        """Show a measurement that ``reveal`` held back (what Lock in and Show without guessing do)."""
        if self.held is None:
            return
        measured, detail, log, output, button = self.held
        self.held = None
        button.disabled = True
        with output:
            self._print(measured, detail, log, "")

    def _hold(self, measured: Any, detail: str, log: Path | None) -> None:
        output = w.Output()
        button = w.Button(description="Show without guessing", layout=w.Layout(width="190px"))
        self.held = (measured, detail, log, output, button)
        button.on_click(lambda _: self.show_held())
        note = w.HTML(f"<i>Measured. The answer to “{html.escape(self.question)}” appears here once you lock in "
                      "a guess above.</i>")
        display(w.VBox([w.HBox([note, button]), output]))

    def _print(self, measured: Any, detail: str, log: Path | None, note: str) -> None:
        self.verdict = self.agrees(measured)
        if self.guess is None:
            verdict = "no guess was locked in"
        elif self.verdict:
            verdict = "✓ your prediction holds"
        else:
            verdict = "✗ not what was measured: worth a second look at why"
        shown = "(none)" if self.guess is None else self.guess
        text = f"{self.question}\n  your guess: {shown}\n  measured:   {measured}\n  {verdict}"
        if detail:
            text += f"\n  {detail}"
        if note:
            text += f"\n  ({note})"
        print(text)
        if log is not None:
            self._log(measured, log)

    def _log(self, measured: Any, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "question": self.question,
               "guess": self.guess, "measured": measured, "agrees": self.verdict}
        with path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def predict(question: str, choices: Sequence[str] | None = None, *, low: float | None = None,
            high: float | None = None, tolerance: float = 0.25, step: float | None = None) -> Prediction:
    """Show ``question`` with a dropdown of ``choices`` (or a slider from ``low`` to ``high``) and a Lock in button."""
    if (choices is None) == (low is None or high is None):
        raise ValueError("predict: give either choices=[...] or low= and high=, not both")
    if choices is not None and len(choices) < 2:
        raise ValueError("predict: choices needs at least two answers")
    if low is not None and high is not None and not low < high:
        raise ValueError(f"predict: low ({low}) must be below high ({high})")
    if not 0 < tolerance < 1:
        raise ValueError(f"predict: tolerance is relative, in (0, 1); got {tolerance}")
    p = Prediction(question, list(choices) if choices is not None else None, low, high, tolerance)
    if choices is not None:
        control = w.Dropdown(options=[NO_GUESS, *p.choices], value=NO_GUESS, layout=w.Layout(width="220px"))
    else:
        control = w.FloatSlider(min=low, max=high, value=(low + high) / 2, step=step or (high - low) / 100,
                                readout_format=".3g", layout=w.Layout(width="360px"))
    p.control = control
    button = w.Button(description="Lock in", button_style="info", layout=w.Layout(width="90px"))
    status = w.HTML("")

    def on_lock(_: Any) -> None:
        if control.value == NO_GUESS:
            status.value = "pick an answer first"
            return
        p.lock(control.value)
        button.disabled = True
        status.value = f"locked in: <b>{html.escape(str(p.guess))}</b> — now run the cells below"

    button.on_click(on_lock)
    display(HTML(f"<b>Predict first.</b> {html.escape(question)}"), w.HBox([control, button, status]))
    return p
