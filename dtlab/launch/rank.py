"""What runs inside a rank process that ``launch`` started (and ``call_recorded``, which torchrun's workers share).

A rank leads its own process group, writes its output to its log file, reports
to the launcher over a pipe, and ends itself the moment the launcher's liveness
pipe closes. Its result goes home as cloudpickle bytes (a tensor in a child's
shared memory dies with it); an error goes home as an ErrorReport.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from dtlab.core import progress
from dtlab.core.env import DistInfo
from dtlab.core.failures import ErrorReport
from dtlab.instrument.recorder import CommRecorder
from dtlab.launch import flight, lifeline
from dtlab.launch.contract import RankOptions

LIVE_SLOTS = 5  # per rank: collective count, op code, in flight, entered at, step


def call_recorded(fn: Callable[..., Any], info: Any, args: tuple, record: bool, live: Any = None) -> Any:
    """``fn(info, *args)`` with this process's CommRecorder on (unless ``record`` is False)."""
    recorder = CommRecorder(info.rank, live=live)
    if record:
        recorder.start()
    try:
        return fn(info, *args)
    finally:
        recorder.stop()


def exit_with_launcher(alive: Any) -> None:
    """Block until the launch's liveness pipe closes, then end this rank at once."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv()
    os._exit(1)


def redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # C++ warnings from gloo land in the rank's log too
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def set_environment(rank: int, world_size: int, port: int, options: RankOptions) -> None:
    if options.gloo_ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", options.gloo_ifname)  # gloo's own sockets stay on loopback
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(options.env)


def _run(payload: bytes, rank: int, world_size: int, port: int, live_buffer: Any, options: RankOptions) -> Any:
    """Join the process group through the launcher's store and run the function."""
    import torch.distributed as dist

    # The forkserver imported torch before this environment existed; c10d reads
    # TORCH_DISTRIBUTED_DEBUG at import, so read it again.
    dist.set_debug_level_from_env()

    live = np.frombuffer(live_buffer, dtype=np.float64)[rank * LIVE_SLOTS:(rank + 1) * LIVE_SLOTS]
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, False,
                          timeout=datetime.timedelta(seconds=options.timeout_s))
    fn, args = cloudpickle.loads(payload)
    info = DistInfo.init(options.backend, options.device, options.timeout_s,
                         store=store, rank=rank, world_size=world_size)
    return call_recorded(fn, info, args, options.record, live)


def rank_main(payload: bytes, rank: int, world_size: int, port: int, conn: Any, live_buffer: Any,
              log_path: str, options: RankOptions, alive: Any) -> None:
    """Body of every rank process: set up, run ``fn(info, *args)``, send the value (or the error) home."""
    os.setpgid(0, 0)  # own process group, so teardown reaches anything it starts
    # SIGKILL when the forkserver (or, with spawn, the launcher) ends, even while this rank holds the GIL
    # in C code and the thread below cannot run.
    lifeline.die_with_parent()
    # A rank the launcher cannot kill by pid (interrupted while starting it) still
    # ends: the launcher closes this pipe however the launch ends.
    threading.Thread(target=exit_with_launcher, args=(alive,), daemon=True).start()
    redirect_output(log_path)
    progress.attach(conn, rank)
    set_environment(rank, world_size, port, options)
    flight.arm(rank)  # with Flight Recorder on: dump when the launcher asks (a rank stuck anywhere)
    try:
        value = _run(payload, rank, world_size, port, live_buffer, options)
        flight.dump(rank, "end")  # before the value goes home: the launcher may end this process after it
        conn.send(("ok", cloudpickle.dumps(value)))
        DistInfo.cleanup()
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        report = ErrorReport(rank, type(exc).__name__, str(exc), traceback.format_exc(), time.time())
        flight.dump(rank, "error", f"{report.error_type}: {report.message}")
        with contextlib.suppress(Exception):
            conn.send(("error", report))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit: a broken process group can hang in its destructor
    finally:
        conn.close()
