"""Exercises: write a distributed algorithm in a notebook cell, and dtlab checks it on several world sizes.

::

    from dtlab import exercises

    print(exercises.describe("ring_allreduce"))  # the signature and the rules
    my_ring = exercises.stub("ring_allreduce")  # a starting point, which fails the check
    exercises.check("ring_allreduce", my_ring)  # ✗ ... what went wrong, on which rank, in which round

    def my_ring(t):
        ...

    exercises.check("ring_allreduce", my_ring)  # ✓ ... and what was verified
    exercises.solution("ring_allreduce")  # the reference, to read (inspect.getsource) or run

A check runs your function on every rank of real launches (2, 3 and 4 ranks)
with dtlab's CommRecorder on, and judges what it did: the values it left, the
calls it made (which op, which peer, how many bytes) and the state it kept. It
never reads your source. Your function reaches torch.distributed as usual:
``dist.get_rank()``, ``dist.get_world_size()``, ``dist.send``...

- ``ring_allreduce``: all_reduce built from point-to-point calls in a ring.
- ``naive_ddp``: make the gradients the global batch's after backward (DDP's maths).
- ``zero1_step``: an Adam step with the optimizer state sharded over the ranks (ZeRO stage 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dtlab.exercises import naive_ddp, ring_allreduce, zero1_step
from dtlab.exercises._check import CheckResult, Exercise, check_world_sizes, run_check

_EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in (ring_allreduce.EXERCISE, naive_ddp.EXERCISE,
                                                           zero1_step.EXERCISE)}


def _exercise(name: str) -> Exercise:
    try:
        return _EXERCISES[name]
    except (KeyError, TypeError):
        raise ValueError(f"no exercise named {name!r}: choose one of {', '.join(_EXERCISES)}") from None


def names() -> tuple[str, ...]:
    """The exercises, in the order they build on each other."""
    return tuple(_EXERCISES)


def describe(name: str) -> str:
    """What to write for exercise ``name``: the signature and the rules, in one paragraph."""
    return _exercise(name).description


def check(name: str, fn: Callable[..., Any], *, world_sizes: Sequence[int] | None = None,
          timeout_s: float = 10.0) -> CheckResult:
    """Run ``fn`` on every rank at each world size (default 2, 3 and 4) and judge it.

    Returns a ``CheckResult``: ``passed``, and ``feedback`` saying what was wrong,
    on which rank and where (or what was verified). A hung call ends after
    ``timeout_s`` seconds and is reported with the peer it waited for.
    """
    exercise = _exercise(name)
    if not callable(fn):
        raise TypeError(f"check({name!r}, fn) needs your function; got {fn!r}")
    return run_check(exercise, fn, check_world_sizes(exercise, world_sizes), timeout_s)


def solution(name: str) -> Callable[..., None]:
    """The reference solution of exercise ``name`` (read it with ``inspect.getsource``)."""
    return _exercise(name).solution


def stub(name: str) -> Callable[..., None]:
    """A starting point for exercise ``name``: it raises NotImplementedError, saying what to write."""
    return _exercise(name).stub


__all__ = ["CheckResult", "check", "describe", "names", "solution", "stub"]
