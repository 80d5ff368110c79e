"""A notebook-safe multi-process launcher.

``launch(fn, world_size)`` runs ``fn(info, *args)`` on every rank, each in its
own process with ``torch.distributed`` initialised, and returns their return
values. Processes come from a forkserver that has torch preloaded (fast, and
never a fork of the kernel, which may have CUDA initialised) or from plain
spawn. Functions defined in a notebook travel as cloudpickle bytes; results
come back as bytes too (a tensor in a child's shared memory dies with it).

Guarantees: a free port bound to loopback, one exception naming the failing
rank with its own traceback, a hung collective ends after ``timeout_s``, and no
rank process survives the call however it ends.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import cloudpickle
import numpy as np

from dtlab.failures import CollectiveTimeout, ErrorReport, OpState, RankError, RankFailure

LIVE_SLOTS = 5  # per rank: collective count, op code, in flight, entered at, step
# Imported once in the forkserver, so every rank starts with them loaded (seconds saved per launch).
# torch._dynamo alone costs 0.7 s: the first optimizer a rank builds imports it.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "cloudpickle", "numpy", "sklearn.datasets",
            "dtlab.launcher", "dtlab.train"]
_GRACE_S = 0.5  # after the first failure, time for the victims' reports to arrive
_forkserver_ready = False

# Set inside a rank process by _rank_main; used by report().
_rank_conn: Any = None
_rank_id: int | None = None


class LaunchStopped(RuntimeError):
    """The caller asked a running launch to stop; every rank was killed."""


class LaunchResult(list):
    """The ranks' return values in rank order, plus each rank's output."""

    logs: dict[int, str]
    wall_s: float


def report(**progress: Any) -> None:
    """Send progress (e.g. step=3, total=50, loss=0.7) from this rank to the launcher.

    A ``progress`` callable given to ``launch`` receives every rank's reports (with
    ``rank`` added); the tqdm bar follows rank 0's.
    """
    if _rank_conn is not None:
        with contextlib.suppress(OSError):
            _rank_conn.send(("progress", {**progress, "rank": _rank_id}))


def _context(start_method: str) -> mp.context.BaseContext:
    global _forkserver_ready
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={start_method!r}: use 'forkserver' or 'spawn' (never fork a kernel)")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and not _forkserver_ready:
        from dtlab.tiers import TIERS

        ctx.set_forkserver_preload(_PRELOAD + list(TIERS.values()))
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
def _main_not_reimported() -> Any:
    """Keep rank processes from re-running the caller's script.

    multiprocessing re-imports ``__main__`` in each child so that pickled
    references resolve; dtlab sends functions by value (cloudpickle), so the
    re-import is only harm: a script without a ``__main__`` guard would run again.
    """
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


def _loopback_store(world_size: int, timeout_s: float) -> Any:
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


def call_recorded(fn: Callable[..., Any], info: Any, args: tuple, record: bool, live: Any = None) -> Any:
    """``fn(info, *args)`` with this process's CommRecorder on (unless ``record`` is False)."""
    from dtlab.instrument import CommRecorder

    recorder = CommRecorder(info.rank, live=live)
    if record:
        recorder.start()
    try:
        return fn(info, *args)
    finally:
        recorder.stop()


def _exit_with_launcher(alive: Any) -> None:
    """Block until the launch's liveness pipe closes, then end this rank at once."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv()
    os._exit(1)


def _rank_main(payload: bytes, args_payload: bytes, rank: int, world_size: int, port: int, conn: Any,
               live_buffer: Any, log_path: str, options: dict[str, Any], alive: Any) -> None:
    """Body of every rank process."""
    global _rank_conn, _rank_id
    os.setpgid(0, 0)  # own process group, so teardown reaches anything it starts
    # A rank the launcher cannot kill by pid (interrupted while starting it) still
    # ends: the launcher closes this pipe however the launch ends.
    threading.Thread(target=_exit_with_launcher, args=(alive,), daemon=True).start()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # C++ warnings from gloo land in the rank's log too
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    _rank_conn, _rank_id = conn, rank
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets stay on loopback
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key, value in options.get("env", {}).items():
        os.environ[key] = str(value)
    try:
        import torch.distributed as dist

        # The forkserver imported torch before this environment existed; c10d reads
        # TORCH_DISTRIBUTED_DEBUG at import, so read it again.
        dist.set_debug_level_from_env()

        from dtlab.env import DistInfo

        live = np.frombuffer(live_buffer, dtype=np.float64)[rank * LIVE_SLOTS:(rank + 1) * LIVE_SLOTS]
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, False,
                              timeout=datetime.timedelta(seconds=options["timeout_s"]))
        fn = cloudpickle.loads(payload)
        fn_args = cloudpickle.loads(args_payload)
        info = DistInfo.init(options["backend"], options["device"], options["timeout_s"],
                             store=store, rank=rank, world_size=world_size)
        value = call_recorded(fn, info, fn_args, options.get("record", True), live)
        conn.send(("ok", cloudpickle.dumps(value)))
        DistInfo.cleanup()
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        report_ = ErrorReport(rank, type(exc).__name__, str(exc), traceback.format_exc(), time.time())
        with contextlib.suppress(Exception):
            conn.send(("error", report_))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit: a broken process group can hang in its destructor
    finally:
        conn.close()


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(5)


def _op_states(live: np.ndarray, world_size: int, finished: set[int]) -> list[OpState]:
    from dtlab.instrument import OP_NAMES

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
    progress: bool | Callable[[dict[str, Any]], None] = True,
    record: bool = True,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
) -> LaunchResult:
    """Run ``fn(info, *args)`` on ``world_size`` ranks and return their results.

    ``timeout_s`` bounds how long a rank may wait in one collective (the process
    group timeout, and the launcher's watchdog a little later); ``deadline_s``
    optionally bounds the whole launch. ``progress`` shows rank 0's
    ``report()`` calls with tqdm, or passes them to a callable. Setting the
    ``stop`` event (from another thread: a widget's Stop button) kills every rank
    and raises ``LaunchStopped``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: must be an integer >= 1")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} is invalid: must be > 0 seconds")
    ctx = _context(start_method)
    try:
        payload = cloudpickle.dumps(fn)
        args_payload = cloudpickle.dumps(tuple(args))
    except Exception as exc:
        raise ValueError(f"cannot send {fn!r} or its arguments to the ranks: {exc}") from exc

    store, port = _loopback_store(world_size, timeout_s)
    live_buffer = ctx.RawArray("d", LIVE_SLOTS * world_size)
    live = np.frombuffer(live_buffer, dtype=np.float64)
    log_dir = tempfile.mkdtemp(prefix="dtlab-launch-")
    log_paths = [os.path.join(log_dir, f"rank{r}.log") for r in range(world_size)]
    options = {"backend": backend, "device": device, "timeout_s": timeout_s, "record": record, "env": env or {}}
    procs, readers = [], {}
    started = time.perf_counter()
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    bar = ProgressBar(progress)
    watchdog_note = ""
    alive_r, alive_w = ctx.Pipe(duplex=False)
    try:
        for r in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"dtlab-rank{r}", daemon=True,
                            args=(payload, args_payload, r, world_size, port, writer, live_buffer,
                                  log_paths[r], options, alive_r))
            with _main_not_reimported():
                p.start()
            writer.close()
            procs.append(p)
            readers[reader] = r
        first_failure_at: float | None = None
        while True:
            ready = wait(list(readers) + [p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
            for conn in [c for c in ready if c in readers]:
                rank = readers[conn]
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):
                    del readers[conn]
                    continue
                if kind == "ok":
                    results[rank] = cloudpickle.loads(body)
                elif kind == "error":
                    failures[rank] = body.to_failure()
                    failures[rank].log_tail = tail_text(log_paths[rank])
                elif kind == "progress":
                    bar.update(body)
            now = time.time()
            for r, p in enumerate(procs):
                silent = p.exitcode is not None and r not in results and r not in failures
                if silent and not any(readers.get(c) == r for c in readers):
                    failures[r] = RankFailure(r, "died", time=now, exitcode=p.exitcode,
                                              log_tail=tail_text(log_paths[r]))
            if failures:
                first_failure_at = first_failure_at or time.perf_counter()
                if time.perf_counter() - first_failure_at > _GRACE_S or len(failures) + len(results) == world_size:
                    break
            if len(results) == world_size:
                break
            hung = [s for s in _op_states(live, world_size, set(results))
                    if s.in_flight and s.since_s > timeout_s + 5.0]
            if hung and not failures:
                watchdog_note = f"watchdog: a collective exceeded timeout_s={timeout_s:g} s"
                for s in hung:
                    failures[s.rank] = RankFailure(s.rank, "timeout", message=s.describe(), time=now)
                break
            if stop is not None and stop.is_set():
                raise LaunchStopped(f"stopped on request after {time.perf_counter() - started:.1f} s")
            if deadline_s is not None and time.perf_counter() - started > deadline_s:
                watchdog_note = f"the launch ran past deadline_s={deadline_s:g} s and was stopped"
                for r in range(world_size):
                    if r not in results:
                        failures[r] = RankFailure(r, "timeout", message="still running at the deadline", time=now)
                break
    except (KeyboardInterrupt, LaunchStopped):
        _kill_all(procs)
        raise
    finally:
        alive_w.close()  # every rank process, even one whose pid never reached us, now exits
        alive_r.close()
        bar.close()
        _kill_all(procs)
        for conn in readers:
            conn.close()
        del store
    logs = {r: read_text(path) for r, path in enumerate(log_paths)}
    shutil.rmtree(log_dir, ignore_errors=True)
    if failures:
        ops = _op_states(live, world_size, set(results))
        timed_out = any(f.kind == "timeout" or "timed out" in f.message.lower() for f in failures.values())
        cls = CollectiveTimeout if timed_out else RankError
        raise cls(list(failures.values()), ops, watchdog_note)
    out = LaunchResult(results[r] for r in range(world_size))
    out.logs = logs
    out.wall_s = time.perf_counter() - started
    return out


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class ProgressBar:
    """tqdm (notebook-aware) over rank 0's reports, created on the first one."""

    def __init__(self, progress: bool | Callable[[dict[str, Any]], None]) -> None:
        self.progress = progress
        self.bar: Any = None

    def update(self, info: dict[str, Any]) -> None:
        if callable(self.progress):
            self.progress(info)
            return
        if not self.progress or "step" not in info or info.get("rank", 0) != 0:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=info.get("total"), desc=info.get("desc", "rank 0"), unit="step", leave=False)
        self.bar.n = info["step"]
        if "loss" in info:
            self.bar.set_postfix(loss=f"{info['loss']:.4f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
