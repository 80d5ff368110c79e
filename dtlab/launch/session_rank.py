"""What runs inside a rank of a persistent session (``dtlab.launch.session``): join the process group once,
then run cell after cell in one namespace that lives as long as the process.

The set-up is a launched rank's (``dtlab.launch.rank``): its own process group, the parent-death signal, the
launcher's liveness pipe, its output in its log file, Flight Recorder's dump thread. Each cell runs with a
CommRecorder of its own, so what comes home is that cell's collectives only; an exception is reported as a
launched rank reports it (an ErrorReport with the traceback of the cell's own lines), and the rank then waits
for the next cell: whether its process group is still usable is the parent's call, which sees every rank.

A name the notebook sends is bound in the namespace unless this rank has one of its own by that name: a model
built by an earlier cell stays the rank's even where the notebook has a ``model`` too.
"""

from __future__ import annotations

import datetime
import linecache
import os
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist

from dtlab.core import progress
from dtlab.core.env import DistInfo
from dtlab.core.failures import ErrorReport
from dtlab.instrument.recorder import CommRecorder
from dtlab.launch import flight, lifeline
from dtlab.launch.contract import RankOptions
from dtlab.launch.rank import LIVE_SLOTS, exit_with_launcher, redirect_output, set_environment

# What every rank's namespace starts with; the parent never sends a notebook's value under these names.
PRESET = ("rank", "world_size", "info", "device", "dist", "torch")


class Cells:
    """One rank's namespace and the cells run in it."""

    def __init__(self, info: DistInfo, live: Any, record: bool) -> None:
        self.rank, self.live, self.record = info.rank, live, record
        self.namespace: dict[str, Any] = {"__name__": "__ranks__", "rank": info.rank, "world_size": info.world_size,
                                          "info": info, "device": info.device, "dist": dist, "torch": torch}
        self.sent: dict[str, Any] = {}  # name -> the notebook's object, while no cell on this rank rebinds it

    def owned(self) -> list[str]:
        """The names this rank's cells bound (and the preset ones): the notebook's values never replace them."""
        ns = self.namespace
        for name in [n for n, obj in self.sent.items() if n not in ns or ns[n] is not obj]:
            del self.sent[name]  # rebound or deleted by a cell: no longer the notebook's
        return sorted(n for n in ns if not n.startswith("__") and n not in self.sent)

    def _receive(self, names: dict[str, bytes]) -> None:
        mine = set(self.owned())
        for name, blob in names.items():
            if name not in mine:
                self.namespace[name] = self.sent[name] = cloudpickle.loads(blob)

    def run(self, cell: int, code: str, names: dict[str, bytes]) -> tuple[str, Any]:
        """Run one cell; ("ok", pickled extras) or ("error", ErrorReport with the extras)."""
        filename = f"<%%ranks cell {cell}>"
        # Tracebacks and the Flight Recorder's stacks show the cell's own lines, as they would in the notebook.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        recorder = CommRecorder(self.rank, live=self.live)
        error: BaseException | None = None
        t0 = recorder.now()
        try:
            self._receive(names)
            if self.record:
                recorder.start()
            exec(compile(code, filename, "exec"), self.namespace)
        except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt or SystemExit in a cell is its error too
            error = exc
        finally:
            recorder.stop()
            sys.stdout.flush()  # the parent reads the log once the reply arrives: all of it must be there
            sys.stderr.flush()
        recorder.phases.append(("cell", t0, recorder.now(), -1))
        extra = {"rows": recorder.rows(), "phases": recorder.phase_rows(), "owned": self.owned()}
        if error is None:
            return "ok", cloudpickle.dumps(extra)
        # The first frame is this method's: the learner's traceback starts at their cell.
        tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(error), error, tb))
        report = ErrorReport(self.rank, type(error).__name__, str(error), text, time.time(), extra)
        flight.dump(self.rank, "error", f"{report.error_type}: {report.message}")
        return "error", report


def _fail(conn: Any, rank: int, exc: BaseException) -> NoReturn:
    report = ErrorReport(rank, type(exc).__name__, str(exc), traceback.format_exc(), time.time())
    flight.dump(rank, "error", f"{report.error_type}: {report.message}")
    try:
        conn.send(("error", report))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit: a broken process group can hang in its destructor


def session_main(rank: int, world_size: int, port: int, conn: Any, live_buffer: Any, log_path: str,
                 options: RankOptions, alive: Any) -> None:
    """Body of a session's rank: join the process group, say so, then run each cell the parent sends."""
    os.setpgid(0, 0)  # own process group: the notebook's interrupt (SIGINT to the kernel's group) stays there
    lifeline.die_with_parent()  # SIGKILL when the forkserver ends: the kernel died
    threading.Thread(target=exit_with_launcher, args=(alive,), daemon=True).start()
    redirect_output(log_path)
    progress.attach(conn, rank)
    set_environment(rank, world_size, port, options)
    flight.arm(rank)
    live = np.frombuffer(live_buffer, dtype=np.float64)[rank * LIVE_SLOTS:(rank + 1) * LIVE_SLOTS]
    try:
        dist.set_debug_level_from_env()  # the forkserver imported torch before this environment existed
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, False,
                              timeout=datetime.timedelta(seconds=options.timeout_s))
        info = DistInfo.init(options.backend, options.device, options.timeout_s, store=store, rank=rank,
                             world_size=world_size)
        cells = Cells(info, live, options.record)
        conn.send(("ok", cloudpickle.dumps({"rows": [], "phases": [], "owned": cells.owned()})))
    except BaseException as exc:  # noqa: BLE001 - reported home, then this process ends
        _fail(conn, rank, exc)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent closed the session
            break
        if message[0] != "run":
            break
        conn.send(cells.run(*message[1:]))
    os._exit(0)  # no destructor of a process group that another rank may have left mid-collective
