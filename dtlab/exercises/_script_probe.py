"""Runs a learner's script on one torchrun rank and notes what it did, for the ``ddp_script`` check.

torchrun starts this file on every rank as ``_script_probe.py NOTES_DIR SCRIPT ARGS...``.
It wraps torch entry points so that calling them also leaves a note:
``dist.init_process_group`` (the rank and world size it gave), the
``DistributedDataParallel`` constructor and its forward, ``torch.save`` (which
file) and ``dist.barrier`` (when it returned). A forward pre-hook on every
``nn.Linear`` notes which samples the model trained on: the rows of
``NOTES_DIR/data.pt``'s ``x`` that reach a Linear layer of that width while
gradients are on. Then it runs SCRIPT as ``__main__`` with ARGS,
as ``python SCRIPT ARGS`` would, and writes the notes to
``NOTES_DIR/probe_rank{RANK}.json``. If the script raises, the exception and the
script's line go to ``NOTES_DIR/error_rank{RANK}.json`` and its traceback to stderr.
The process then ends with the script's exit status, skipping the interpreter's
teardown, where torch with gloo can abort a script that has finished.

Times are ``time.monotonic()``, one clock for every process of the machine. This
file imports only torch and the standard library: it runs outside dtlab.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import runpy
import sys
import time
import traceback
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


def _note_batches(data_path: Path) -> None:
    """Note the samples each training forward pass takes: the rows of data.pt's x that reach a Linear layer."""
    if not data_path.is_file():
        return
    x = torch.load(data_path, weights_only=True)["x"]
    index = {row.numpy().tobytes(): i for i, row in enumerate(x)}

    def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        batch = inputs[0] if inputs else None
        if (isinstance(module, torch.nn.Linear) and torch.is_grad_enabled() and isinstance(batch, torch.Tensor)
                and batch.dim() == 2 and batch.shape[1] == x.shape[1] and batch.dtype == x.dtype):
            rows = batch.detach().cpu()
            NOTES.append({"call": "batch", "indices": [index.get(row.numpy().tobytes(), -1) for row in rows]})

    torch.nn.modules.module.register_module_forward_pre_hook(hook)


def install(data_path: Path) -> None:
    """Wrap the entry points (in ``torch.distributed`` and in ``distributed_c10d``, where both are looked up)."""
    init = _noting(dist.init_process_group,
                   lambda *a, **k: {"call": "init", "rank": dist.get_rank(), "world": dist.get_world_size()})
    barrier = _noting(dist.barrier, lambda *a, **k: {"call": "barrier"})
    for module in (dist, c10d):
        module.init_process_group, module.barrier = init, barrier
    torch.save = _noting(torch.save, lambda obj, f, *a, **k: {"call": "save", "file": _file_name(f)})
    DistributedDataParallel.__init__ = _noting(DistributedDataParallel.__init__, lambda *a, **k: {"call": "ddp"})
    DistributedDataParallel.forward = _noting(DistributedDataParallel.forward, lambda *a, **k: {"call": "ddp_forward"})
    _note_batches(data_path)


def _error(exc: BaseException, script: str) -> dict[str, Any]:
    """The exception, its message's first line, and the innermost line of the script it came through."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == script:
            line = tb.tb_lineno
        tb = tb.tb_next
    message = (str(exc).strip().splitlines() or [""])[0]
    return {"type": type(exc).__name__, "message": message, "line": line, "time": time.monotonic()}


def _run(script: str, notes_dir: Path, rank: str) -> int:
    """Run SCRIPT as ``__main__``: the exit status it would give Python (an exception: 1, after its traceback)."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception as exc:
        (notes_dir / f"error_rank{rank}.json").write_text(json.dumps(_error(exc, script)))
        traceback.print_exc()
        return 1
    finally:
        (notes_dir / f"probe_rank{rank}.json").write_text(json.dumps(NOTES))
    return 0


def _die_with_agent() -> None:
    """SIGKILL when torchrun's agent ends (PR_SET_PDEATHSIG, as ``dtlab.launch.lifeline`` does for dtlab's own
    workers): a kernel killed mid-check takes its agent down, and the agent's ranks sit in sessions of their own."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.environ.get("DTLAB_LIFELINE_PID", str(os.getppid())) != str(os.getppid()):
        os._exit(1)  # the agent died before the line above: no signal would come


def main() -> None:
    _die_with_agent()
    notes_dir, script, args = Path(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]
    rank = os.environ.get("RANK", "0")
    install(notes_dir / "data.pt")
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    status = _run(script, notes_dir, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch + gloo can abort there even after destroy_process_group ("terminate
    # called without an active exception"), which would fail a script that has finished.
    os._exit(status)


if __name__ == "__main__":
    main()
