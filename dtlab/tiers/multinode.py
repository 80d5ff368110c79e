"""Tier: multi-node DDP -- ddp on ``nnodes`` torchrun agents, one per "node".

The training is ddp's, unchanged: what differs is how the ranks are started.
Each node is one torchrun agent (``--nnodes N --nproc-per-node M``, c10d
rendezvous); together they give every rank its global RANK, its LOCAL_RANK
on its node and its node's GROUP_RANK.

``network="netns"`` (as root) gives each node its own network namespace and
address, joined by links capped at ``link_mbit`` (see ``dtlab.launch.netns``), so
gradients cross a real (simulated) network; ``"loopback"`` runs the agents
side by side on 127.0.0.1; ``"auto"`` takes namespaces where it can and says
in one line why not where it cannot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dtlab.core.config import RunConfig
from dtlab.core.registry import AgentPlan, TierSpec
from dtlab.tiers import ddp
from dtlab.tiers.parts import checkpoint

__all__ = ["NETWORKS", "Options", "SPEC", "Strategy", "agents", "validate"]

NETWORKS = ("auto", "netns", "loopback")


@dataclass(frozen=True)
class Options(ddp.Options):
    nnodes: int = 2
    network: str = "auto"
    link_mbit: float = 0.0  # cap of each node's link in Mbit/s (netns only); 0: uncapped
    link_delay_ms: float = 0.0  # one-way delay of every packet on each link (netns only); 0: none


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
    if not 0 <= o.link_delay_ms <= 1000:
        raise ValueError(f"{name}.link_delay_ms={o.link_delay_ms!r} is invalid: must be from 0 to 1000 ms")
    if o.link_delay_ms and o.network == "loopback":
        raise ValueError(f"{name}.link_delay_ms={o.link_delay_ms:g} needs network='netns' (or 'auto' as root)")
    if o.link_mbit and o.network == "loopback":
        raise ValueError(f"{name}.link_mbit={o.link_mbit:g} needs network='netns' (or 'auto' as root): "
                         f"loopback nodes share one uncapped interface")
    ddp.validate(cfg)


class Strategy(ddp.Strategy):
    def describe(self) -> dict[str, Any]:
        where = {"node": int(os.environ.get("GROUP_RANK", self.info.node_rank)), "local_rank": self.info.local_rank,
                 "global_rank": self.info.rank, "addr": os.environ.get("DTLAB_NODE_ADDR", "127.0.0.1"),
                 "ifname": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        return {**super().describe(), **where}


def agents(cfg: RunConfig) -> AgentPlan:
    o: Options = cfg.tier_options
    return AgentPlan(nproc_per_node=cfg.world_size // o.nnodes, nodes=o.nnodes, network=o.network,
                     link_mbit=o.link_mbit, link_delay_ms=o.link_delay_ms)


SPEC = TierSpec(name="multinode", summary="DDP on several torchrun agents (nodes), on loopback or simulated hosts",
                options=Options, validate=validate, strategy=Strategy, launcher="torchrun",
                preflight=checkpoint.preflight, agents=agents,
                choices={"comm_hook": ddp.COMM_HOOKS, "comm_dtype": ddp.COMM_DTYPES, "network": NETWORKS})
