"""``launch_torchrun``: the same contract as ``launch``, with torchrun's agent in between.

Tiers that need torchrun's elastic agent (several nodes, restarts) run their
ranks under ``python -m torch.distributed.run ... -m dtlab.worker WORKDIR``
as a subprocess in its own session. Errors come back as files, so the culprit
is named as by ``launch``; a timeout, a deadline or an interrupt kills the
whole session: torchrun, its agent and every worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from dtlab import worker
from dtlab.failures import CollectiveTimeout, RankError, RankFailure
from dtlab.launcher import LaunchResult, ProgressBar

# torchrun's failure report: one block per failed rank, "Root Cause" (its first observed failure) last.
_BLOCK = re.compile(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)", re.S | re.M)


def free_port() -> int:
    """A port that was free a moment ago (torchrun must bind it itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(workdir: Path, nproc_per_node: int, *, nnodes: str = "1", port: int,
                     rdzv_id: str, max_restarts: int = 0, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--local-addr", "127.0.0.1",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", *extra,
            "-m", "dtlab.worker", str(workdir)]


def _kill_session(proc: subprocess.Popen) -> None:
    """torchrun, its agent and every worker: everything in the session, and any strays."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    psutil.wait_procs(family, timeout=5)


def launch_torchrun(
    fn: Callable[..., Any],
    nproc_per_node: int,
    *,
    args: tuple = (),
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 60.0,
    deadline_s: float | None = None,
    max_restarts: int = 0,
    progress: bool | Callable[[dict[str, Any]], None] = True,
    record: bool = True,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run ``fn(info, *args)`` on ``nproc_per_node`` ranks under torchrun and return their results."""
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node!r} is invalid: must be an integer >= 1")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} is invalid: must be >= 0")
    workdir = Path(tempfile.mkdtemp(prefix="dtlab-torchrun-"))
    options = {"backend": backend, "device": device, "timeout_s": timeout_s, "record": record}
    try:
        (workdir / worker.PAYLOAD).write_bytes(cloudpickle.dumps((fn, tuple(args), options)))
    except Exception as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        raise ValueError(f"cannot send {fn!r} or its arguments to the ranks: {exc}") from exc
    cmd = torchrun_command(workdir, nproc_per_node, port=free_port(), rdzv_id=uuid.uuid4().hex[:12],
                           max_restarts=max_restarts)
    child_env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = workdir / "torchrun.log"
    bar = ProgressBar(progress)
    started = time.perf_counter()
    seen_progress = 0
    note = ""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
    try:
        while proc.poll() is None:
            time.sleep(0.05)
            seen_progress = _relay_progress(workdir, seen_progress, bar)
            if deadline_s is not None and time.perf_counter() - started > deadline_s:
                note = f"the launch ran past deadline_s={deadline_s:g} s and was stopped"
                break
    except KeyboardInterrupt:
        _kill_session(proc)
        raise
    finally:
        if proc.poll() is None or note:
            _kill_session(proc)
        _relay_progress(workdir, seen_progress, bar)  # what arrived after the last poll
        bar.close()
    log_text = log_path.read_text(errors="replace")
    try:
        results = {r: worker.result_path(workdir, r) for r in range(nproc_per_node)}
        if not note and proc.returncode == 0 and all(p.exists() for p in results.values()):
            out = LaunchResult(cloudpickle.loads(p.read_bytes()) for p in results.values())
            out.logs = {0: log_text}
            out.wall_s = time.perf_counter() - started
            return out
        failures = _failures(workdir, nproc_per_node, log_text, note)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    timed_out = bool(note) or any("timed out" in f.message.lower() for f in failures)
    raise (CollectiveTimeout if timed_out else RankError)(failures, note=note)


def _relay_progress(workdir: Path, seen: int, bar: ProgressBar) -> int:
    path = worker.progress_path(workdir)
    if not path.exists():
        return seen
    lines = path.read_text().splitlines()
    for line in lines[seen:]:
        with contextlib.suppress(json.JSONDecodeError):
            bar.update(json.loads(line))
    return len(lines)


def _failures(workdir: Path, world: int, log_text: str, note: str) -> list[RankFailure]:
    failures = []
    for r in range(world):
        path = worker.error_path(workdir, r)
        if path.exists():
            e = json.loads(path.read_text())
            failures.append(RankFailure(r, "exception", e["error_type"], e["message"], e["traceback"], e["time"]))
    reported = {f.rank for f in failures}
    others, _, root_cause = log_text.rpartition("Root Cause")
    # The root cause first (earliest time), so that a rank killed by a signal is the culprit, not its victims.
    for order, (rank, code) in enumerate(_BLOCK.findall(root_cause) + _BLOCK.findall(others)):
        if int(rank) not in reported and int(code) < 0:  # killed by a signal: no Python error to report
            failures.append(RankFailure(int(rank), "died", time=time.time() + order * 1e-3, exitcode=int(code)))
            reported.add(int(rank))
    if note and not failures:
        failures = [RankFailure(r, "timeout", message="still running at the deadline", time=time.time())
                    for r in range(world)]
    if not failures:
        failures = [RankFailure(0, "died", message="torchrun failed", time=time.time(),
                                log_tail="\n".join(log_text.splitlines()[-30:]))]
    return failures

