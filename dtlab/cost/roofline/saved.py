"""The roofline predictions run on: one measurement, saved and reused, measured first where there is none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dtlab.cost.roofline.cpu import DEFAULT_PATH, Roofline, fit
from dtlab.cost.roofline.measure import measure

__all__ = ["machine_roofline"]


def machine_roofline(roofline: Roofline | str | Path | None = None, quick: bool = False,
                     say: Callable[[str], None] = lambda line: None) -> Roofline:
    """The roofline to predict on: ``roofline`` itself, or loaded from that path; None: the saved one
    (``cpu.DEFAULT_PATH``) if it was measured on this machine in full, else measured now and, unless
    ``quick`` (a smoke test, never saved), saved there for later predictions."""
    if isinstance(roofline, Roofline):
        return roofline
    if roofline is not None:
        return Roofline.load(roofline)
    if DEFAULT_PATH.is_file():
        saved = Roofline.load(DEFAULT_PATH)
        if saved.matches_this_machine() and not saved.machine.get("quick"):
            say(f"roofline: {DEFAULT_PATH}, measured {saved.machine.get('measured')}")
            return saved
    say("roofline: measuring this machine's (as python -m dtlab.cost.roofline does)")
    measured = fit(measure(quick=quick, log=say))
    if not quick:
        measured.save(DEFAULT_PATH)
    return measured
