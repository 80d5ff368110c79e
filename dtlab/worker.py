"""The entry point dtlab runs under torchrun: ``python -m dtlab.worker WORKDIR``.

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

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle

from dtlab.results import atomic_write

PAYLOAD = "payload.pkl"
CONFIG = "config.json"
EVENTS = "events.jsonl"
_EVENTS_ENV = "DTLAB_WORKDIR"


def result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result-rank{rank}.pkl"


def error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error-rank{rank}.json"


def progress_path(workdir: Path) -> Path:
    return workdir / "progress.jsonl"


def emit_to(workdir: Path, kind: str, **fields: Any) -> None:
    """Append one event to WORKDIR's events file (one short line per write, so lines never interleave)."""
    line = json.dumps({"time": time.time(), "kind": kind, **fields}, default=str) + "\n"
    fd = os.open(workdir / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def emit(kind: str, **fields: Any) -> None:
    """Record an event of this worker (rank, node and attempt added); a no-op outside a torchrun worker."""
    path = os.environ.get(_EVENTS_ENV)
    if path:
        emit_to(Path(path), kind, rank=int(os.environ.get("RANK", -1)),
                node=int(os.environ.get("GROUP_RANK", 0)), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                world_size=int(os.environ.get("WORLD_SIZE", 0)), **fields)


def read_events(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / EVENTS
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a SIGKILL
            events.append(json.loads(line))
    return sorted(events, key=lambda e: e["time"])


def read_config(workdir: Path) -> Any:
    """The RunConfig in WORKDIR/config.json (a cluster job, see ``dtlab.cluster``)."""
    from dtlab.config import RunConfig

    return RunConfig.from_dict(json.loads((workdir / CONFIG).read_text()))


def _load(workdir: Path) -> tuple[Any, tuple, dict[str, Any]]:
    """The function, its arguments and the launch options that WORKDIR holds."""
    if (workdir / PAYLOAD).exists():
        return cloudpickle.loads((workdir / PAYLOAD).read_bytes())
    if (workdir / CONFIG).exists():
        from dtlab.train import train

        cfg = read_config(workdir)
        # A config.json run is a cluster's: gloo takes the interface the host name resolves to
        # (or GLOO_SOCKET_IFNAME), never loopback.
        return train, (cfg,), {"backend": cfg.backend, "device": cfg.device, "timeout_s": cfg.timeout_s,
                               "gloo_ifname": None}
    raise FileNotFoundError(f"{workdir} holds neither {PAYLOAD} nor {CONFIG}: nothing to run")


class _ProgressFile:
    """Stands in for the launcher's pipe: dtlab.report() appends JSON lines."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker

    def send(self, message: tuple[str, dict[str, Any]]) -> None:
        self.file.write(json.dumps(message[1], default=str) + "\n")


def main(workdir: Path) -> int:
    from dtlab import launcher

    rank = int(os.environ["RANK"])
    os.environ[_EVENTS_ENV] = str(workdir)
    if rank == 0:
        launcher._rank_conn, launcher._rank_id = _ProgressFile(progress_path(workdir)), 0
    try:
        emit("worker_start", local_rank=int(os.environ.get("LOCAL_RANK", 0)), pid=os.getpid(), agent_pid=os.getppid())
        fn, args, options = _load(workdir)
        gloo_ifname = options.get("gloo_ifname", "lo")  # dtlab's own launches keep gloo on loopback
        if gloo_ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo_ifname)
        from dtlab.env import DistInfo

        info = DistInfo.init(options["backend"], options["device"], options["timeout_s"])
        emit("process_group_ready")
        value = launcher.call_recorded(fn, info, args, options.get("record", True))
        atomic_write(result_path(workdir, rank), cloudpickle.dumps(value))
        emit("worker_finish")
        DistInfo.cleanup()
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        report = {"rank": rank, "error_type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc(), "time": time.time(),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}
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
        sys.exit("usage: python -m dtlab.worker WORKDIR")
    sys.exit(main(Path(sys.argv[1])))
