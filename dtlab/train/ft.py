"""Running a tier made of replica groups (``TierSpec.launcher == "ft"``): launch them, then read them as one run.

Each replica group is a world of its own, so its ranks number themselves from
0; the run renumbers them (replica x ranks_per_replica + rank), in the ranks'
results and in their recorded events, and checks whether every rank of every group finished
holding the same parameters (``replicas_max_param_diff`` in every rank's
``strategy``: 0.0 for torchft's per-step averaging after any fault; NaN when a
group did not finish, so that a check for 0.0 fails).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from dtlab.core.config import RunConfig
from dtlab.core.ft import timeouts as replica_timeouts
from dtlab.core.registry import ReplicaPlan
from dtlab.core.results import RankResult, RunResult, max_param_diff, params_from_bytes
from dtlab.launch import netns
from dtlab.launch.contract import Progress
from dtlab.launch.ft import launch_ft
from dtlab.launch.torchrun import Node
from dtlab.train.loop import train

__all__ = ["replica_agreement", "run_replicas"]


def run_replicas(cfg: RunConfig, plan: ReplicaPlan, network: tuple[str, str], *, progress: Progress = True,
                 record: bool = True, stop: threading.Event | None = None,
                 start_method: str = "forkserver") -> RunResult:
    """Start the replica groups (on loopback, or one simulated host each) and collect one RunResult.

    ``network`` is ``dtlab.train.runner.resolve_network``'s answer for the plan: where the groups run, and
    why loopback where namespaces were asked for but cannot be made here.
    """
    where, reason = network
    if reason:
        print(reason)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        nodes = None
        if where == "netns":
            hosts = stack.enter_context(netns.SimulatedHosts(plan.replicas, plan.link_mbit or None))
            nodes = [Node(h.addr, h.ifname, h.netns) for h in hosts]
        out = launch_ft(train, plan.replicas, plan.ranks_per_replica, args=(cfg,), nodes=nodes,
                        min_replicas=plan.min_replicas, max_restarts=plan.max_restarts,
                        lighthouse_port=plan.lighthouse_port, backend=cfg.backend, device=cfg.device,
                        timeout_s=cfg.timeout_s, start_method=start_method, progress=progress, record=record,
                        stop=stop, timeouts=replica_timeouts(plan.timeouts))
    ranks = [_globalised(r, plan.ranks_per_replica) for r in out.values]
    result = RunResult(cfg, sorted(ranks, key=lambda r: r.rank), time.perf_counter() - start, out.logs, out.events)
    agreement = replica_agreement(result, plan.replicas, plan.ranks_per_replica)
    for rank in result.ranks:
        rank.strategy.update(network=where, link_mbit=plan.link_mbit if where == "netns" else 0.0,
                             replicas_finished=sorted({r.strategy["replica"] for r in result.ranks}),
                             replicas_max_param_diff=agreement)
    return result


def _globalised(rank: RankResult, ranks_per_replica: int) -> RankResult:
    """A group's rank ``r`` as the run's rank ``replica x ranks_per_replica + r``, in its events too."""
    g = rank.strategy["replica"] * ranks_per_replica + rank.rank
    rank.rank = g
    for row in (*rank.events, *rank.phases):
        row["rank"] = g
    return rank


def replica_agreement(result: RunResult, replicas: int, ranks_per_replica: int = 1) -> float:
    """The largest parameter difference between the first rank of replica group 0 and every rank of every group.

    Every rank is compared, not one per group: a rank whose group-internal all-reduce went wrong would
    differ from its own group's first rank while the groups' first ranks agree. 0.0: identical. NaN when a
    group, or a rank of one (``ranks_per_replica`` each), returned no parameters: a group that did not
    finish cannot agree, and NaN equals nothing, so ``agreement == 0.0`` fails instead of passing by default.
    """
    held: dict[int, list[Any]] = {}
    for r in sorted(result.ranks, key=lambda r: r.rank):
        group = held.setdefault(int(r.strategy["replica"]), [])
        group.append(None if r.params is None else params_from_bytes(r.params))
    if sorted(held) != list(range(replicas)) or any(len(held[g]) != ranks_per_replica for g in held):
        return float("nan")
    every = [p for g in range(replicas) for p in held[g]]
    if any(p is None for p in every):
        return float("nan")
    return max((max_param_diff(every[0], p) for p in every[1:]), default=0.0)
