"""PyTorch's Flight Recorder in dtlab's ranks: the environment that switches it on, and the dumps ranks leave.

With ``flight_recorder`` on, a launcher gives every rank ``TORCH_FR_BUFFER_SIZE`` (torch reads it when the
process group starts) and ``DTLAB_FR_DIR``, a folder where each rank writes its dump as ``rank_<R>``, in the
pickle format torch's ``fr_trace`` reads:

- at the end of its function, before it reports its value;
- when it raises, before it reports the error (a collective's timeout included);
- whenever the launcher asks, by touching ``dump-request`` in that folder: a thread in every rank watches
  for it. This is how a rank that never raises leaves a dump -- one stuck in a collective whose timeout has
  not fired yet, or in its own computation while the others time out -- before the launcher kills it. A
  thread, not a signal handler: Python runs handlers only in the main thread, between bytecodes, and a rank
  blocked in gloo (or in a long C++ call) would run it too late or never.

gloo leaves ``pg_config`` empty in its dumps (torch 2.13); the rank fills it in from its own process groups
(name, description, global ranks), so that torch's analyser can match collectives across ranks.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

from dtlab.core import compat
from dtlab.core.results import atomic_write
from dtlab.launch import lifeline

BUFFER_ENTRIES = 2000  # per process: the last 2000 collectives
DIR_ENV = "DTLAB_FR_DIR"
REQUEST = "dump-request"
_POLL_S = 0.05
_LOCK = threading.Lock()


def rank_env(folder: str | os.PathLike[str]) -> dict[str, str]:
    """What a rank's environment needs, before its process group starts, to record and leave its dump."""
    return {compat.FR_BUFFER_ENV: str(BUFFER_ENTRIES), DIR_ENV: str(folder)}


def dump_path(folder: str | os.PathLike[str], rank: int) -> Path:
    return Path(folder) / f"rank_{rank}"


# -- in a rank ----------------------------------------------------------------------------------------------------
def arm(rank: int) -> None:
    """Start the thread that dumps when the launcher asks (nothing unless ``DTLAB_FR_DIR`` is set)."""
    folder = os.environ.get(DIR_ENV)
    if folder:
        threading.Thread(target=_watch, args=(Path(folder), rank), name="dtlab-fr-dump", daemon=True).start()


def dump_on_sigterm(rank: int) -> None:
    """Dump when SIGTERM comes (torchrun's agent stops the survivors of a failed rank with it), then die of it.

    From a thread that waits for the signal, not a handler: a survivor is usually blocked in the collective
    its failed peer never joined, where a handler would run only when gloo's timeout fires -- and torchrun
    waits 30 s before it sends SIGKILL. Call it before any other thread starts: SIGTERM is blocked in this
    thread and in every thread started after it, so that it reaches the waiting thread alone."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_die_of_sigterm, args=(rank,), name="dtlab-fr-sigterm", daemon=True).start()


def _die_of_sigterm(rank: int) -> None:
    signal.sigwait({signal.SIGTERM})
    dump(rank, "terminated")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # SIGTERM's default action: the process ends
    os._exit(128 + signal.SIGTERM)  # reached only where something replaced that default


def _watch(folder: Path, rank: int) -> None:
    seen = None
    while True:
        time.sleep(_POLL_S)
        try:
            stamp = (folder / REQUEST).stat().st_mtime_ns
        except OSError:
            continue
        if stamp != seen:
            seen = stamp
            dump(rank, "request")


def dump(rank: int, reason: str, error: str = "") -> None:
    """Write this rank's Flight Recorder buffer (``reason``: "end", "error" or "request"); never raises:
    a dump that fails must not hide what the rank was doing."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return
    try:
        with _LOCK:
            data = compat.flight_recorder_dump()
            groups = compat.process_groups()  # empty once the process group is destroyed
            if groups:
                data["pg_config"] = groups
            data["dtlab"] = {"rank": rank, "reason": reason, "error": error[-2000:], "dumped_ns": time.time_ns()}
            atomic_write(dump_path(folder, rank), pickle.dumps(data))
    except Exception:  # noqa: BLE001 - reported in the rank's log, never raised
        print(f"dtlab: rank {rank} could not write its Flight Recorder dump:\n{traceback.format_exc()}",
              file=sys.stderr)


# -- in the launcher ------------------------------------------------------------------------------------------------
class Dumps:
    """One launch's Flight Recorder folder: the ranks' environment, asking them to dump, reading what they left.

    ``folder`` None: a temporary folder, removed by ``close``. Disabled, it does nothing and reads nothing.
    """

    def __init__(self, enabled: bool, folder: str | os.PathLike[str] | None = None) -> None:
        self.enabled = enabled
        self.own = enabled and folder is None
        self.folder = lifeline.temporary_folder("dtlab-fr-") if self.own else Path(folder or ".")
        if enabled:
            self.folder.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return rank_env(self.folder) if self.enabled else {}

    def request(self, ranks: Iterable[int], wait_s: float = 3.0) -> None:
        """Ask every rank to dump now, and wait (at most ``wait_s``) until each of ``ranks`` has left a dump."""
        if not self.enabled:
            return
        ranks = list(ranks)
        (self.folder / REQUEST).write_text(str(time.time_ns()))
        deadline = time.monotonic() + wait_s
        while self.missing(ranks) and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def missing(self, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` that have left no dump."""
        return [r for r in ranks if not dump_path(self.folder, r).exists()] if self.enabled else []

    def collect(self) -> dict[int, bytes]:
        """Each rank's dump (the bytes of its ``rank_<R>`` file), in rank order."""
        if not self.enabled or not self.folder.is_dir():
            return {}
        found = {}
        for path in self.folder.glob("rank_*"):
            suffix = path.name.removeprefix("rank_")
            if suffix.isdigit():
                with contextlib.suppress(OSError):
                    found[int(suffix)] = path.read_bytes()
        return dict(sorted(found.items()))

    def clear(self) -> None:
        """Remove the dumps left so far: ranks that outlive one job (``dtlab.launch.session``) dump again for
        the next, and an earlier job's dump must not pass for the next one's."""
        if self.enabled:
            for path in self.folder.glob("rank_*"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.own:
            lifeline.remove_folder(self.folder)

