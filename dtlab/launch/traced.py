"""The rank side of ``dtlab trace``: ``python -m dtlab.launch.traced [-m] SCRIPT ARGS``.

``dtlab trace`` (``dtlab.launch.trace``) puts this module in front of an unmodified script, in every
rank torchrun starts. Before the script runs -- and so before its own imports -- it starts dtlab's
CommRecorder, which records at the c10d dispatcher: a name the script bound early
(``from torch.distributed import all_reduce``), DDP's C++ reducer and FSDP2's collectives are all seen.
Then it runs the script as ``__main__`` (``runpy``, as ``python script.py`` would) and, when the process
ends, leaves what it measured in ``DTLAB_TRACE_DIR/rank<R>.pkl`` for the launcher to gather:

- a step ends when an optimizer's ``step()`` returns (torch's global post-hook; a script with several
  optimizers advances once per optimizer), or, with ``DTLAB_TRACE_STEP=marker``, only where the script
  calls ``step()`` of this module; what comes before the first forward (DDP's initial broadcast) is step -1,
  as in a dtlab run;
- the loss is the last scalar that ``backward()`` was called on in the step (NaN if none);
- memory: parameters, gradients and optimizer state counted at the first step's end, peak RSS at exit;
- with Flight Recorder on (``DTLAB_FR_DIR``), the rank's dump at its end, its error, or a stop.

``DTLAB_TRACE_TIMEOUT`` (seconds) becomes the collective timeout of a process group the script starts
without one: a rank that waits for a collective its peer never issues then raises instead of hanging.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import math
import os
import pickle
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dtlab.core.memory import peak_process_bytes, tensor_bytes
from dtlab.core.results import RankResult, atomic_write, provenance
from dtlab.instrument.recorder import CommRecorder
from dtlab.launch import flight, lifeline

DIR_ENV = "DTLAB_TRACE_DIR"
STEP_ENV = "DTLAB_TRACE_STEP"  # "optimizer" (default) or "marker"
TIMEOUT_ENV = "DTLAB_TRACE_TIMEOUT"
STOP_REQUEST = "stop-request"  # the launcher, stopped (Ctrl-C), asks for what each rank has recorded so far

__all__ = ["DIR_ENV", "STEP_ENV", "STOP_REQUEST", "TIMEOUT_ENV", "main", "rank_path", "step"]


def rank_path(folder: str | os.PathLike[str], rank: int) -> Path:
    return Path(folder) / f"rank{rank}.pkl"


class _Trace:
    """What one rank measures around the script: the recorder, the steps, the memory, the loss."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.recorder = CommRecorder(rank)
        self.steps: list[dict[str, float]] = []
        self.memory: dict[str, int] = {}
        self.loss = math.nan
        self.step_start = time.perf_counter()
        self.opt_start: float | None = None
        self.written = False

    def start(self) -> None:
        self.recorder.start()
        self.recorder.step = -1  # set-up traffic until the first forward

    def first_forward(self) -> None:
        if self.recorder.step < 0:
            self.recorder.step = 0
            self.step_start = time.perf_counter()

    def count_memory(self, optimizer: Any) -> None:
        """Parameters, gradients and optimizer state after the first step, as a dtlab run counts them."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.memory = {"parameters": tensor_bytes(params),
                       "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
                       "optimizer_state": tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                                                       if isinstance(v, torch.Tensor))}

    def end_step(self) -> None:
        now, step = time.perf_counter(), max(self.recorder.step, 0)
        optimizer_s = now - self.opt_start if self.opt_start is not None else math.nan
        if self.opt_start is not None:
            self.recorder.phases.append(("optimizer", self.opt_start, now, step))
        self.steps.append({"step": step, "loss": self.loss, "samples": 0, "total": now - self.step_start,
                           "data": math.nan, "forward": math.nan, "backward": math.nan, "comm": math.nan,
                           "optimizer": optimizer_s})
        self.recorder.step = step + 1
        self.step_start, self.opt_start, self.loss = now, None, math.nan

    def write(self, folder: str, stop: bool = True) -> None:
        """This rank's RankResult, once (at exit, before a signal ends the process, or when the launcher asks).
        ``stop=False`` leaves the recorder's kernels in place: a thread must not remove them while the main
        thread may be inside one."""
        if self.written:
            return
        self.written = True
        if stop:
            self.recorder.stop()
        device = torch.device("cuda") if torch.cuda.is_available() and torch.cuda.is_initialized() else \
            torch.device("cpu")
        memory = {**self.memory, **peak_process_bytes(device)}
        backend = dist.get_backend() if dist.is_initialized() else ""
        result = RankResult(self.rank, self.steps, memory, self.recorder.rows(), self.recorder.phase_rows(),
                            math.nan, provenance=provenance(str(backend), torch.get_num_threads()))
        atomic_write(rank_path(folder, self.rank), pickle.dumps(result))


_trace: _Trace | None = None


def step() -> None:
    """Mark the end of a training step (for a script traced with ``--step marker``; a no-op otherwise)."""
    if _trace is not None and os.environ.get(STEP_ENV) == "marker":
        _trace.end_step()


def _install_hooks(trace: _Trace) -> None:
    """Step boundaries, the loss and the first forward, taken from torch's global hooks."""
    by_optimizer = os.environ.get(STEP_ENV, "optimizer") != "marker"

    def pre(optimizer: Any, *_: Any) -> None:
        trace.first_forward()  # a script whose model is no nn.Module still starts its first step here
        trace.opt_start = time.perf_counter()

    def post(optimizer: Any, *_: Any) -> None:
        if not trace.memory:
            trace.count_memory(optimizer)
        if by_optimizer:
            trace.end_step()

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    first = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: _first(trace, first))
    backward = torch.Tensor.backward

    def traced_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.numel() == 1:  # a loss: kept for the step's row (one sync per backward, as logging does)
            trace.loss = float(self.detach().float().item())
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = traced_backward  # type: ignore[method-assign]


def _first(trace: _Trace, handle: Any) -> None:
    trace.first_forward()
    handle.remove()


def _patch_process_group(trace: _Trace) -> None:
    """A default timeout for a process group started without one; a Flight Recorder dump before it ends."""
    init, destroy = dist.init_process_group, dist.destroy_process_group
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or 0)

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if timeout_s > 0 and kwargs.get("timeout") is None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        return init(*args, **kwargs)

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        if not args and kwargs.get("group") is None:  # the whole job ends: its groups are still known now
            flight.dump(trace.rank, "end")
        return destroy(*args, **kwargs)

    for module in (dist, dist.distributed_c10d):
        module.init_process_group = init_process_group  # type: ignore[assignment]
        module.destroy_process_group = destroy_process_group  # type: ignore[assignment]


def _on_exit(trace: _Trace, folder: str) -> None:
    """At the script's end: its Flight Recorder dump, unless it already left one (an error's, or the one taken as
    it destroyed its process group), then its record."""
    fr_folder = os.environ.get(flight.DIR_ENV)
    if fr_folder and not trace.written and not flight.dump_path(fr_folder, trace.rank).exists():
        flight.dump(trace.rank, "end")
    trace.write(folder)


def _watch_stop(trace: _Trace, folder: str) -> None:
    """Write what this rank has so far once the launcher asks: from a thread, since the main thread may sit in
    a collective that never completes (a hang), where neither a signal handler nor atexit would run."""
    request = Path(folder) / STOP_REQUEST
    while not request.exists():
        time.sleep(0.05)
    trace.write(folder, stop=False)


def _arm_signals(trace: _Trace, folder: str) -> None:
    """torchrun's agent stops the survivors of a failed rank with SIGTERM: dump, write, then die of it."""

    def on_term(signum: int, _frame: Any) -> None:
        flight.dump(trace.rank, "terminated")
        trace.write(folder)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)


def main(argv: list[str]) -> int:
    """Run ``argv`` (``[-m] SCRIPT ARGS``) as ``__main__`` with the recorder on; see the module."""
    global _trace
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: python -m dtlab.launch.traced [-m] SCRIPT ARGS", file=sys.stderr)
        return 2
    folder = os.environ[DIR_ENV]
    # torchrun's workers live in sessions of their own: nothing else reaches them once their agent was killed.
    # A worker whose agent died before this line exits (its parent is no longer the agent dtlab started).
    if "TORCHELASTIC_RUN_ID" in os.environ:
        expected = os.environ.get(lifeline.LIFELINE_PID_ENV, "")
        lifeline.die_with_parent(int(expected) if expected.isdigit() else None)
    rank = int(os.environ.get("RANK", 0))
    _trace = trace = _Trace(rank)
    _patch_process_group(trace)
    _install_hooks(trace)
    flight.arm(rank)
    threading.Thread(target=_watch_stop, args=(trace, folder), name="dtlab-trace-stop", daemon=True).start()
    _arm_signals(trace, folder)
    atexit.register(_on_exit, trace, folder)
    trace.start()
    module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if not module:
        sys.path[0] = str(Path(target).resolve().parent)  # as ``python SCRIPT`` sets it
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except BaseException as exc:
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            flight.dump(rank, "error", f"{type(exc).__name__}: {exc}")
        raise
    return 0


if __name__ == "__main__":
    # Run as the package's module, not as this ``__main__`` copy: the script's ``dtlab.trace_step()`` finds the
    # trace in ``dtlab.launch.traced``, and the script itself becomes ``__main__``.
    sys.exit(importlib.import_module("dtlab.launch.traced").main(sys.argv[1:]))
