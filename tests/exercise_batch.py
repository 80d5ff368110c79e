"""Several learner functions checked in one launch: the feedback each would get from ``run_check`` at one world size.

A launch costs a fraction of a second, a test module of wrong solutions dozens of them. Here every rank
runs the exercise's ``on_rank`` for each function in turn and the parent judges each with the exercise's
``judge``, exactly as ``run_check`` does at one world size. Only functions that return on every rank (or
raise on every rank, before any call a peer waits for) can share a launch: a function that leaves one rank
waiting would spoil the ones after it, so a hang is reported as an error of the batch, not a verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dtlab.exercises._check import CheckResult, Exercise, ExerciseError, run_check
from dtlab.launch.local import launch


def launches_ranks(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a test that starts rank processes: slow, and failed if any rank outlives it."""
    return pytest.mark.slow(pytest.mark.usefixtures("no_survivors")(test))


def check(module: Any, fn: Callable[..., Any], world_sizes: tuple[int, ...] = (2,),
          timeout_s: float = 10.0) -> CheckResult:
    """``module``'s exercise checked on ``fn`` as a learner's check() would, one launch per world size."""
    return run_check(module.EXERCISE, fn, world_sizes, timeout_s)


def _each(info: Any, on_rank: Callable[..., Any], fns: list[Callable[..., Any]]) -> list[tuple[bool, Any]]:
    out = []
    for fn in fns:
        try:
            out.append((True, on_rank(info, fn)))
        except ExerciseError as err:
            out.append((False, str(err)))
    return out


def check_each(exercise: Exercise, fns: dict[str, Callable[..., Any]], n: int,
               timeout_s: float = 10.0) -> dict[str, str]:
    """Each function's feedback at world size ``n``: "World size n: <problem>", or "passed" when judge finds none."""
    ranks = launch(_each, n, args=(exercise.on_rank, list(fns.values())), progress=False, record=True,
                   timeout_s=timeout_s, deadline_s=30 + 3 * timeout_s * len(fns)).values
    verdicts = {}
    for i, name in enumerate(fns):
        failed = [value for ok, value in (rank[i] for rank in ranks) if not ok]
        if failed:
            if any("timed out" in message for message in failed):
                raise AssertionError(f"{name} left a rank waiting, which spoils a shared launch: check it alone")
            verdicts[name] = f"World size {n}: {failed[0]}"
            continue
        problem = exercise.judge(n, [rank[i][1] for rank in ranks])
        verdicts[name] = f"World size {n}: {problem}" if problem else "passed"
    return verdicts


def verdicts_by_size(wrong: dict[Any, dict[Callable[..., Any], tuple[int, list[str]]]]) -> dict[tuple[Any, str], str]:
    """Each wrong solution's feedback, ``wrong`` mapping an exercise module to {function: (world size, phrases)}:
    one launch per exercise and world size for all of them."""
    out = {}
    for module, fns in wrong.items():
        for n in sorted({size for size, _ in fns.values()}):
            batch = {fn.__name__: fn for fn, (size, _) in fns.items() if size == n}
            out.update({(module, name): said for name, said in check_each(module.EXERCISE, batch, n).items()})
    return out


def assert_names_its_cause(wrong: dict[Any, dict[Callable[..., Any], tuple[int, list[str]]]], module: Any,
                           fn: Callable[..., Any], verdicts: dict[tuple[Any, str], str]) -> None:
    """``fn``'s feedback starts at its world size and holds every phrase its row in ``wrong`` names."""
    feedback = verdicts[module, fn.__name__]
    size, phrases = wrong[module][fn]
    assert feedback.startswith(f"World size {size}: "), feedback
    for phrase in phrases:
        assert phrase in feedback, feedback
