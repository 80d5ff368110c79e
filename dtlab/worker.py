"""The entry point dtlab runs under torchrun: ``python -m dtlab.worker WORKDIR``.

torchrun's agent starts one of these per local rank with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. The worker loads the function
that ``launch_torchrun`` left in WORKDIR (cloudpickle), runs it with the
process group initialised, and leaves its result -- or its error -- as a file
in WORKDIR, written atomically, for the launcher to collect.
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

from dtlab.results import atomic_write

PAYLOAD = "payload.pkl"


def result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result-rank{rank}.pkl"


def error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error-rank{rank}.json"


def progress_path(workdir: Path) -> Path:
    return workdir / "progress.jsonl"


class _ProgressFile:
    """Stands in for the launcher's pipe: dtlab.report() appends JSON lines."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker

    def send(self, message: tuple[str, dict[str, Any]]) -> None:
        self.file.write(json.dumps(message[1], default=str) + "\n")


def main(workdir: Path) -> int:
    from dtlab import launcher

    rank = int(os.environ["RANK"])
    fn, args, options = cloudpickle.loads((workdir / PAYLOAD).read_bytes())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", options.get("gloo_ifname", "lo"))
    if rank == 0:
        launcher._rank_conn, launcher._rank_id = _ProgressFile(progress_path(workdir)), 0
    try:
        from dtlab.env import DistInfo

        info = DistInfo.init(options["backend"], options["device"], options["timeout_s"])
        value = launcher.call_recorded(fn, info, args, options.get("record", True))
        atomic_write(result_path(workdir, rank), cloudpickle.dumps(value))
        DistInfo.cleanup()
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt included
        report = {"rank": rank, "error_type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc(), "time": time.time(),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}
        atomic_write(error_path(workdir, rank), json.dumps(report).encode())
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
