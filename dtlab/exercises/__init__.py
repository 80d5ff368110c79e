"""Exercises: write a distributed algorithm in a notebook cell, and dtlab checks it on several world sizes.

::

    from dtlab import exercises

    print(exercises.describe("ring_allreduce"))  # the task: the signature, the rules, what is checked
    my_ring = exercises.stub("ring_allreduce")  # a starting point, which fails the check
    exercises.check("ring_allreduce", my_ring)  # ✗ ... what went wrong, on which rank, in which round

    def my_ring(t):
        ...

    exercises.check("ring_allreduce", my_ring)  # ✓ ... and what was verified
    exercises.progress()  # every exercise and bug: passed, not yet or not tried; your predictions

Stuck? Ask for help in steps, each giving more away::

    print(exercises.hint("ring_allreduce"))     # level 1: the idea
    print(exercises.hint("ring_allreduce", 2))  # level 2: the torch.distributed calls to use, and where
    print(exercises.hint("ring_allreduce", 3))  # level 3: pseudo-code
    exercises.solution("ring_allreduce")  # the reference, to read (inspect.getsource) or run

``describe`` says what to write, never how: the steps of the algorithm are in
the hints. A check runs your function on every rank of real launches (2 to 4
ranks: ``describe`` says which) with dtlab's CommRecorder on, and judges what
it did: the values it left, the calls it made (which op, which peer, how many
bytes, when) and the state it kept. It never reads your source. Your function
reaches torch.distributed as usual: ``dist.get_rank()``,
``dist.get_world_size()``, ``dist.send``...

Every verdict, here and in the bug zoo (``bugzoo.check``), is appended to
``results/progress.jsonl`` under the working directory, so ``progress()``
still knows after a kernel restart; it also lists the predictions you locked
in (``dtlab.predict``, logged to ``results/predictions.jsonl``).

In course order:

- ``ring_allreduce``: all_reduce built from point-to-point calls in a ring.
- ``naive_ddp``: make the gradients the global batch's after backward (DDP's maths).
- ``bucketed_ddp``: DDP's buckets, all-reduced asynchronously while backward still runs.
- ``zero1_step``: an Adam step with the optimizer state sharded over the ranks (ZeRO stage 1).
- ``fsdp_unit``: one FSDP unit by hand: the flat sharded parameter gathered for a step, its
  gradient scattered back, the whole parameter not kept between steps.
- ``ddp_script``: a whole DistributedDataParallel training script, run by torchrun. Its answer
  is a file, not a function: ``exercises.check("ddp_script", "my_script.py")``; its stub and
  solution are the paths of a starter script and of the reference.
- ``gpipe_schedule``: GPipe's forwards and backwards of M micro-batches over pipeline stages.
- ``tp_mlp``: a Megatron MLP pair split over the ranks, its communication in autograd Functions.
- ``ring_attention``: attention over a sequence split across the ranks, K/V blocks passed in a ring.
- ``ulysses_attention``: the same split sequence, attended by trading it for a split of the heads with an
  all-to-all, and back (DeepSpeed-Ulysses).
- ``moe_dispatch``: expert parallelism's token dispatch: each token to its expert's rank with an
  all-to-all of uneven splits, and its output back (the combine).
- ``layer_flops``: one transformer layer's forward FLOPs and bytes moved, checked in this process
  against the planner's own count (no ranks: the checker is the model the predictions come from).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtlab.exercises import (
    _progress,
    bucketed_ddp,
    bugzoo,
    ddp_script,
    fsdp_unit,
    gpipe_schedule,
    layer_flops,
    moe_dispatch,
    naive_ddp,
    ring_allreduce,
    ring_attention,
    tp_mlp,
    ulysses_attention,
    zero1_step,
)
from dtlab.exercises._check import CheckResult, Exercise, ScriptExercise, check_world_sizes, run_check, script_path
from dtlab.exercises._local import LocalExercise
from dtlab.exercises._progress import Progress

_EXERCISES: dict[str, Exercise | ScriptExercise | LocalExercise] = {
    ex.name: ex for ex in (ring_allreduce.EXERCISE, naive_ddp.EXERCISE, bucketed_ddp.EXERCISE, zero1_step.EXERCISE,
                           fsdp_unit.EXERCISE, ddp_script.EXERCISE, gpipe_schedule.EXERCISE, tp_mlp.EXERCISE,
                           ring_attention.EXERCISE, ulysses_attention.EXERCISE, moe_dispatch.EXERCISE,
                           layer_flops.EXERCISE)}


def _exercise(name: str) -> Exercise | ScriptExercise | LocalExercise:
    try:
        return _EXERCISES[name]
    except (KeyError, TypeError):
        raise ValueError(f"no exercise named {name!r}: choose one of {', '.join(_EXERCISES)}") from None


def names() -> tuple[str, ...]:
    """The exercises, in the order they build on each other."""
    return tuple(_EXERCISES)


def describe(name: str) -> str:
    """What to write for exercise ``name``, in one paragraph: the signature, the rules and what is checked.

    It says what, not how: ``hint(name, level)`` gives the algorithm, a step at a time.
    """
    return (f"{_exercise(name).description} Stuck? exercises.hint({name!r}) gives the idea; levels 2 and 3 give "
            "more.")


HINT_LEVELS = ("the idea", "the calls to use", "pseudo-code")


class HintText(str):
    """A hint: a str that a notebook shows as its lines, not as a quoted literal full of \\n."""

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        for i, line in enumerate(self.splitlines()):
            if i:
                p.break_()
            p.text(line)


def hint(name: str, level: int = 1) -> str:
    """Help with exercise ``name``, each level giving more away: 1 the idea, 2 the calls to use, 3 pseudo-code.

    After level 3 comes ``solution(name)``. A notebook shows the text as it is; elsewhere, ``print`` it.
    """
    exercise = _exercise(name)
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(HINT_LEVELS):
        raise ValueError(f"hint({name!r}, level={level!r}): level is 1 (the idea), 2 (the calls to use) or 3 "
                         "(pseudo-code)")
    if level < len(HINT_LEVELS):
        more = f"More: exercises.hint({name!r}, {level + 1}) gives {HINT_LEVELS[level]}."
    else:
        what = "the path of the reference script" if isinstance(exercise, ScriptExercise) else "the reference"
        more = f"Still stuck? exercises.solution({name!r}) is {what}."
    head = f"Hint {level} of {len(HINT_LEVELS)} for {name} ({HINT_LEVELS[level - 1]}):"
    return HintText(f"{head}\n{exercise.hints[level - 1]}\n{more}")


def check(name: str, fn: Callable[..., Any] | str | os.PathLike[str], *, world_sizes: Sequence[int] | None = None,
          timeout_s: float = 10.0) -> CheckResult:
    """Run ``fn`` on every rank at each world size (the exercise's default: see ``describe``) and judge it.

    Returns a ``CheckResult``: ``passed``, and ``feedback`` saying what was wrong,
    on which rank and where (or what was verified). A hung call ends after
    ``timeout_s`` seconds and is reported with the peer it waited for. The
    verdict is added to ``results/progress.jsonl`` (see ``progress``).

    ``ddp_script`` takes the path of a script file instead of a function, and
    runs it under torchrun; a script still running after ``30 + 6 * timeout_s``
    seconds is stopped. A path that is not a file raises FileNotFoundError.

    ``layer_flops`` is arithmetic: it runs ``fn`` in this process, with no ranks (and takes no ``world_sizes``).
    """
    exercise = _exercise(name)
    if isinstance(exercise, LocalExercise):
        if world_sizes is not None:
            raise ValueError(f"world_sizes={world_sizes!r} is invalid: {name} runs in this process, with no ranks")
        if not callable(fn):
            raise TypeError(f"check({name!r}, fn) needs your function; got {fn!r}")
        result = exercise.run(fn)
    elif isinstance(exercise, ScriptExercise):
        path = script_path(name, fn)
        result = exercise.run(path, check_world_sizes(exercise, world_sizes), timeout_s)
    elif not callable(fn):
        raise TypeError(f"check({name!r}, fn) needs your function; got {fn!r}")
    else:
        result = run_check(exercise, fn, check_world_sizes(exercise, world_sizes), timeout_s)
    _progress.record("exercise", name, result.passed)
    return result


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


def progress(progress_log: str | Path | None = None, predictions_log: str | Path | None = None) -> Progress:
    """Where you stand: every exercise and every bug of the bug zoo, and the predictions you locked in.

    Returns a ``Progress``, shown in a notebook as two tables under a one-line summary:

    - ``.checks``, a DataFrame with one row per exercise and per bug: ``kind`` ("exercise" or "bug"),
      ``name``, ``status`` ("passed" once a check passed, "not yet" after failing checks only, or
      "not tried"), ``attempts`` and ``last_checked``;
    - ``.predictions``, a DataFrame with one row per question revealed with a guess locked in (its
      latest reveal): ``question``, ``guess``, ``measured``, ``agrees`` and ``revealed``.

    Both are read from files under the working directory, ``results/progress.jsonl`` (written by
    ``check`` and ``bugzoo.check``) and ``results/predictions.jsonl`` (``dtlab.predict``), unless
    other paths are given.
    """
    items = [("exercise", name) for name in names()] + [("bug", name) for name in bugzoo.names()]
    return _progress.progress(items, progress_log, predictions_log)


__all__ = ["CheckResult", "Progress", "check", "describe", "hint", "names", "progress", "solution", "stub"]
