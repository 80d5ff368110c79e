"""The bug zoo: small distributed training programs, each with one planted bug, to run, diagnose and fix.

::

    from dtlab.exercises import bugzoo

    bugzoo.names()                     # the bugs, in course order
    print(bugzoo.describe("seed"))     # what the program does, what a fix must do, how it is checked
    print(bugzoo.source("seed"))       # the buggy program, to copy into a cell
    bugzoo.run("seed")                 # run it on 2 ranks and see the symptom
    bugzoo.check("seed", train)        # ✓ / ✗ with what each rank did, where and when

Each program is ``train(info)``, run on every rank by ``dtlab.launch`` with
the CommRecorder on and a short collective timeout, so a hang ends in seconds
with dtlab's last-collective-per-rank table. The last four bugs run with
PyTorch's Flight Recorder too: their hang's report reads every rank's dump and
names the rank, the collective and its sequence number (``run(name).diagnosis``),
beside torch's own analyser's verdict. A check judges what the ranks
did -- their optimizer steps, the samples they read, their collectives and
when they entered them -- never the source. ``solution(name)`` is the
reference fix. Every verdict is added to ``results/progress.jsonl``:
``exercises.progress()`` shows which bugs are fixed and which are not yet.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtlab.core.failures import RankError
from dtlab.core.flight import torch_verdict
from dtlab.core.flight_diagnosis import Diagnosis, diagnose
from dtlab.core.results import RunResult
from dtlab.exercises._check import CheckResult, failure_feedback
from dtlab.exercises._progress import record
from dtlab.exercises.bugzoo import (
    collective_order,
    rank_branch,
    seed,
    set_epoch,
    skipped_collective,
    straggler,
    stuck_rank,
    uneven_batches,
    unused_parameter,
    wrong_group,
)
from dtlab.exercises.bugzoo._zoo import Bug, RankRun, as_run_result, launch_program
from dtlab.exercises.bugzoo._zoo import check as _check

_BUGS: dict[str, Bug] = {b.name: b for b in (seed.BUG, set_epoch.BUG, rank_branch.BUG, unused_parameter.BUG,
                                            uneven_batches.BUG, straggler.BUG, skipped_collective.BUG,
                                            collective_order.BUG, wrong_group.BUG, stuck_rank.BUG)}
_COMMON_IMPORTS = ("from typing import Any", "import torch", "import torch.distributed as dist",
                   "import torch.nn.functional as F", "from dtlab.exercises.bugzoo import kit")
DEFAULT_TIMEOUT_S = 3.0


def _bug(name: str) -> Bug:
    try:
        return _BUGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"no bug named {name!r}: choose one of {', '.join(_BUGS)}") from None


def names() -> tuple[str, ...]:
    """The bugs, in course order."""
    return tuple(_BUGS)


def describe(name: str) -> str:
    """What bug ``name``'s program does, what a fix must do, how it is checked, and which tool names the bug."""
    bug = _bug(name)
    return f"{bug.title}. {bug.description}\nThe tool that names it: {bug.tool}."


def source(name: str) -> str:
    """The buggy program (and the helpers it calls) as text, with its imports: paste it into a cell and fix it."""
    bug = _bug(name)
    lines = (*_COMMON_IMPORTS, *bug.imports)
    by_root = [[ln for ln in lines if ln.split()[1].split(".")[0] in roots]
               for roots in (("time", "typing"), ("torch",), ("dtlab",))]  # stdlib, third party, dtlab
    imports = "\n\n".join("\n".join(sorted(group, key=lambda ln: ln.startswith("from"))) for group in by_root)
    module = inspect.getmodule(bug.buggy)
    values = "".join(f"{c} = {getattr(module, c)!r}\n" for c in bug.constants)
    parts = [inspect.getsource(f) for f in (*bug.helpers, bug.buggy)]
    return imports + "\n\n" + values + "\n\n" + "\n\n".join(parts)


def program(name: str) -> Callable[..., Any]:
    """The buggy program itself (``train(info)``), to run or launch."""
    return _bug(name).buggy


def solution(name: str) -> Callable[..., Any]:
    """The reference fix of bug ``name`` (read it with ``inspect.getsource``)."""
    return _bug(name).fixed


@dataclass
class ZooRun:
    """One run of a zoo program: every rank's record, or the launch's error; ``result`` for dtlab.read.

    For a bug run with Flight Recorder: ``flight`` holds each rank's dump and ``diagnosis`` what they say
    (the rank, the collective, its sequence number; see ``dtlab.core.flight_diagnosis``)."""

    name: str
    ranks: list[RankRun] | None
    error: RankError | None
    report: str
    flight: dict[int, bytes] = field(default_factory=dict, repr=False)
    diagnosis: Diagnosis | None = None

    @property
    def result(self) -> RunResult:
        """The recorded collectives as a RunResult (``dtlab.read.stragglers.straggler(run.result)``)."""
        if self.ranks is None:
            raise ValueError(f"the {self.name} run failed, so there is nothing to analyse: {self.report}")
        return as_run_result(self.ranks)

    def __repr__(self) -> str:
        return f"{self.name}: {self.report}"


def run(name: str, fn: Callable[..., Any] | None = None, *, world_size: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None, show: bool = True) -> ZooRun:
    """Run bug ``name``'s program (or ``fn``) on ``world_size`` ranks and say what happened.

    A hang ends after ``timeout_s`` seconds; the report then gives the culprit and
    dtlab's last-collective-per-rank table. ``env`` goes to every rank (e.g.
    ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``). ``show`` prints the report.
    """
    bug = _bug(name)
    try:
        ranks = launch_program(fn or bug.buggy, world_size, timeout_s, env, flight_recorder=bug.flight_recorder)
    except RankError as err:
        lines = [failure_feedback(err, timeout_s), "last collective per rank (dtlab's CommRecorder):"]
        lines += [f"  {s.describe()}" for s in err.ops]
        flight = getattr(err, "flight", {})
        found = diagnose(flight) if flight else None
        if found is not None:
            lines += ["Flight Recorder, every rank's dump read by dtlab:", f"  {found}", torch_verdict(flight)]
        zoo = ZooRun(name, None, err, "\n".join(lines), flight, found)
    else:
        zoo = ZooRun(name, ranks, None, _symptom(bug, ranks))
    if show:
        print(zoo.report)
    return zoo


def _symptom(bug: Bug, ranks: list[RankRun]) -> str:
    """What a finished run shows; the bug's own words need two ranks that both stepped."""
    steps = ", ".join(f"rank {r}: {len(run.steps)}" for r, run in enumerate(ranks))
    if len(ranks) < 2 or not all(len(run.steps) >= 2 for run in ranks):
        return f"the program finished (optimizer steps per rank: {steps})."
    return bug.symptom(ranks)


def check(name: str, fixed: Callable[..., Any] | int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> CheckResult:
    """Run ``fixed`` (your ``train(info)``) at the bug's world sizes and judge what the ranks did.

    For ``straggler``, ``fixed`` may also be a rank: your answer to "which rank is slow?". The verdict is
    added to ``results/progress.jsonl``: ``exercises.progress()`` lists every bug, passed or not yet.
    """
    bug = _bug(name)
    if name == "straggler" and isinstance(fixed, int) and not isinstance(fixed, bool):
        ranks = launch_program(bug.buggy, 2, timeout_s)
        passed, feedback = straggler.judge_answer(fixed, ranks)
        result = CheckResult(name, passed, feedback)
    elif not callable(fixed):
        raise TypeError(f"check({name!r}, fixed) needs your train(info) function; got {fixed!r}")
    else:
        result = _check(bug, fixed, timeout_s)
    record("bug", name, result.passed)
    return result


__all__ = ["CheckResult", "ZooRun", "check", "describe", "names", "program", "run", "solution",
           "source"]
