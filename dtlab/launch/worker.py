"""The entry point dtlab runs under torchrun: ``python -m dtlab.launch.worker WORKDIR``.

torchrun's agent starts one of these per local rank with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. The worker loads what WORKDIR
holds -- the function ``launch_torchrun`` left there (cloudpickle), or a
``config.json`` that ``python -m dtlab cluster`` wrote (a RunConfig to
train) -- runs it with the process group initialised, and leaves its result,
or its error, as a file in WORKDIR, written atomically, for the launcher to
collect. On a cluster WORKDIR is a shared directory; the same command runs
on every node.

Workers also append events (start, restart, snapshot, fault, ...) to
``events.jsonl`` in WORKDIR: ``emit`` is how the tiers add theirs.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle

from dtlab.core import progress
from dtlab.core.config import resolve_import_path
from dtlab.core.env import DistInfo
from dtlab.core.events import WORKDIR_ENV, emit
from dtlab.core.results import FLIGHT_DIR, atomic_write
from dtlab.launch import flight, lifeline
from dtlab.launch.contract import RankOptions
from dtlab.launch.rank import call_recorded
from dtlab.launch.workdir import CONFIG, PAYLOAD, error_path, progress_path, read_config, result_path

# What a config.json job runs on each rank. Named, not imported: the training loop sits above launch.
TRAIN_ENTRY = "dtlab.train.loop:train"


def _load(workdir: Path) -> tuple[Any, tuple, RankOptions]:
    """The function, its arguments and the rank options that WORKDIR holds."""
    if (workdir / PAYLOAD).exists():
        return cloudpickle.loads((workdir / PAYLOAD).read_bytes())
    if (workdir / CONFIG).exists():
        train = resolve_import_path(TRAIN_ENTRY)
        cfg = read_config(workdir)
        if cfg.flight_recorder:  # a cluster's ranks leave their Flight Recorder dumps in WORKDIR
            os.environ.update(flight.rank_env(workdir / FLIGHT_DIR))
        # A config.json run is a cluster's: gloo takes the interface the host name resolves to
        # (or GLOO_SOCKET_IFNAME), never loopback.
        return train, (cfg,), RankOptions(cfg.backend, cfg.device, cfg.timeout_s, gloo_ifname=None)
    raise FileNotFoundError(f"{workdir} holds neither {PAYLOAD} nor {CONFIG}: nothing to run")


class _ProgressFile:
    """Stands in for the launcher's pipe: dtlab.report() appends JSON lines."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker

    def send(self, message: tuple[str, dict[str, Any]]) -> None:
        self.file.write(json.dumps(message[1], default=str) + "\n")


def _arm_flight_recorder(rank: int) -> None:
    """With Flight Recorder on: dump when the launcher asks, and when torchrun's agent stops this worker
    (SIGTERM, sent to the survivors once one rank failed): dump, then die of the signal as before."""
    if not os.environ.get(flight.DIR_ENV):
        return
    flight.dump_on_sigterm(rank)  # first: the threads started after it must not take SIGTERM themselves
    flight.arm(rank)


def _die_with_agent() -> None:
    """SIGKILL when this worker's torchrun agent ends: torchrun's workers run in sessions of their own, so
    nothing else reaches them once their agent was killed. Under dtlab's launcher the agent runs wrapped
    (``dtlab.launch.lifeline``) and says its pid: a worker whose agent died before this line exits."""
    expected = os.environ.get(lifeline.LIFELINE_PID_ENV, "")
    lifeline.die_with_parent(int(expected) if expected.isdigit() else None)


def main(workdir: Path) -> int:
    _die_with_agent()
    rank = int(os.environ["RANK"])
    os.environ[WORKDIR_ENV] = str(workdir)
    if rank == 0:
        progress.attach(_ProgressFile(progress_path(workdir)), 0)
    try:
        emit("worker_start", local_rank=int(os.environ.get("LOCAL_RANK", 0)), pid=os.getpid(), agent_pid=os.getppid())
        fn, args, options = _load(workdir)
        if options.gloo_ifname:  # dtlab's own launches keep gloo on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", options.gloo_ifname)
        _arm_flight_recorder(rank)
        info = DistInfo.init(options.backend, options.device, options.timeout_s)
        emit("process_group_ready")
        value = call_recorded(fn, info, args, options.record)
        flight.dump(rank, "end")
        atomic_write(result_path(workdir, rank), cloudpickle.dumps(value))
        emit("worker_finish")
        DistInfo.cleanup()
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        report = {"rank": rank, "error_type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc(), "time": time.time(),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}
        flight.dump(rank, "error", f"{report['error_type']}: {report['message']}")
        atomic_write(error_path(workdir, rank), json.dumps(report).encode())
        emit("worker_error", error_type=type(exc).__name__, message=str(exc)[:500])
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch + gloo can abort there even after
    # destroy_process_group ("terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dtlab.launch.worker WORKDIR")
    sys.exit(main(Path(sys.argv[1])))
