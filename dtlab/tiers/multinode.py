"""Tier: multi-node DDP -- ddp on ``nnodes`` torchrun agents, one per "node".

The training is ddp's, unchanged: what differs is how the ranks are started.
Each node is one torchrun agent (``--nnodes N --nproc-per-node M``, c10d
rendezvous); together they give every rank its global RANK, its LOCAL_RANK
on its node and its node's GROUP_RANK.

``network="netns"`` (as root) gives each node its own network namespace and
address, joined by links capped at ``link_mbit`` (see ``dtlab.netns``), so
gradients cross a real (simulated) network; ``"loopback"`` runs the agents
side by side on 127.0.0.1; ``"auto"`` takes namespaces where it can and says
in one line why not where it cannot.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

from dtlab import netns
from dtlab.config import RunConfig
from dtlab.results import RunResult
from dtlab.tiers import ddp

__all__ = ["NETWORKS", "Options", "Strategy", "processes", "resolve_network", "run", "validate"]

NETWORKS = ("auto", "netns", "loopback")


@dataclass(frozen=True)
class Options(ddp.Options):
    nnodes: int = 2
    network: str = "auto"
    link_mbit: float = 0.0  # cap of each node's link in Mbit/s (netns only); 0: uncapped


def validate(cfg: RunConfig) -> None:
    o = cfg.tier_options
    name = f"{cfg.tier} tier_options"
    if not isinstance(o.nnodes, int) or o.nnodes < 1:
        raise ValueError(f"{name}.nnodes={o.nnodes!r} is invalid: must be an integer >= 1")
    if cfg.world_size % o.nnodes:
        raise ValueError(f"{name}.nnodes={o.nnodes} is invalid: world_size={cfg.world_size} must be a multiple "
                         f"of it (every node runs the same number of ranks)")
    if o.network not in NETWORKS:
        raise ValueError(f"{name}.network={o.network!r} is invalid: choose one of {', '.join(NETWORKS)}")
    if o.link_mbit < 0:
        raise ValueError(f"{name}.link_mbit={o.link_mbit!r} is invalid: must be >= 0 Mbit/s (0: uncapped)")
    if o.link_mbit and o.network == "loopback":
        raise ValueError(f"{name}.link_mbit={o.link_mbit:g} needs network='netns' (or 'auto' as root): "
                         f"loopback nodes share one uncapped interface")
    if o.network == "netns":
        ok, reason = netns.available()
        if not ok:
            raise ValueError(f"{name}.network='netns' cannot run here: {reason.split(':')[0]}")
    ddp.validate(cfg)


def resolve_network(options: Options) -> tuple[str, str]:
    """("netns" | "loopback", why loopback where namespaces were wanted but are not possible)."""
    if options.network != "auto":
        return options.network, ""
    ok, reason = netns.available()
    return ("netns", "") if ok else ("loopback", reason)


class Strategy(ddp.Strategy):
    def describe(self) -> dict[str, Any]:
        where = {"node": int(os.environ.get("GROUP_RANK", self.info.node_rank)), "local_rank": self.info.local_rank,
                 "global_rank": self.info.rank, "addr": os.environ.get("DTLAB_NODE_ADDR", "127.0.0.1"),
                 "ifname": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        return {**super().describe(), **where}


def processes(cfg: RunConfig) -> int:
    return cfg.world_size


def run(cfg: RunConfig, *, progress: Any = True, record: bool = True, stop: Any = None) -> RunResult:
    """Start ``nnodes`` torchrun agents (in namespaces or on loopback) and collect every rank's result."""
    from dtlab.torchrun import Node, launch_torchrun
    from dtlab.train import train

    o: Options = cfg.tier_options
    network, reason = resolve_network(o)
    if reason:
        print(reason)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if network == "netns":
            hosts = stack.enter_context(netns.SimulatedHosts(o.nnodes, o.link_mbit or None))
            nodes = [Node(h.addr, h.ifname, h.netns) for h in hosts]
        else:
            nodes = [Node() for _ in range(o.nnodes)]
        out = launch_torchrun(train, cfg.world_size // o.nnodes, args=(cfg,), nodes=nodes, backend=cfg.backend,
                              device=cfg.device, timeout_s=cfg.timeout_s, progress=progress, record=record,
                              stop=stop)
    result = RunResult(cfg, list(out), time.perf_counter() - start, out.logs, out.events)
    for rank in result.ranks:
        rank.strategy["network"] = network
        rank.strategy["link_mbit"] = o.link_mbit if network == "netns" else 0.0
    return result
