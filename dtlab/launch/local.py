"""A notebook-safe multi-process launcher.

``launch(fn, world_size)`` runs ``fn(info, *args)`` on every rank, each in its
own process with ``torch.distributed`` initialised, and returns their return
values. Processes come from a forkserver that has torch preloaded (fast, and
never a fork of the kernel, which may have CUDA initialised) or from plain
spawn. Functions defined in a notebook travel as cloudpickle bytes; results
come back as bytes too (a tensor in a child's shared memory dies with it).
What runs inside each rank is ``dtlab.launch.rank``.

Guarantees: a free port bound to loopback, one exception naming the failing
rank with its own traceback, a hung collective ends after ``timeout_s``, and no
rank process survives the call however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import cloudpickle
import numpy as np

from dtlab.core import registry
from dtlab.core.config import check_world_cap
from dtlab.core.failures import OpState, RankFailure
from dtlab.instrument.ops import OP_NAMES
from dtlab.instrument.unseen import warn_unseen
from dtlab.launch import lifeline
from dtlab.launch.contract import LaunchOptions, LaunchResult, LaunchStopped, Progress, ProgressBar, launch_error
from dtlab.launch.flight import Dumps
from dtlab.launch.rank import LIVE_SLOTS, rank_main

# Imported once in the forkserver, so every rank starts with them loaded (seconds saved per launch).
# torch._dynamo alone costs 0.7 s: the first optimizer a rank builds imports it. Every tier too (DTensor and
# the pipelining schedules are another 1-2 s), although a process outside the forkserver imports only its own.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "cloudpickle", "numpy",
            "dtlab.launch.rank", "dtlab.train", *(registry.module_name(name) for name in registry.COURSE)]
_GRACE_S = 0.5  # after the first failure, time for the victims' reports to arrive
_WATCHDOG_SLACK_S = 5.0  # the process group's own timeout gets the first chance to end a hung collective
_forkserver_ready = False
_MAIN_LOCK = threading.Lock()


def context(start_method: str) -> mp.context.BaseContext:
    global _forkserver_ready
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={start_method!r}: use 'forkserver' or 'spawn' (never fork a kernel)")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and not _forkserver_ready:
        ctx.set_forkserver_preload(_PRELOAD)
        _forkserver_ready = True
    return ctx


def shutdown() -> None:
    """Stop the idle forkserver kept for fast relaunches (also done at exit)."""
    global _forkserver_ready
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        server._stop()
    _forkserver_ready = False


@contextlib.contextmanager
def main_not_reimported() -> Any:
    """Keep rank processes from re-running the caller's script.

    multiprocessing re-imports ``__main__`` in each child so that pickled
    references resolve; dtlab sends functions by value (cloudpickle), so the
    re-import is only harm: a script without a ``__main__`` guard would run again.
    """
    # One at a time: launches running side by side in threads (the ft launcher's replica groups) would
    # otherwise save each other's blanked names and put those back.
    with _MAIN_LOCK:
        main = sys.modules.get("__main__")
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
        try:
            if main is not None:
                main.__dict__.pop("__file__", None)
                main.__dict__["__spec__"] = None
            yield
        finally:
            if main is not None:
                main.__dict__.update(saved)
                if "__spec__" not in saved:
                    main.__dict__.pop("__spec__", None)


def loopback_store(world_size: int, timeout_s: float) -> Any:
    """A TCPStore listening on 127.0.0.1 only, on a port the OS picks.

    TCPStore binds every interface when given a port; handing it a socket we
    bound to loopback ourselves keeps the store off the network.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, world_size))
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, world_size + 1, True,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns and closes it
    )
    return store, port


def kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(5)


def op_states(live: np.ndarray, world_size: int, finished: set[int]) -> list[OpState]:
    now = time.time()
    states = []
    for r in range(world_size):
        seq, code, in_flight, entered, step = live[r * LIVE_SLOTS:(r + 1) * LIVE_SLOTS]
        states.append(OpState(r, OP_NAMES.get(int(code), "?"), int(seq), bool(in_flight),
                              now - entered if entered else 0.0, int(step), r in finished))
    return states


def tail_text(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class Ranks:
    """One local launch: its rank processes, what they sent home, and what went wrong.

    ``start`` the ranks, then ``wait`` (poll, watchdog, stop, deadline),
    ``teardown`` however that ended, and ``collect`` the result or the error.
    """

    grace_s = _GRACE_S

    def __init__(self, ctx: mp.context.BaseContext, world_size: int, options: LaunchOptions) -> None:
        self.ctx, self.world_size, self.options = ctx, world_size, options
        self.live_buffer = ctx.RawArray("d", LIVE_SLOTS * world_size)
        self.live = np.frombuffer(self.live_buffer, dtype=np.float64)
        self.log_dir = str(lifeline.temporary_folder("dtlab-launch-"))  # the reaper's if this process dies
        self.log_paths = [os.path.join(self.log_dir, f"rank{r}.log") for r in range(world_size)]
        self.procs: list[Any] = []
        self.readers: dict[Any, int] = {}  # the pipe each rank sends home on, until it closes
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}
        self.logs: dict[int, str] = {}
        self.note = ""  # why the launcher ended the run, if it did
        self.bar = ProgressBar(options.progress)
        self.started = time.perf_counter()
        self.first_failure_at: float | None = None
        self.alive_r, self.alive_w = ctx.Pipe(duplex=False)

    # -- start ------------------------------------------------------------------
    def start(self, payload: bytes, port: int) -> None:
        options = self.options.for_ranks()
        for r in range(self.world_size):
            reader, writer = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=rank_main, name=f"dtlab-rank{r}", daemon=True,
                                 args=(payload, r, self.world_size, port, writer, self.live_buffer,
                                       self.log_paths[r], options, self.alive_r))
            with main_not_reimported():
                p.start()
            writer.close()
            self.procs.append(p)
            self.readers[reader] = r

    # -- wait -------------------------------------------------------------------
    def wait(self) -> None:
        """Poll the ranks until all have answered, one failed (plus a grace), or the launcher ends the run."""
        while True:
            self._receive()
            self._note_silent_deaths()
            if self._settled() or self._watchdog():
                return
            if self.options.stop_requested():
                raise LaunchStopped(f"stopped on request after {time.perf_counter() - self.started:.1f} s")
            if self._past_deadline():
                return

    def _receive(self) -> None:
        sentinels = [p.sentinel for p in self.procs if p.exitcode is None]
        for conn in [c for c in wait(list(self.readers) + sentinels, timeout=0.2) if c in self.readers]:
            rank = self.readers[conn]
            try:
                kind, body = conn.recv()
            except (EOFError, OSError):
                del self.readers[conn]
                continue
            self._handle(rank, kind, body)

    def _handle(self, rank: int, kind: str, body: Any) -> None:
        if kind == "ok":
            self.results[rank] = cloudpickle.loads(body)
        elif kind == "error":
            self.failures[rank] = body.to_failure()
            self.failures[rank].log_tail = tail_text(self.log_paths[rank])
        elif kind == "progress":
            self.bar.update(body)

    def _note_silent_deaths(self) -> None:
        """A rank that exited without a word (a signal, os._exit) and whose pipe has nothing left to read."""
        now = time.time()
        for r, p in enumerate(self.procs):
            silent = p.exitcode is not None and r not in self.results and r not in self.failures
            if silent and r not in self.readers.values():
                self.failures[r] = RankFailure(r, "died", time=now, exitcode=p.exitcode,
                                               log_tail=tail_text(self.log_paths[r]))

    def _settled(self) -> bool:
        if self.failures:
            self.first_failure_at = self.first_failure_at or time.perf_counter()
            if (time.perf_counter() - self.first_failure_at > self.grace_s
                    or len(self.failures) + len(self.results) == self.world_size):
                return True
        return len(self.results) == self.world_size

    def _watchdog(self) -> bool:
        """A collective still in flight well after ``timeout_s``: the process group did not end it, so we do."""
        timeout_s = self.options.timeout_s
        hung = [s for s in op_states(self.live, self.world_size, set(self.results))
                if s.in_flight and s.since_s > timeout_s + _WATCHDOG_SLACK_S]
        if not hung or self.failures:
            return False
        self.note = f"watchdog: a collective exceeded timeout_s={timeout_s:g} s"
        for s in hung:
            self.failures[s.rank] = RankFailure(s.rank, "timeout", message=s.describe(), time=time.time())
        return True

    def _past_deadline(self) -> bool:
        deadline_s = self.options.deadline_s
        if deadline_s is None or time.perf_counter() - self.started <= deadline_s:
            return False
        self.note = f"the launch ran past deadline_s={deadline_s:g} s and was stopped"
        for r in range(self.world_size):
            if r not in self.results and r not in self.failures:  # a failure's own report stays
                self.failures[r] = RankFailure(r, "timeout", message="still running at the deadline", time=time.time())
        return True

    # -- teardown and collect ---------------------------------------------------------
    def kill(self) -> None:
        kill_all(self.procs)

    def ask_for_dumps(self, dumps: Dumps) -> None:
        """A failed launch: every rank still running (hung, or busy while the others timed out) dumps its
        Flight Recorder buffer before teardown kills it; those that raised dumped already."""
        if self.failures:
            running = [r for r, p in enumerate(self.procs) if p.exitcode is None and r not in self.results]
            dumps.request(dumps.missing(running))

    def teardown(self) -> None:
        """However the launch ended: no rank survives, every pipe closes, the logs are read and removed."""
        self.alive_w.close()  # every rank process, even one whose pid never reached us, now exits
        self.alive_r.close()
        self.bar.close()
        kill_all(self.procs)
        for conn in self.readers:
            conn.close()
        self.logs = {r: read_text(path) for r, path in enumerate(self.log_paths)}
        lifeline.remove_folder(self.log_dir)
        warn_unseen(self.logs.values())  # once per path no rank's recorder could see

    def collect(self, flight: dict[int, bytes]) -> LaunchResult:
        """The values in rank order, or the error that names the culprit first (with the ranks' dumps)."""
        if self.failures:
            ops = op_states(self.live, self.world_size, set(self.results))
            raise launch_error(list(self.failures.values()), ops, self.note, flight=flight)
        values = [self.results[r] for r in range(self.world_size)]
        return LaunchResult(values, self.logs, time.perf_counter() - self.started, flight=flight)


def _payload(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        return cloudpickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise ValueError(f"cannot send {fn!r} or its arguments to the ranks: {exc}") from exc


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 60.0,
    deadline_s: float | None = None,
    start_method: str = "forkserver",
    progress: Progress = True,
    record: bool = True,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    flight_recorder: bool = False,
) -> LaunchResult:
    """Run ``fn(info, *args)`` on ``world_size`` ranks and return their results.

    ``timeout_s`` bounds how long a rank may wait in one collective (the process
    group timeout, and the launcher's watchdog a little later); ``deadline_s``
    optionally bounds the whole launch. ``progress`` shows rank 0's
    ``report()`` calls with tqdm, or passes them to a callable. Setting the
    ``stop`` event (from another thread: a widget's Stop button) kills every rank
    and raises ``LaunchStopped``. ``flight_recorder`` switches PyTorch's Flight
    Recorder on in every rank; the result (or the error, as ``error.flight``)
    holds each rank's dump. See ``LaunchOptions`` and ``LaunchResult``.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: must be an integer >= 1")
    check_world_cap(world_size)
    options = LaunchOptions(backend=backend, device=device, timeout_s=timeout_s, deadline_s=deadline_s,
                            progress=progress, record=record, env=env or {}, stop=stop,
                            flight_recorder=flight_recorder)
    ctx = context(start_method)
    payload = _payload(fn, args)
    dumps = Dumps(options.flight_recorder)
    options = dataclasses.replace(options, env={**options.env, **dumps.env()})
    store, port = loopback_store(world_size, options.timeout_s)
    ranks = Ranks(ctx, world_size, options)
    try:
        ranks.start(payload, port)
        ranks.wait()
        ranks.ask_for_dumps(dumps)
    except (KeyboardInterrupt, LaunchStopped):
        ranks.kill()
        raise
    finally:
        ranks.teardown()
        del store  # the store's server stops with the launch
        flight = dumps.collect()
        dumps.close()
    return ranks.collect(flight)
