"""When per-step fault tolerance pays: its cost on every step against what it saves at each fault.

A run of ``ft`` pays ``step_ft_s - step_base_s`` more than the baseline
(``elastic``, or ``ddp`` restarted from a snapshot) on every step, and loses
``lost_ft_s`` instead of ``lost_base_s`` at each fault. With one fault every
``n`` steps the two spend the same time when

    n x (step_ft_s - step_base_s) = lost_base_s - lost_ft_s

so ft is the faster of the two while faults come more often than every
``break_even_steps(...)`` steps, and never if it loses as much per fault as the
baseline. While a replica group is down the others commit steps on their share
of the global batch only: ``samples_lost`` counts the samples those steps left
out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["break_even_hours", "break_even_steps", "samples_lost"]


def _number(name: str, value: float, *, positive: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number of seconds")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} is invalid: must be {'> 0' if positive else '>= 0'} seconds")
    return float(value)


def break_even_steps(lost_base_s: float, lost_ft_s: float, step_base_s: float, step_ft_s: float) -> float:
    """Fault interval (steps between faults) below which ft finishes first; ``inf`` if ft's steps cost no
    more than the baseline's and it loses less per fault (it always pays), ``0.0`` if it loses at least as
    much per fault (it never pays)."""
    saved = _number("lost_base_s", lost_base_s) - _number("lost_ft_s", lost_ft_s)
    extra = _number("step_ft_s", step_ft_s, positive=True) - _number("step_base_s", step_base_s, positive=True)
    if saved <= 0:
        return 0.0
    return math.inf if extra <= 0 else saved / extra


def break_even_hours(steps: float, step_s: float) -> float:
    """``steps`` between faults as hours of training at ``step_s`` seconds per step."""
    if not isinstance(steps, int | float) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps={steps!r} is invalid: must be a number of steps >= 0")
    return steps * _number("step_s", step_s, positive=True) / 3600.0


def samples_lost(participants: Iterable[int], groups: int, global_batch: int) -> float:
    """Samples the committed steps left out: each step with ``p`` of ``groups`` replica groups in it averages
    ``p / groups`` of the ``global_batch``, so it leaves out ``(groups - p) / groups x global_batch``."""
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups={groups!r} is invalid: must be an integer >= 1")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} is invalid: must be an integer >= 1")
    total = 0.0
    for p in participants:
        if not 0 < p <= groups:
            raise ValueError(f"participants {p!r} is invalid: a committed step has 1..{groups} groups in it")
        total += (groups - p) / groups * global_batch
    return total
