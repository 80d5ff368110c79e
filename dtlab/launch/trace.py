"""``dtlab trace -- torchrun ... script.py ARGS``: an unmodified script's collectives, steps and memory per rank.

``command`` turns the user's command line into one that runs every rank through ``dtlab.launch.traced``
(which starts the recorder, then runs the script as ``__main__``): torchrun's own options are kept as
given, with ``-m dtlab.launch.traced`` put in front of the script. ``run`` starts it in a session of its own
that ends with this process (``dtlab.launch.lifeline``), waits, and gathers what each rank left into the
same ``RunResult`` a dtlab run returns, so that it is saved, read and plotted the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.run import get_args_parser

from dtlab.core.results import RankResult, RunResult
from dtlab.launch import lifeline
from dtlab.launch.flight import Dumps
from dtlab.launch.torchrun import kill_session
from dtlab.launch.traced import DIR_ENV, STEP_ENV, STOP_REQUEST, TIMEOUT_ENV

TORCHRUN = ("torchrun", "torch.distributed.run")
# The dtlab this process runs: every rank must import the same one, wherever the script lives.
_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class TraceConfig:
    """What ``RunResult`` needs of a run's configuration, for a traced script (not a tier)."""

    script: str
    world_size: int
    steps: int
    command: tuple[str, ...] = ()
    tier: str = "trace"
    global_batch_size: int = 0  # unknown: the script chooses it
    flight_recorder: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "model": self.script, "dataset": "", "world_size": self.world_size,
                "steps": self.steps, "command": " ".join(self.command), "flight_recorder": self.flight_recorder}


@dataclass(frozen=True)
class Traced:
    """The command line that runs the script traced, the script, and how many ranks it starts."""

    argv: list[str]
    script: str
    world_size: int


def _torchrun_parser() -> argparse.ArgumentParser:
    parser = get_args_parser()

    def error(message: str) -> Any:  # one line, not torchrun's usage block
        raise ValueError(f"torchrun: {message}")

    parser.error = error  # type: ignore[method-assign]
    return parser


def _script(target: str, module: bool) -> str:
    if module:
        return target
    if not Path(target).is_file():
        raise ValueError(f"{target}: no such script")
    return target


def _torchrun(args: list[str]) -> Traced:
    """torchrun's options as given, and ``-m dtlab.launch.traced [-m] SCRIPT ARGS`` for the script."""
    parsed = _torchrun_parser().parse_args(args)
    if parsed.no_python:
        raise ValueError("torchrun --no-python runs a program that is not Python: dtlab can trace only Python")
    rest = list(parsed.training_script_args)
    at = len(args) - len(rest) - 1
    if at < 0 or args[at] != parsed.training_script:
        raise ValueError(f"torchrun: cannot tell where the script starts in {' '.join(args)!r}")
    script = _script(parsed.training_script, parsed.module)
    options = [a for a in args[:at] if a not in ("-m", "--module")]
    nproc = parsed.nproc_per_node
    world = int(nproc) if str(nproc).isdigit() else 1
    nnodes = str(parsed.nnodes).split(":")[-1]
    world *= int(nnodes) if nnodes.isdigit() else 1
    argv = [sys.executable, "-m", "torch.distributed.run", *options, "-m", "dtlab.launch.traced",
            *(["-m"] if parsed.module else []), script, *rest]
    return Traced(argv, script, world)


def command(user: list[str]) -> Traced:
    """The traced form of ``user`` (``torchrun ...``, ``python -m torch.distributed.run ...``, ``python SCRIPT``);
    ValueError with one line for anything else."""
    if not user:
        raise ValueError("no command to trace: give it after --, e.g. dtlab trace -- torchrun --nproc-per-node 2 "
                         "train.py")
    name = Path(user[0]).name
    if name == "torchrun":
        return _torchrun(user[1:])
    if not name.startswith("python"):
        raise ValueError(f"{user[0]}: dtlab traces a torchrun or python command, e.g. torchrun --nproc-per-node 2 "
                         "train.py")
    args = [a for a in user[1:] if a != "-u"]  # unbuffered output is this launcher's default anyway
    if args[:2] in (["-m", "torch.distributed.run"], ["-m", "torchrun"]):
        return _torchrun(args[2:])
    if not args or (args[0].startswith("-") and args[0] != "-m") or args == ["-m"]:
        raise ValueError(f"{' '.join(user)}: give python a script (or -m MODULE) and its arguments")
    module = args[0] == "-m"
    target, rest = (args[1], args[2:]) if module else (args[0], args[1:])
    script = _script(target, module)
    return Traced([sys.executable, "-m", "dtlab.launch.traced", *(["-m"] if module else []), script, *rest],
                  script, 1)


def environment(folder: Path, dumps: Dumps, step: str, timeout_s: float) -> dict[str, str]:
    """The ranks' environment: where to leave results, this dtlab first on the path, the step rule."""
    path = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", DIR_ENV: str(folder), STEP_ENV: step,
            TIMEOUT_ENV: f"{timeout_s:g}" if timeout_s > 0 else "", **dumps.env()}


def run(user: list[str], *, flight_recorder: bool = False, step: str = "optimizer", timeout_s: float = 0.0,
        flight_folder: Path | None = None) -> tuple[RunResult | None, int]:
    """Run ``user``'s command traced; (the gathered result, or None if no rank left one; its exit code).

    Its output goes to this process's terminal, as it would untraced. Ctrl-C ends torchrun, its agent and
    every rank, after each rank has handed over what it recorded so far (exit code 130); the end of this
    process ends them too (``dtlab.launch.lifeline``)."""
    traced = command(user)
    with lifeline.folder("dtlab-trace-") as work:
        dumps = Dumps(flight_recorder, flight_folder or work / "flight_recorder")
        env = environment(work, dumps, step, timeout_s)
        started = time.perf_counter()
        proc = subprocess.Popen(lifeline.dying_with_parent(traced.argv), env=env, start_new_session=True)
        stamp = lifeline.watch_process(proc.pid)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # a hang, stopped by hand: keep what the ranks recorded, then end them
            code = _stop(work, dumps, traced.world_size)
        finally:
            kill_session(proc)  # whatever it left running (a rank its agent did not stop)
            lifeline.forget_process(proc.pid, stamp)
        ranks = _ranks(work)
        if not ranks:
            return None, code or 1
        # torchrun's --nproc-per-node may be "gpu" or "auto": the ranks that reported say how many there were
        world = max(traced.world_size, ranks[-1].rank + 1)
        config = TraceConfig(traced.script, world, max(len(r.steps) for r in ranks), tuple(user),
                             flight_recorder=flight_recorder)
        return RunResult(config, ranks, time.perf_counter() - started, flight=dumps.collect()), code


def _stop(work: Path, dumps: Dumps, world_size: int, wait_s: float = 10.0) -> int:
    """Ask every rank for its record so far and its Flight Recorder dump; wait (at most ``wait_s``: a dump on a
    loaded machine takes seconds) for them. The exit code of a run stopped by Ctrl-C (130, as a shell reports it)."""
    (work / STOP_REQUEST).write_text(str(time.time_ns()))
    dumps.request(range(world_size), wait_s=wait_s)
    deadline = time.monotonic() + wait_s
    while len(list(work.glob("rank*.pkl"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return 130


def _ranks(work: Path) -> list[RankResult]:
    """What each rank left (``dtlab.launch.traced``), in rank order."""
    found = [pickle.loads(p.read_bytes()) for p in work.glob("rank*.pkl")]
    return [_with_steps(r) for r in sorted(found, key=lambda r: r.rank)]


def _with_steps(rank: RankResult) -> RankResult:
    """A traced rank has no training loop's steps if the script never stepped an optimizer: one row, so the
    summary's step time and loss read as unknown rather than fail."""
    if rank.steps:
        return rank
    return dataclasses.replace(rank, steps=[{"step": 0, "loss": math.nan, "samples": 0, "total": math.nan}])
