"""Runs a learner's script on one torchrun rank and notes what it did, for the ``ddp_script`` check.

torchrun starts this file on every rank as ``_script_probe.py NOTES_DIR SCRIPT ARGS...``.
It wraps four torch entry points so that calling them also leaves a note:
``dist.init_process_group`` (the rank and world size it gave), the
``DistributedDataParallel`` constructor, ``torch.save`` (which file) and
``dist.barrier`` (when it returned). Then it runs SCRIPT as ``__main__`` with ARGS,
as ``python SCRIPT ARGS`` would, and writes the notes to
``NOTES_DIR/probe_rank{RANK}.json``. If the script raises, the exception and the
script's line go to ``NOTES_DIR/error_rank{RANK}.json`` before it propagates.

Times are ``time.monotonic()``, one clock for every process of the machine. This
file imports only torch and the standard library: it runs outside dtlab.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel

NOTES: list[dict[str, Any]] = []


def _noting(fn: Callable[..., Any], note: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """``fn``, which also appends ``note(*args, **kwargs)`` (read after the call) with its start and end times."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        value = fn(*args, **kwargs)
        NOTES.append({**note(*args, **kwargs), "start": start, "end": time.monotonic()})
        return value

    return wrapper


def _file_name(f: Any, *_: Any, **__: Any) -> str:
    target = f if isinstance(f, str | os.PathLike) else getattr(f, "name", "")
    return os.path.basename(os.fspath(target)) if isinstance(target, str | os.PathLike) else ""


def install() -> None:
    """Wrap the four entry points (in ``torch.distributed`` and in ``distributed_c10d``, where both are looked up)."""
    init = _noting(dist.init_process_group,
                   lambda *a, **k: {"call": "init", "rank": dist.get_rank(), "world": dist.get_world_size()})
    barrier = _noting(dist.barrier, lambda *a, **k: {"call": "barrier"})
    for module in (dist, c10d):
        module.init_process_group, module.barrier = init, barrier
    torch.save = _noting(torch.save, lambda obj, f, *a, **k: {"call": "save", "file": _file_name(f)})
    DistributedDataParallel.__init__ = _noting(DistributedDataParallel.__init__, lambda *a, **k: {"call": "ddp"})


def _error(exc: BaseException, script: str) -> dict[str, Any]:
    """The exception, its message's first line, and the innermost line of the script it came through."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == script:
            line = tb.tb_lineno
        tb = tb.tb_next
    message = (str(exc).strip().splitlines() or [""])[0]
    return {"type": type(exc).__name__, "message": message, "line": line, "time": time.monotonic()}


def main() -> None:
    notes_dir, script, args = Path(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]
    rank = os.environ.get("RANK", "0")
    install()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as exc:
        (notes_dir / f"error_rank{rank}.json").write_text(json.dumps(_error(exc, script)))
        raise
    finally:
        (notes_dir / f"probe_rank{rank}.json").write_text(json.dumps(NOTES))


if __name__ == "__main__":
    main()
