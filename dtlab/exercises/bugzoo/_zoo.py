"""Running a zoo program on ranks and reading back what it did: its optimizer steps, its data, its calls.

A check launches the learner's program (``train(info)``) with the CommRecorder
on, watches every optimizer step on every rank (a global step hook: the
parameters before and after, the gradients), the indices ``kit.Samples`` was
asked for, and the collectives. It judges those, never the source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dtlab.core.failures import RankError
from dtlab.core.flight_diagnosis import diagnose
from dtlab.core.results import RankResult, RunResult
from dtlab.exercises._check import Call, CheckResult, call_learner, failure_feedback
from dtlab.exercises._values import max_abs
from dtlab.exercises.bugzoo import kit
from dtlab.instrument.recorder import active
from dtlab.launch.local import launch

TOL = 1e-5


@dataclass(frozen=True)
class Step:
    """One optimizer step of one rank: the parameters before it, the gradients it used, the parameters after."""

    before: torch.Tensor
    grads: torch.Tensor
    after: torch.Tensor


@dataclass(frozen=True)
class RankRun:
    """What one rank of a zoo program did."""

    value: Any
    steps: tuple[Step, ...]
    final: torch.Tensor | None  # the parameters when the program returned (None: it made no optimizer)
    fetched: tuple[tuple[int, ...], ...]  # kit.Samples indices, per epoch
    calls: tuple[Call, ...]
    events: list[dict[str, Any]] = field(repr=False, default_factory=list)


@dataclass(frozen=True)
class Bug:
    """One planted bug: the buggy program, the reference fix, and how a run is judged.

    ``judge(runs)`` gets the ranks' records per world size and returns what is
    wrong (None: nothing); ``summary(runs)`` says what was verified; ``symptom``
    describes a buggy run that finished (a hang or crash speaks for itself).
    ``helpers``, ``constants`` (names in the bug's module) and ``imports`` are
    what the program's source needs besides torch and kit, to run from a cell.
    """

    name: str
    title: str
    tool: str
    description: str
    buggy: Callable[..., Any]
    fixed: Callable[..., Any]
    judge: Callable[[dict[int, list[RankRun]]], str | None]
    summary: Callable[[dict[int, list[RankRun]]], str]
    symptom: Callable[[list[RankRun]], str]
    world_sizes: tuple[int, ...] = (2,)
    helpers: tuple[Callable[..., Any], ...] = ()
    constants: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    flight_recorder: bool = False  # run with PyTorch's Flight Recorder: a hang's report reads the ranks' dumps


def _flat(tensors: Iterator[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _params(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    return (p for g in opt.param_groups for p in g["params"])


@contextlib.contextmanager
def _watch_steps(steps: list[Step], optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Note every optimizer step in this process (any optimizer the program makes)."""
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pre(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads = _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in _params(opt))
        pending[id(opt)] = (_flat(_params(opt)), grads)
        if opt not in optimizers:
            optimizers.append(opt)

    def post(opt: torch.optim.Optimizer, *_: Any) -> None:
        before, grads = pending.pop(id(opt))
        steps.append(Step(before, grads, _flat(_params(opt))))

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def on_rank(info: Any, fn: Callable[..., Any]) -> RankRun:
    """Run the program on this rank and keep what it did."""
    kit.fetched[:] = [[]]
    steps: list[Step] = []
    optimizers: list[torch.optim.Optimizer] = []
    with _watch_steps(steps, optimizers):
        value, calls = call_learner(fn, info, where="in your training program")
    final = _flat(_params(optimizers[-1])) if optimizers else None
    rec = active()
    events = rec.rows() if rec is not None else []
    fetched = tuple(tuple(e) for e in kit.fetched if e)
    if isinstance(value, torch.nn.Module):  # a module holds process-group state: send its parameters home
        value = _flat(value.parameters())
    return RankRun(value, tuple(steps), final, fetched, calls, events)


def launch_program(fn: Callable[..., Any], n: int, timeout_s: float, env: dict[str, str] | None = None,
                   flight_recorder: bool = False) -> list[RankRun]:
    """Every rank's record (RankError, or ValueError when ``fn`` cannot be sent, if the launch failed).

    With ``flight_recorder`` a failed launch's error carries the ranks' dumps (``err.flight``)."""
    return launch(on_rank, n, args=(fn,), progress=False, record=True, timeout_s=timeout_s,
                  deadline_s=30 + 3 * timeout_s, env=env, flight_recorder=flight_recorder).values


def flight_reading(err: RankError) -> str:
    """What the ranks' Flight Recorder dumps say about a failed launch (empty without dumps): dtlab's diagnosis."""
    dumps = getattr(err, "flight", None)
    return f"Flight Recorder: {diagnose(dumps)}" if dumps else ""


def torch_detail(err: RankError) -> str:
    """What torch added below its error's first line that names the cause (e.g. DDP's unused parameters)."""
    lines = [ln.strip() for ln in err.culprit.traceback.splitlines() + err.culprit.message.splitlines()]
    keep = [ln for ln in lines if ln.startswith(("Parameters which did not receive grad",
                                                 "Parameter indices which did not receive grad"))]
    return " ".join(dict.fromkeys(keep))


def hang_table(err: RankError) -> str:
    """dtlab's last-collective-per-rank table, in one line."""
    return "; ".join(s.describe() for s in err.ops)


def check(bug: Bug, fn: Callable[..., Any], timeout_s: float) -> CheckResult:
    """Launch ``fn`` at each of the bug's world sizes and judge what every rank did."""
    runs: dict[int, list[RankRun]] = {}
    for n in bug.world_sizes:
        try:
            runs[n] = launch_program(fn, n, timeout_s, flight_recorder=bug.flight_recorder)
        except RankError as err:
            table, detail = hang_table(err), torch_detail(err)
            parts = [failure_feedback(err, timeout_s), detail, f"Last collective per rank: {table}" if table else "",
                     flight_reading(err)]
            feedback = " ".join(p if p.endswith(".") else p + "." for p in parts if p)
            return CheckResult(bug.name, False, f"World size {n}: {feedback}")
        except ValueError as err:
            if not str(err).startswith("cannot send"):
                raise
            return CheckResult(bug.name, False, f"your program could not be sent to the ranks: {err}")
    problem = bug.judge(runs)
    return CheckResult(bug.name, problem is None, problem or bug.summary(runs))


def as_run_result(ranks: Sequence[RankRun], wall_s: float = 0.0) -> RunResult:
    """The ranks' recorded calls as a RunResult, for ``dtlab.read`` (stragglers, timelines)."""
    return RunResult(None, [RankResult(rank=r, steps=[], memory={}, events=run.events, phases=[],
                                       params_checksum=0.0) for r, run in enumerate(ranks)], wall_s)


# -- judging, shared by several bugs -------------------------------------------------------------------------------
def replicas_disagree(ranks: list[RankRun]) -> str | None:
    """The first step at which a rank's parameters or gradients differ from rank 0's (None: they never do)."""
    if not ranks[0].steps:
        return "no optimizer step was seen on rank 0: train the model with a torch.optim optimizer."
    for s, st0 in enumerate(ranks[0].steps):
        for r, run in enumerate(ranks[1:], 1):
            if s >= len(run.steps):
                continue
            st = run.steps[s]
            if (d := max_abs(st.before, st0.before)) > TOL:
                start = (" They started different: every replica must start from the same parameters (the same "
                         "seed on every rank, or a broadcast from rank 0)." if s == 0 else "")
                return (f"before optimizer step {s}, rank {r}'s parameters differed from rank 0's by {d:.2g}: "
                        f"the replicas are not the same model.{start}")
            if (d := max_abs(st.grads, st0.grads)) > TOL:
                return (f"at optimizer step {s}, rank {r}'s gradients differed from rank 0's by {d:.2g}: every "
                        "rank must step with the same (averaged) gradients.")
    finals = [run.final for run in ranks]
    for r, final in enumerate(finals[1:], 1):
        if final is not None and finals[0] is not None and (d := max_abs(final, finals[0])) > TOL:
            return f"after training, rank {r}'s parameters differ from rank 0's by {d:.2g}."
    return None


def parity_problem(single: list[RankRun], ranks: list[RankRun]) -> str | None:
    """The distributed run against one process (world size 1): the same parameters after training?"""
    a, b = single[0].final, ranks[0].final
    if a is None or b is None:
        return "no optimizer step was seen: train the model with a torch.optim optimizer."
    if len(single[0].steps) != len(ranks[0].steps):
        return (f"one process took {len(single[0].steps)} optimizer steps, but rank 0 of the distributed run took "
                f"{len(ranks[0].steps)}.")
    if (d := max_abs(a, b)) > TOL:
        return (f"after training, the parameters differ by {d:.2g} from the same program run by one process "
                "(parity): the distributed run must train the same model.")
    return None
