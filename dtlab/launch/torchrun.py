"""``launch_torchrun``: the same contract as ``launch``, with torchrun's agent in between.

Tiers that need torchrun's elastic agent (several nodes, restarts) run their
ranks under ``python -m torch.distributed.run ... -m dtlab.launch.worker WORKDIR``
as a subprocess in its own session. Errors come back as files, so the culprit
is named as by ``launch``; a deadline, a ``stop`` or an interrupt kills the
whole session: torchrun, its agent and every worker. It takes the same
``LaunchOptions`` and returns the same ``LaunchResult`` (``dtlab.launch.contract``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from dtlab.core import events
from dtlab.core.config import check_world_cap
from dtlab.core.failures import RankFailure
from dtlab.instrument.unseen import warn_unseen
from dtlab.launch import lifeline
from dtlab.launch import workdir as workdir_files
from dtlab.launch.contract import LaunchOptions, LaunchResult, LaunchStopped, Progress, ProgressBar, launch_error
from dtlab.launch.flight import Dumps

# torchrun's failure report: one block per failed rank, "Root Cause" (its first observed failure) last.
_BLOCK = re.compile(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)", re.S | re.M)


def free_port() -> int:
    """A port that was free a moment ago (torchrun must bind it itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Node:
    """One torchrun agent ("node"): where it runs and how its ranks reach the others.

    ``netns`` runs the agent inside that network namespace (see ``dtlab.launch.netns``);
    ``join_at_step`` starts it only once rank 0 has reported that many finished
    steps, so it joins a running job (an elastic membership change).
    """

    addr: str = "127.0.0.1"
    ifname: str = "lo"
    netns: str | None = None
    join_at_step: int = 0


def torchrun_command(workdir: Path | str, nproc_per_node: int, *, nnodes: str = "1", port: int,
                     rdzv_id: str, max_restarts: int = 0, rdzv_host: str = "127.0.0.1",
                     local_addr: str | None = "127.0.0.1", is_host: bool | None = None,
                     rdzv_conf: dict[str, Any] | None = None, extra: tuple[str, ...] = (),
                     python: str = sys.executable) -> list[str]:
    """The torchrun command line of one node (the same entry point dtlab documents for clusters).

    ``local_addr=None`` leaves ``--local-addr`` out: on a real cluster each node is known by its own
    host name, which torchrun looks up itself, so one command line serves every node.
    """
    conf = dict(rdzv_conf or {})
    if is_host is not None:
        # torchrun guesses whether it hosts the rendezvous store by comparing names;
        # inside a namespace (or on a cluster node with several names) say it.
        conf["is_host"] = int(is_host)
    conf_args = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())] if conf else []
    return [python, "-m", "torch.distributed.run", "--nnodes", nnodes,
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{rdzv_host}:{port}", "--rdzv-id", rdzv_id, *conf_args,
            *(["--local-addr", local_addr] if local_addr is not None else []),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            *extra, "-m", "dtlab.launch.worker", str(workdir)]


def kill_session(proc: subprocess.Popen) -> None:
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


# Once one agent has failed, the others cannot finish: their ranks lose a peer
# and their agents would wait for it at the next rendezvous. They get this long.
_FAILURE_GRACE_S = 3.0
# Once one agent has finished, the others of the same world finish within moments;
# one still running after this never got into the world (it joined too late).
_SUCCESS_GRACE_S = 10.0


def launch_torchrun(
    fn: Callable[..., Any],
    nproc_per_node: int,
    *,
    args: tuple = (),
    nodes: Sequence[Node] | None = None,
    nnodes: str | None = None,
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 60.0,
    deadline_s: float | None = None,
    max_restarts: int = 0,
    rdzv_conf: dict[str, Any] | None = None,
    progress: Progress = True,
    record: bool = True,
    env: dict[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    stop: threading.Event | None = None,
    flight_recorder: bool = False,
) -> LaunchResult:
    """Run ``fn(info, *args)`` on ``nproc_per_node`` ranks per node under torchrun; return every rank's result.

    One torchrun agent runs per entry of ``nodes`` (default: one loopback node);
    ``nnodes`` is torchrun's ``--nnodes`` (default: ``len(nodes)``; ``"1:2"`` lets
    the world grow). The result's ``events`` hold what the workers reported with
    ``dtlab.core.events.emit`` (starts, restarts, snapshots, faults), oldest first;
    its ``logs`` are keyed by node. ``workdir`` (default: a temporary directory,
    removed afterwards) is where the job, results and events are exchanged; with ``flight_recorder``, each
    rank's Flight Recorder dump too (``WORKDIR/flight_recorder``, returned as the result's ``flight``).
    """
    options = LaunchOptions(backend=backend, device=device, timeout_s=timeout_s, deadline_s=deadline_s,
                            progress=progress, record=record, env=env or {}, stop=stop,
                            flight_recorder=flight_recorder)
    if not isinstance(nproc_per_node, int) or isinstance(nproc_per_node, bool) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node!r} is invalid: must be an integer >= 1")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} is invalid: must be >= 0")
    nodes = list(nodes or [Node()])
    check_world_cap(nproc_per_node * len(nodes), "nproc_per_node x nodes")
    with _workdir(workdir) as work:
        dumps = Dumps(flight_recorder, work / "flight_recorder")
        options = dataclasses.replace(options, env={**options.env, **dumps.env()})
        _write_payload(work, fn, args, options)
        commands, rdzv_id = _node_commands(work, nodes, nproc_per_node, nnodes or str(len(nodes)), max_restarts,
                                           rdzv_conf)
        agents = _Agents(work, nodes, commands, rdzv_id, options, dumps)
        agents.world = nproc_per_node * len(nodes)
        agents.run()
        return agents.collect(nproc_per_node)


@contextlib.contextmanager
def _workdir(workdir: str | os.PathLike[str] | None) -> Iterator[Path]:
    """WORKDIR as given (kept afterwards), or a temporary one, removed however the launch ends (by the reaper if
    this process dies: ``dtlab.launch.lifeline``)."""
    if workdir is not None:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        yield work
        return
    with lifeline.folder("dtlab-torchrun-") as work:
        yield work


def _write_payload(work: Path, fn: Callable[..., Any], args: tuple, options: LaunchOptions) -> None:
    """What every worker loads (see ``dtlab.launch.worker``): the function, its arguments, the rank options."""
    try:
        payload = cloudpickle.dumps((fn, tuple(args), options.for_ranks()))
    except Exception as exc:
        raise ValueError(f"cannot send {fn!r} or its arguments to the ranks: {exc}") from exc
    (work / workdir_files.PAYLOAD).write_bytes(payload)


def _node_commands(work: Path, nodes: list[Node], nproc_per_node: int, nnodes: str, max_restarts: int,
                   rdzv_conf: dict[str, Any] | None) -> tuple[list[list[str]], str]:
    """Each node's command line (inside its namespace, if it has one), and the rendezvous id they share."""
    port, rdzv_id = free_port(), uuid.uuid4().hex[:12]
    commands = []
    for i, node in enumerate(nodes):
        # torchrun's own logs (and error files) in WORKDIR, not in a torchelastic_* folder of /tmp that stays.
        cmd = torchrun_command(work, nproc_per_node, nnodes=nnodes, port=port, rdzv_id=rdzv_id,
                               max_restarts=max_restarts, rdzv_host=nodes[0].addr, local_addr=node.addr,
                               is_host=(i == 0) if len(nodes) > 1 or node.netns else None, rdzv_conf=rdzv_conf,
                               extra=("--log-dir", str(work / f"torchelastic-node{i}")))
        # The agent dies with this process, whatever kills it (ip netns exec execs: the setting holds).
        commands.append(lifeline.dying_with_parent(["ip", "netns", "exec", node.netns, *cmd] if node.netns else cmd))
    return commands, rdzv_id


class _Agents:
    """The torchrun agents of one launch, one per node: started, watched, and killed with their whole session.

    ``run`` starts the nodes (a joining node once rank 0 reports its step), polls
    them until they have settled or the caller's deadline or ``stop`` ends the
    run, and tears down however that ended; ``collect`` returns the values or
    raises the error, culprit first.
    """

    def __init__(self, work: Path, nodes: list[Node], commands: list[list[str]], rdzv_id: str,
                 options: LaunchOptions, dumps: Dumps) -> None:
        self.work, self.nodes, self.commands, self.rdzv_id, self.options = work, nodes, commands, rdzv_id, options
        self.dumps, self.world = dumps, 0
        self.env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", **options.env}
        self.bar = ProgressBar(options.progress)
        self.relay = _Relay(work, self.bar)
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, str] = {}  # each agent's start time, as registered with the reaper
        self.late: set[int] = set()  # still waiting after the others finished: never got into the world
        self.note = ""  # why the launcher ended the run (a deadline), if it did
        self.stopped = False
        self.failed_at: float | None = None
        self.finished_at: float | None = None
        self.started = time.perf_counter()

    def _start(self, i: int) -> None:
        node = self.nodes[i]
        node_env = {**self.env, "GLOO_SOCKET_IFNAME": node.ifname, "DTLAB_NODE_ADDR": node.addr}
        with open(self.work / f"torchrun-node{i}.log", "wb") as log:
            self.procs[i] = subprocess.Popen(self.commands[i], stdout=log, stderr=subprocess.STDOUT, env=node_env,
                                             start_new_session=True)
        self.starts[i] = lifeline.watch_process(self.procs[i].pid)  # a second line: the reaper kills it and its workers
        events.emit_to(self.work, "node_start", node=i, addr=node.addr, agent_pid=self.procs[i].pid,
                       rdzv_id=self.rdzv_id)

    def run(self) -> None:
        try:
            for i, node in enumerate(self.nodes):
                if node.join_at_step <= 0:
                    self._start(i)
            self._watch()
        except KeyboardInterrupt:
            for p in self.procs.values():
                kill_session(p)
            raise
        finally:
            self._teardown()

    def _watch(self) -> None:
        while True:
            time.sleep(0.05)
            self.relay.poll()
            codes = {i: p.poll() for i, p in self.procs.items()}
            self._start_joiners(codes)
            if self._settled(codes) or self._ended_by_caller():
                return

    def _start_joiners(self, codes: dict[int, int | None]) -> None:
        """Nodes that join a running job: started once rank 0 has reported their step, while the job runs."""
        if self.finished_at is not None or None not in codes.values():
            return
        for i, node in enumerate(self.nodes):
            if i not in self.procs and 0 < node.join_at_step <= self.relay.max_step:
                self._start(i)

    def _settled(self, codes: dict[int, int | None]) -> bool:
        """Every agent has exited, or one failed (and the others had their grace), or the world finished."""
        if all(c is not None for c in codes.values()):
            return True
        now = time.perf_counter()
        if self.failed_at is None and any(c not in (None, 0) for c in codes.values()):
            self.failed_at = now
        if self.finished_at is None and 0 in codes.values():
            self.finished_at = now
        if self.failed_at is not None:
            return now - self.failed_at > _FAILURE_GRACE_S
        if self.finished_at is not None and now - self.finished_at > _SUCCESS_GRACE_S:
            self.late = {i for i, c in codes.items() if c is None}
            for i in self.late:
                events.emit_to(self.work, "node_stopped", node=i, reason="still waiting after the others finished")
            return True
        return False

    def _ended_by_caller(self) -> bool:
        deadline_s = self.options.deadline_s
        if deadline_s is not None and time.perf_counter() - self.started > deadline_s:
            self.note = f"the launch ran past deadline_s={deadline_s:g} s and was stopped"
            return True
        self.stopped = self.options.stop_requested()
        return self.stopped

    def _teardown(self) -> None:
        if self.failed_at is not None or self.note:  # ranks still running dump before they are killed
            self.dumps.request(range(self.world), wait_s=1.0)
        for i, p in self.procs.items():
            if p.poll() is None or self.note or self.stopped:
                kill_session(p)
            lifeline.forget_process(p.pid, self.starts[i])
        self.relay.poll()  # what arrived after the last poll
        self.bar.close()

    def collect(self, nproc_per_node: int) -> LaunchResult:
        if self.stopped:
            raise LaunchStopped("the launch was stopped on request; every agent and rank was killed")
        logs = {i: (self.work / f"torchrun-node{i}.log").read_text(errors="replace") for i in self.procs}
        warn_unseen(logs.values())  # once per path no rank's recorder could see
        run_events = events.read_events(self.work)
        results = result_paths(self.work)
        ok = not self.note and all(p.returncode == 0 for i, p in self.procs.items() if i not in self.late)
        flight = self.dumps.collect()
        if ok and results:
            return LaunchResult(load_results(results.values()), logs, time.perf_counter() - self.started, run_events,
                                flight)
        failures = _failures(self.work, nproc_per_node * len(self.procs), list(logs.values()), self.note)
        raise launch_error(failures, note=self.note, events=run_events, flight=flight)


def result_paths(workdir: Path) -> dict[int, Path]:
    """Each rank's result file in WORKDIR (``result-rank{R}.pkl``, see ``dtlab.launch.worker``), in rank order."""
    found = {int(p.stem.removeprefix("result-rank")): p for p in workdir.glob("result-rank*.pkl")}
    return dict(sorted(found.items()))


def load_results(paths: Iterable[Path]) -> list[Any]:
    """The values the ranks returned, from their result files (cloudpickle, as the worker wrote them)."""
    return [cloudpickle.loads(p.read_bytes()) for p in paths]


class _Relay:
    """Forwards rank 0's progress lines to the bar and remembers the furthest step reported."""

    def __init__(self, workdir: Path, bar: ProgressBar) -> None:
        self.path, self.bar, self.seen, self.max_step = workdir_files.progress_path(workdir), bar, 0, 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for line in lines[self.seen:]:
            with contextlib.suppress(json.JSONDecodeError):
                message = json.loads(line)
                self.bar.update(message)
                self.max_step = max(self.max_step, int(message.get("step", 0)))
        self.seen = len(lines)


def _failures(workdir: Path, world: int, logs: list[str], note: str) -> list[RankFailure]:
    errors = [json.loads(p.read_text()) for p in sorted(workdir.glob("error-rank*.json"))]
    # After restarts, an error file may be left from an earlier attempt: report the last attempt's.
    last = max((e.get("restart", 0) for e in errors), default=0)
    failures = [RankFailure(e["rank"], "exception", e["error_type"], e["message"], e["traceback"], e["time"])
                for e in errors if e.get("restart", 0) == last]
    reported = {f.rank for f in failures}
    order = 0
    for log_text in logs:
        others, _, root_cause = log_text.rpartition("Root Cause")
        # The root cause first (earliest time), so that a rank killed by a signal is the culprit, not its victims.
        for rank, code in _BLOCK.findall(root_cause) + _BLOCK.findall(others):
            if int(rank) not in reported and int(code) < 0:  # killed by a signal: no Python error to report
                failures.append(RankFailure(int(rank), "died", time=time.time() + order * 1e-3, exitcode=int(code)))
                reported.add(int(rank))
                order += 1
    if note and not failures:
        failures = [RankFailure(r, "timeout", message="still running at the deadline", time=time.time())
                    for r in range(world)]
    if not failures:
        tail = "\n".join("\n".join(log.splitlines()[-30:]) for log in logs)
        failures = [RankFailure(0, "died", message="torchrun failed", time=time.time(), log_tail=tail)]
    return failures
