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

A check runs your function on every rank of real launches (2 to 4 ranks:
``describe`` says which) with dtlab's CommRecorder on, and judges what it did:
the values it left, the calls it made (which op, which peer, how many bytes,
when) and the state it kept. It never reads your source. Your function reaches torch.distributed as usual:
``dist.get_rank()``, ``dist.get_world_size()``, ``dist.send``...

In course order:

- ``ring_allreduce``: all_reduce built from point-to-point calls in a ring.
- ``naive_ddp``: make the gradients the global batch's after backward (DDP's maths).
- ``bucketed_ddp``: DDP's buckets, all-reduced asynchronously while backward still runs.
- ``zero1_step``: an Adam step with the optimizer state sharded over the ranks (ZeRO stage 1).
- ``gpipe_schedule``: GPipe's forwards and backwards of M micro-batches over pipeline stages.
- ``ddp_script``: a whole DistributedDataParallel training script, run by torchrun. Its answer
  is a file, not a function: ``exercises.check("ddp_script", "my_script.py")``; its stub and
  solution are the paths of a starter script and of the reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from dtlab.exercises import bucketed_ddp, ddp_script, gpipe_schedule, naive_ddp, ring_allreduce, zero1_step
from dtlab.exercises._check import CheckResult, Exercise, ScriptExercise, check_world_sizes, run_check, script_path

_EXERCISES: dict[str, Exercise | ScriptExercise] = {
    ex.name: ex for ex in (ring_allreduce.EXERCISE, naive_ddp.EXERCISE, bucketed_ddp.EXERCISE, zero1_step.EXERCISE,
                           gpipe_schedule.EXERCISE, ddp_script.EXERCISE)}


def _exercise(name: str) -> Exercise | ScriptExercise:
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


def check(name: str, fn: Callable[..., Any] | str | os.PathLike[str], *, world_sizes: Sequence[int] | None = None,
          timeout_s: float = 10.0) -> CheckResult:
    """Run ``fn`` on every rank at each world size (the exercise's default: see ``describe``) and judge it.

    Returns a ``CheckResult``: ``passed``, and ``feedback`` saying what was wrong,
    on which rank and where (or what was verified). A hung call ends after
    ``timeout_s`` seconds and is reported with the peer it waited for.

    ``ddp_script`` takes the path of a script file instead of a function, and
    runs it under torchrun; a script still running after ``30 + 6 * timeout_s``
    seconds is stopped. A path that is not a file raises FileNotFoundError.
    """
    exercise = _exercise(name)
    if isinstance(exercise, ScriptExercise):
        path = script_path(name, fn)
        return exercise.run(path, check_world_sizes(exercise, world_sizes), timeout_s)
    if not callable(fn):
        raise TypeError(f"check({name!r}, fn) needs your function; got {fn!r}")
    return run_check(exercise, fn, check_world_sizes(exercise, world_sizes), timeout_s)


def solution(name: str) -> Callable[..., Any] | str:
    """The reference solution of exercise ``name`` (read it with ``inspect.getsource``).

    For ``ddp_script``, the path of the reference script (run it, or read it with ``open``).
    """
    return _exercise(name).solution


def stub(name: str) -> Callable[..., Any] | str:
    """A starting point for exercise ``name``: it raises NotImplementedError, saying what to write.

    For ``ddp_script``, the path of a starter script to copy and complete (it fails the check the same way).
    """
    return _exercise(name).stub


__all__ = ["CheckResult", "check", "describe", "names", "solution", "stub"]
