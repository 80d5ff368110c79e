"""Run one function in n spawned processes at once, as the n ranks of a job share this machine.

A rank's compute timed alone on an idle machine is faster than the same compute while the job's
other ranks run beside it: they share the cores, the caches and the memory bandwidth (on two
cores, two ranks' Adam steps took 1.4-1.6x as long as one alone). So a prediction times one copy
per rank, all started together behind a barrier, and takes the slowest.

The copies come from the launcher's forkserver, which has torch, the loop and the tiers imported: a
spawned copy re-imported them, and the script that called it, each time (about 9 s of CPU per copy
under the width sweep, most of its run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dtlab.launch.local import context

__all__ = ["TIMEOUT_S", "run_together"]

TIMEOUT_S = 300.0


def _child(target: Callable[..., Any], args: tuple, start: Any, conn: Any) -> None:
    try:
        start.wait(TIMEOUT_S)  # every copy has imported what it needs: start the timed work together
        conn.send(("ok", target(*args)))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it with context
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_together(target: Callable[..., Any], per_process_args: Sequence[tuple], what: str) -> list[Any]:
    """``target(*args)`` for each ``args``, each in its own process (from the forkserver), all at once; their results in
    order. ``target`` must be importable (a module-level function). ``what`` names the work in errors."""
    ctx = context("forkserver")
    start = ctx.Barrier(len(per_process_args))
    procs, pipes = [], []
    for args in per_process_args:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(target, args, start, child), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        pipes.append(parent)
    try:
        return [_answer(pipe, what) for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _answer(pipe: Any, what: str) -> Any:
    if not pipe.poll(TIMEOUT_S):
        raise RuntimeError(f"estimate: {what} gave no answer in {TIMEOUT_S:.0f} s")
    try:
        status, value = pipe.recv()
    except EOFError:
        raise RuntimeError(f"estimate: {what} ended without an answer") from None
    if status != "ok":
        raise RuntimeError(f"estimate: {what} failed: {value}")
    return value
