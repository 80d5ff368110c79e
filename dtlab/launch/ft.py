"""``launch_ft``: replica groups that fail and come back on their own, around torchft's lighthouse.

torchelastic restarts the whole world when one process fails; torchft keeps a
failure inside its replica group. Each group here is a world of its own (its own
store and process group), started by dtlab's local launcher on loopback, or by
torchrun inside a simulated host (``nodes``). The groups meet only through
torchft: its lighthouse (``dtlab.launch.lighthouse``, started first, stopped
last) forms a quorum of the live groups at every step, and each group's manager
averages across them. When a group fails, its processes end (the launcher of
that group sees to it); the other groups go on; this launcher starts the group
again, and its new processes rejoin at the next quorum, taking their state from
a live peer. A group is not restarted once every other group has ended: there
would be no peer to recover from.

Every group's ranks run ``fn(info, *args)`` with variables saying which
replica group and which attempt they are, and where the lighthouse is
(``dtlab.core.ft``). It takes the settings of every launcher (``LaunchOptions``) and
returns a ``LaunchResult`` (values in replica order, then rank order); a run
that fails, is stopped or interrupted leaves no lighthouse, manager or rank
process behind.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dtlab.core import events, ft
from dtlab.core.config import check_world_cap
from dtlab.core.failures import NoPeerToRecover, RankError
from dtlab.core.ft import TUNED_TIMEOUTS, Timeouts
from dtlab.launch import lifeline
from dtlab.launch import lighthouse as lighthouses
from dtlab.launch.contract import LaunchOptions, LaunchResult, LaunchStopped, Progress, ProgressBar
from dtlab.launch.local import launch
from dtlab.launch.torchrun import Node, launch_torchrun

__all__ = ["launch_ft"]


class _Run:
    """What the replica groups of one launch share: the settings, the lighthouse, the events folder, the bar."""

    def __init__(self, fn: Callable[..., Any], args: tuple, replicas: int, ranks_per_replica: int,
                 options: LaunchOptions, nodes: Sequence[Node] | None, max_restarts: int, start_method: str) -> None:
        self.fn, self.args, self.replicas, self.rpr = fn, args, replicas, ranks_per_replica
        self.options, self.nodes, self.max_restarts, self.start_method = options, nodes, max_restarts, start_method
        self.work = lifeline.temporary_folder("dtlab-ft-")  # the reaper's if this process dies
        self.stop = threading.Event()  # ends every group's launch: the caller's stop, an interrupt, an error
        self.lighthouse = ""
        self.started = time.perf_counter()
        self.bar, self.bar_lock, self.furthest = ProgressBar(options.progress), threading.Lock(), 0
        self.groups: list[_Group] = []

    def emit(self, kind: str, **fields: Any) -> None:
        events.emit_to(self.work, kind, **fields)

    def progress(self, replica: int) -> Callable[[dict[str, Any]], None]:
        """The bar follows the furthest step any group's rank 0 has reported."""
        def forward(info: dict[str, Any]) -> None:
            with self.bar_lock:
                if callable(self.options.progress):
                    self.bar.update({**info, "replica": replica})
                elif info.get("rank", 0) == 0 and int(info.get("step", 0)) >= self.furthest:
                    self.furthest = int(info.get("step", 0))
                    self.bar.update({**info, "desc": f"ft: replica group {replica} rank 0"})
        return forward

    def remaining_s(self) -> float | None:
        deadline_s = self.options.deadline_s
        return None if deadline_s is None else deadline_s - (time.perf_counter() - self.started)

    def others_running(self, replica: int) -> bool:
        return any(g.replica != replica and g.outcome is None for g in self.groups)


class _Group(threading.Thread):
    """One replica group: started, and started again after a failure while a peer still runs."""

    def __init__(self, run: _Run, replica: int) -> None:
        super().__init__(name=f"dtlab-ft-replica{replica}", daemon=True)
        self.shared, self.replica = run, replica
        self.outcome: str | None = None  # "finished", "failed", "late" (no peer left to recover from), "stopped"
        self.result: LaunchResult | None = None
        self.error: BaseException | None = None
        self.events: list[dict[str, Any]] = []  # those a torchrun-started group's workers reported

    def env(self, attempt: int) -> dict[str, str]:
        run = self.shared
        # torchft's managers log every quorum and commit at info level: the ranks' logs keep warnings and errors
        quiet = {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        return {**quiet, **run.options.env, **ft.environment(self.replica, attempt, run.replicas, run.lighthouse),
                events.WORKDIR_ENV: str(run.work)}

    def start_ranks(self, attempt: int) -> LaunchResult:
        run, o = self.shared, self.shared.options
        common = dict(args=run.args, backend=o.backend, device=o.device, timeout_s=o.timeout_s,
                      deadline_s=run.remaining_s(), progress=run.progress(self.replica), record=o.record,
                      env=self.env(attempt), stop=run.stop)
        if run.nodes:  # a simulated host: torchrun starts the group inside its namespace
            return launch_torchrun(run.fn, run.rpr, nodes=[run.nodes[self.replica]], **common)
        return launch(run.fn, run.rpr, start_method=run.start_method, **common)

    def pull(self, reported: list[dict[str, Any]], attempt: int) -> None:
        """Events a torchrun-started group's agent and workers reported: marked with this group and attempt."""
        self.events += [e if "replica" in e else {**e, "replica": self.replica, "replica_attempt": attempt}
                        for e in reported]

    def run(self) -> None:
        run, attempt = self.shared, 0
        while True:
            run.emit("replica_start", replica=self.replica, attempt=attempt)
            try:
                self.result = self.start_ranks(attempt)
                self.pull(self.result.events, attempt)
                self.outcome = "finished"
                run.emit("replica_finished", replica=self.replica, attempt=attempt)
                return
            except LaunchStopped:
                self.outcome = "stopped"
                return
            except RankError as exc:
                self.pull(getattr(exc, "events", []), attempt)
                if not self._again(exc, attempt):
                    return
                attempt += 1
            except BaseException as exc:  # the launcher itself failed: end the run
                self.error, self.outcome = exc, "failed"
                run.stop.set()
                return

    def _again(self, exc: RankError, attempt: int) -> bool:
        """Record the failure; True if the group starts again."""
        run, culprit = self.shared, exc.culprit
        run.emit("replica_failed", replica=self.replica, attempt=attempt, rank=culprit.rank,
                 error=culprit.headline()[:300])
        if culprit.error_type == NoPeerToRecover.__name__:
            self.outcome = "late"
            return False
        remaining = run.remaining_s()
        why = ("stopped" if run.stop.is_set() else "max_restarts reached" if attempt >= run.max_restarts
               else "no other replica group left to recover from" if not run.others_running(self.replica)
               else "the deadline has passed" if remaining is not None and remaining <= 0 else "")
        if why:
            self.error, self.outcome = exc, "failed"
            run.emit("replica_not_restarted", replica=self.replica, attempt=attempt, reason=why)
            return False
        return True


def launch_ft(fn: Callable[..., Any], replicas: int, ranks_per_replica: int, *, args: tuple = (),
              nodes: Sequence[Node] | None = None, min_replicas: int = 1, max_restarts: int = 3,
              lighthouse_port: int = 0, backend: str = "auto", device: str = "auto", timeout_s: float = 60.0,
              deadline_s: float | None = None, start_method: str = "forkserver", progress: Progress = True,
              record: bool = True, env: dict[str, str] | None = None,
              stop: threading.Event | None = None, timeouts: Timeouts = TUNED_TIMEOUTS) -> LaunchResult:
    """Run ``fn(info, *args)`` on ``replicas`` groups of ``ranks_per_replica`` ranks joined by a lighthouse.

    ``nodes`` (one per group) runs each group inside a simulated host; the lighthouse then runs in the
    first; ``timeouts`` are its heartbeat, join and tick settings. Values come back in replica order, then
    rank order, for the groups that finished; the
    result's ``events`` hold the groups' starts, failures and restarts and what their ranks reported.
    Raises the first group's RankError if none finished.
    """
    options = LaunchOptions(backend=backend, device=device, timeout_s=timeout_s, deadline_s=deadline_s,
                            progress=progress, record=record, env=env or {}, stop=stop)
    for name, value in (("replicas", replicas), ("ranks_per_replica", ranks_per_replica)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
    check_world_cap(replicas * ranks_per_replica, "replicas x ranks_per_replica")
    if nodes is not None and len(nodes) != replicas:
        raise ValueError(f"nodes: give one per replica group ({replicas}), not {len(nodes)}")
    run = _Run(fn, args, replicas, ranks_per_replica, options, nodes, max_restarts, start_method)
    try:
        host = nodes[0] if nodes else Node()
        with lighthouses.running(host.addr, lighthouse_port, min_replicas, host.netns, run.work,
                                 timeouts) as lighthouse:
            run.lighthouse = lighthouse.addr
            run.emit("lighthouse_start", addr=lighthouse.addr, min_replicas=min_replicas,
                     heartbeat_timeout_ms=timeouts.heartbeat_timeout_ms)
            _run_groups(run, stop)
            run.emit("lighthouse_stop")
        return _collect(run)
    finally:
        run.bar.close()
        lifeline.remove_folder(run.work)


def _run_groups(run: _Run, stop: threading.Event | None) -> None:
    """Start every group and wait for all of them; an interrupt or the caller's stop ends them all."""
    run.groups = [_Group(run, r) for r in range(run.replicas)]
    try:
        for group in run.groups:
            group.start()
        while any(g.is_alive() for g in run.groups):
            if stop is not None and stop.is_set():
                run.stop.set()
            for g in run.groups:
                g.join(0.05)
    finally:
        run.stop.set()  # however this ended: a group still starting ranks stops them
        for g in run.groups:
            g.join()


def _normalised(event: dict[str, Any], ranks_per_replica: int) -> dict[str, Any]:
    """A rank's event in the run's terms: the attempt is the replica group's, the rank the global one."""
    if "replica" in event and "replica_attempt" in event:
        event = {**event, "attempt": event.pop("replica_attempt"), "node": event["replica"]}
        event["rank"] = event["replica"] * ranks_per_replica + max(int(event.get("rank", 0)), 0)
    return event


def _collect(run: _Run) -> LaunchResult:
    own = events.read_events(run.work)
    pulled = [e for g in run.groups for e in g.events]
    timeline = sorted((_normalised(e, run.rpr) for e in own + pulled), key=lambda e: e["time"])
    broken = next((g.error for g in run.groups if g.error is not None and not isinstance(g.error, RankError)), None)
    if broken is not None:
        raise broken
    if any(g.outcome == "stopped" for g in run.groups):
        raise LaunchStopped("the launch was stopped; every replica group, rank and the lighthouse were ended")
    finished = [g for g in run.groups if g.outcome == "finished" and g.result is not None]
    if not finished:
        error = next((g.error for g in run.groups if g.error is not None), None)
        if isinstance(error, RankError):
            error.events = timeline  # type: ignore[attr-defined]
        raise error or RuntimeError("no replica group finished")
    values, logs = [], {}
    for g in finished:
        values += list(g.result.values)
        for key, text in g.result.logs.items():
            logs[g.replica * run.rpr + key if not run.nodes else g.replica] = text
    return LaunchResult(values, logs, time.perf_counter() - run.started, timeline)

