"""What every exercise shares: the result, the exercise record, running the learner's function, and failures.

A check launches the learner's function once per world size (every test case
runs inside that one launch), brings home what each rank saw -- its tensors and
the calls its CommRecorder recorded -- and judges it in the notebook's process.
Judging reads behaviour and recorded communication only, never source text.
An exercise answered with a whole script (``ScriptExercise``) runs that script
under torchrun instead and judges what it leaves behind.

On a rank, ``call_learner`` runs the learner's function and turns an exception
into an ``ExerciseError`` that says which rank, in which test case, and for a
hung call, which call and which peer it waited for.
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtlab.core.failures import RankError, RankFailure
from dtlab.instrument.recorder import active
from dtlab.launch.local import launch

POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})
SENDS = frozenset({"send", "isend"})
RECEIVES = frozenset({"recv", "irecv"})
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


@dataclass(frozen=True)
class CheckResult:
    """The verdict on a learner's function: ``passed`` and ``feedback`` (what was wrong where, or what was verified).

    It is truthy when the check passed, and shows as ✓ or ✗ in a notebook.
    """

    name: str
    passed: bool
    feedback: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"{'✓' if self.passed else '✗'} {self.name}: {self.feedback}"

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.passed else "#cf222e"
        verdict = "passed" if self.passed else "not yet"
        return (f'<div style="border-left: 4px solid {color}; padding: 4px 10px; white-space: pre-wrap">'
                f'<b style="color: {color}">{"✓" if self.passed else "✗"} {html.escape(self.name)}: {verdict}</b>'
                f"<br>{html.escape(self.feedback)}</div>")


@dataclass(frozen=True)
class Call:
    """One recorded communication call of the learner's: the op, the bytes it carried and its peer (or root).

    ``start`` is when it was issued and ``end`` when it was seen complete (None: never waited on), on the
    rank's ``time.perf_counter()`` clock, which every process of one machine shares; ``is_async`` says
    whether it returned a work to wait on (``async_op=True``, ``isend``, ``irecv``). An all-to-all also
    carries its split sizes, ``input_splits`` and ``output_splits``; ``dtype`` is what the payload held
    ("float32", "int64"; "" when the call carried no tensor), which tells tokens from their counts.
    """

    op: str
    nbytes: int
    peer: int | None
    start: float = 0.0
    end: float | None = None
    is_async: bool = False
    # all_to_all_single: the rows sent to and received from each rank (the event's input_splits and
    # output_splits); None for other ops
    input_splits: tuple[int, ...] | None = None
    output_splits: tuple[int, ...] | None = None
    dtype: str = ""


@dataclass(frozen=True)
class Exercise:
    """One exercise: what to write, how ranks run it, how their records are judged, and its two functions.

    ``on_rank(info, fn)`` runs on every rank and returns that rank's record;
    ``judge(n, records)`` returns what is wrong at world size ``n`` (None: nothing);
    ``summary(records_by_n)`` says what was verified once every world size passed.
    """

    name: str
    description: str
    on_rank: Callable[..., Any]
    judge: Callable[[int, list[Any]], str | None]
    summary: Callable[[dict[int, list[Any]]], str]
    solution: Callable[..., Any]
    stub: Callable[..., Any]
    world_sizes: tuple[int, ...] = (2, 3, 4)
    allowed_world_sizes: tuple[int, ...] | None = None  # None: any world size >= 2
    # Three levels of help, each giving more away: the idea; the calls to use; pseudo-code.
    hints: tuple[str, str, str] = ("", "", "")


@dataclass(frozen=True)
class ScriptExercise:
    """An exercise answered with a whole script file, not a function: ``check(name, path)``.

    ``run(script, world_sizes, timeout_s)`` runs the script at each world size
    and returns the verdict; ``solution`` and ``stub`` are paths of scripts (the
    reference, and a starter that fails the check saying what to write).
    """

    name: str
    description: str
    run: Callable[[Path, Sequence[int], float], CheckResult]
    solution: str
    stub: str
    world_sizes: tuple[int, ...] = (2,)
    allowed_world_sizes: tuple[int, ...] | None = None
    hints: tuple[str, str, str] = ("", "", "")


class ExerciseError(RuntimeError):
    """The learner's function failed on a rank; the message says which rank, where, and how."""


# -- on a rank ---------------------------------------------------------------------------------------------------
def call_learner(fn: Callable[..., Any], *args: Any, where: str) -> tuple[Any, tuple[Call, ...]]:
    """``fn(*args)`` with its communication recorded: (its return value, the calls it made).

    ``where`` names the test case for messages ("with 1001 elements", "in step 3").
    """
    recorder = active()
    if recorder is None:
        raise RuntimeError("dtlab.exercises needs the CommRecorder: launch with record=True")
    first = len(recorder.events)
    try:
        value = fn(*args)
    except ExerciseError:
        raise
    except Exception as exc:
        raise ExerciseError(_explain(exc, recorder.events[first:], where)) from exc
    return value, tuple(_call(ev) for ev in recorder.events[first:])


def _call(ev: Any) -> Call:
    extra = ev.extra or {}
    splits = [tuple(extra[k]) if k in extra else None for k in ("input_splits", "output_splits")]
    return Call(ev.op, int(ev.bytes), ev.peer, ev.start, ev.end, bool(ev.is_async), *splits, dtype=ev.dtype or "")


def recorder_now() -> float:
    """The CommRecorder's clock (the one ``Call.start`` is on): a checker notes its own moments with it."""
    recorder = active()
    if recorder is None:
        raise RuntimeError("dtlab.exercises needs the CommRecorder: launch with record=True")
    return recorder.now()


def _explain(exc: Exception, events: list[Any], where: str) -> str:
    rank = dist.get_rank()
    first_line = _first_line(exc)
    context = "; ".join(filter(None, [where, _location(exc)]))
    if "timed out" in first_line.lower():
        call = ordinal(1 + sum(ev.end is not None for ev in events))
        # "timed out waiting" also marks the report as a consequence, so that a rank's own error is named first
        return f"rank {rank} timed out waiting in {_stuck_call(exc, events)} (its {call} call, {context})"
    return f"rank {rank} raised {type(exc).__name__} ({context}): {first_line}"


def _first_line(exc: Exception) -> str:
    """The exception's message, short: its first line, without gloo's "[file.cc:123]" prefix and advice."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1].split(". ", 1)[0]
    return text


def _stuck_call(exc: Exception, events: list[Any]) -> str:
    """The call a timed-out rank was waiting in, with its peer: read from torch's frame, else the open transfers."""
    tb, frame = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("distributed_c10d.py"):
            frame = tb.tb_frame
        tb = tb.tb_next
    if frame is not None:
        op, local = frame.f_code.co_name, frame.f_locals
        if op in SENDS:
            return f"{op} to rank {local.get('dst', local.get('group_dst'))}"
        if op in RECEIVES:
            src = local.get("src", local.get("group_src"))
            return f"{op} from {'any rank' if src is None else f'rank {src}'}"
        return op
    open_calls = [f"{ev.op} {'to' if ev.op in SENDS else 'from'} rank {ev.peer}"
                  for ev in events if ev.end is None and ev.op in POINT_TO_POINT]
    return "wait() for " + " and ".join(open_calls) if open_calls else "a call"


def _location(exc: Exception) -> str:
    """Where in the learner's own code the exception came from: the innermost frame outside torch and dtlab."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_SKIP_DIRS):
            where = f"in {code.co_name}, line {tb.tb_lineno}"
        tb = tb.tb_next
    return where


# -- in the notebook ---------------------------------------------------------------------------------------------
def run_check(exercise: Exercise, fn: Callable[..., Any], world_sizes: Sequence[int], timeout_s: float) -> CheckResult:
    """Launch ``fn`` at each world size in turn and judge it; the first problem ends the check."""
    records: dict[int, list[Any]] = {}
    for n in world_sizes:
        try:
            values = launch(exercise.on_rank, n, args=(fn,), progress=False, record=True,
                            timeout_s=timeout_s, deadline_s=30 + 3 * timeout_s).values
        except RankError as err:
            return CheckResult(exercise.name, False, f"World size {n}: {failure_feedback(err, timeout_s)}")
        except ValueError as err:
            if not str(err).startswith("cannot send"):
                raise
            return CheckResult(exercise.name, False, f"your function could not be sent to the ranks: {err}")
        problem = exercise.judge(n, values)
        if problem:
            return CheckResult(exercise.name, False, f"World size {n}: {problem}")
        records[n] = values
    return CheckResult(exercise.name, True, exercise.summary(records))


def failure_feedback(err: RankError, timeout_s: float) -> str:
    """One paragraph from a failed launch: the culprit's own message, and for a hang what usually causes it."""
    culprit = _culprit(err)
    if culprit.error_type != ExerciseError.__name__:  # a rank died, or the launcher ended the run
        return f"{culprit.headline()} ({err.note})" if err.note else culprit.headline()
    finished = [str(op.rank) for op in err.ops if op.finished]
    if culprit.looks_like_victim and finished:  # a peer returned while this rank still waited for it
        return (f"{culprit.message}. Rank {' and '.join(finished)} had already returned: every rank must make the "
                "matching calls (the same collectives in the same order, a receive for every send).")
    if not _timed_out(culprit):
        return culprit.message
    if any(f"{op} " in culprit.message for op in POINT_TO_POINT):
        hint = ("every send needs a matching receive on its peer at the same time. gloo's send waits until the "
                "receiver is there, so when every rank sends first (or receives first), all of them wait: post "
                "the send and the receive together (dist.isend and dist.irecv, or dist.batch_isend_irecv), then "
                "wait on both.")
    else:
        hint = "every rank must make the same collective calls, in the same order, with tensors of the same size."
    others = [f.message for f in sorted(err.failures, key=lambda f: f.rank) if f is not culprit and _timed_out(f)]
    return f"{culprit.message} after {timeout_s:g} s: {hint}" + (f" Meanwhile {'; '.join(others)}." if others else "")


def _timed_out(failure: RankFailure) -> bool:
    return failure.error_type == ExerciseError.__name__ and "timed out waiting" in failure.message


def _culprit(err: RankError) -> RankFailure:
    """A rank's own error first; else the first rank that timed out (the others then only lost their peer)."""
    if not err.culprit.looks_like_victim:
        return err.culprit
    return next((f for f in sorted(err.failures, key=lambda f: f.time) if _timed_out(f)), err.culprit)


# -- shared helpers ----------------------------------------------------------------------------------------------
def check_world_sizes(exercise: Exercise | ScriptExercise, world_sizes: Sequence[int] | None) -> tuple[int, ...]:
    """The world sizes to check at: the exercise's default, or the caller's if the exercise can run them."""
    sizes = tuple(exercise.world_sizes if world_sizes is None else world_sizes)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 2 for n in sizes):
        raise ValueError(f"world_sizes={world_sizes!r} is invalid: give integers >= 2 (default "
                         f"{exercise.world_sizes})")
    allowed = exercise.allowed_world_sizes
    if allowed is not None and any(n not in allowed for n in sizes):
        raise ValueError(f"world_sizes={world_sizes!r} is invalid: {exercise.name} runs at world sizes "
                         f"{', '.join(map(str, allowed))} (default {exercise.world_sizes})")
    return sizes


def script_path(name: str, path: Any) -> Path:
    """The learner's script file for a ``ScriptExercise``: a path that exists (TypeError, FileNotFoundError)."""
    if callable(path) or not isinstance(path, str | os.PathLike):
        raise TypeError(f"check({name!r}, path) needs the path of your script file (a .py file); got {path!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"check({name!r}, path): there is no file at {str(file)!r}; write your script "
                                f"there first (in a notebook: %%writefile {file.name})")
    return file.resolve()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sent_bytes(calls: Sequence[Call]) -> int:
    return sum(c.nbytes for c in calls if c.op in SENDS)


def off_ring_call(rank: int, n: int, calls: Sequence[Call]) -> tuple[Call, int] | None:
    """The first send not to rank + 1 or receive not from rank - 1, with its round (its ordinal among the sends,
    or among the receives); None when every transfer follows the ring."""
    sends = receives = 0
    for call in calls:
        if call.op in SENDS:
            sends += 1
            if call.peer != (rank + 1) % n:
                return call, sends
        elif call.op in RECEIVES:
            receives += 1
            if call.peer != (rank - 1) % n:
                return call, receives
    return None


def ops_used(calls: Sequence[Call]) -> str:
    """'all_reduce ×4, broadcast ×1': the recorded calls by op, for summaries."""
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.op] = counts.get(c.op, 0) + 1
    return ", ".join(f"{op} ×{k}" for op, k in counts.items()) or "no calls"


def ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def torch_call(exc: BaseException) -> tuple[str, dict[str, Any]] | None:
    """The torch.distributed function an exception came out of, and its arguments: the name and locals of the
    outermost frame of torch's distributed_c10d.py in the traceback (the function the learner called), so
    that a checker can say which sizes did not fit. None when the exception did not pass through one."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return tb.tb_frame.f_code.co_name, dict(tb.tb_frame.f_locals)
        tb = tb.tb_next
    return None


def first_collective(calls_per_rank: Sequence[Sequence[Call]]) -> tuple[int, Call] | None:
    """The first call that is not point-to-point, and its rank (None if every call is)."""
    for rank, calls in enumerate(calls_per_rank):
        for call in calls:
            if call.op not in POINT_TO_POINT:
                return rank, call
    return None
