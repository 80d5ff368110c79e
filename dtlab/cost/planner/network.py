"""Collectives on the links they cross: NVLink inside a node, the NICs between nodes, NCCL's ring and tree.

A group is ``size`` ranks that sit ``stride`` apart in the rank order (``planner.layout``): a
tensor-parallel group has stride 1, a data-parallel group stride tp x cp, a pipeline's stride tp x cp
x dp. From the stride follows how many members share a node, and so which link a collective crosses:

* **inside one node** the NCCL ring on NVLink: ``2 (n - 1)`` steps of the NVLink latency and
  ``2 (n - 1) / n`` of the bytes at the NVLink bus bandwidth for an all-reduce, half of each for an
  all-gather or a reduce-scatter (the textbook ring, which NCCL's ring runs; nccl-tests'
  PERFORMANCE.md defines the bus bandwidth so that the same formula holds at every n);
* **across nodes** NCCL stripes a ring's channels over the NICs of the group's members on a node,
  so k members per node move k NICs' worth (``Cluster.inter_link``), every step at the network
  latency; an all-reduce may instead take NCCL's double binary tree, ``2 log2(nodes)`` network
  steps and ``2 (k - 1)`` NVLink steps of latency, twice the bytes over the same bandwidth, and NCCL
  takes whichever is faster (its tuning model, src/graph/tuning.cc, prices both);
* **an all-to-all** (expert parallelism) sends ``(n - 1) / n`` of its bytes pairwise in ``n - 1``
  steps: the share bound for the other members of the node goes over NVLink, the rest over the
  sender's own NIC, the two at once;
* **a point-to-point send** (a pipeline stage's activation) crosses one link, NVLink or a NIC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.cost.planner.clusters import Cluster

__all__ = ["OPS", "Group", "group", "seconds"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class Group:
    """``size`` ranks, ``per_node`` of them on each node they span."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)

    @property
    def where(self) -> str:
        return "none" if self.size == 1 else "intra" if self.nodes == 1 else "inter"


def group(cluster: Cluster, size: int, stride: int = 1) -> Group:
    """The members of a group of ``size`` ranks ``stride`` apart, and how many of them share a node."""
    per_node = max(1, cluster.gpus_per_node // stride) if stride < cluster.gpus_per_node else 1
    return Group(size, min(size, per_node))


def _ring(cluster: Cluster, op: str, nbytes: float, g: Group) -> float:
    n = g.size
    steps, share = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n)}.get(op, (n - 1, (n - 1) / n))
    if g.nodes == 1:
        return steps * cluster.intra_latency_s + share * nbytes / cluster.intra_bus_bandwidth
    link = cluster.inter_link(g.per_node)
    return steps * link.alpha_s + share * nbytes * link.beta_s_per_byte


def _tree_all_reduce(cluster: Cluster, nbytes: float, g: Group) -> float:
    link = cluster.inter_link(g.per_node)
    latency = 2 * math.ceil(math.log2(g.nodes)) * link.alpha_s + 2 * (g.per_node - 1) * cluster.intra_latency_s
    return latency + 2 * nbytes * link.beta_s_per_byte


def _all_to_all(cluster: Cluster, nbytes: float, g: Group) -> float:
    n, k = g.size, g.per_node
    nvlink = (k - 1) / n * nbytes / cluster.intra_bus_bandwidth
    nic = (n - k) / n * nbytes / cluster.inter_bus_bandwidth
    alpha = cluster.intra_latency_s if g.nodes == 1 else cluster.inter_latency_s
    return (n - 1) * alpha + max(nvlink, nic)


def seconds(cluster: Cluster, op: str, nbytes: float, g: Group) -> float:
    """One collective of ``nbytes`` (the whole buffer: an all-gather's output, a reduce-scatter's input, one
    rank's all-to-all send buffer, the message of a send) over group ``g``."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(OPS)}")
    if g.size == 1 or nbytes <= 0:
        return 0.0
    if op == "send_recv":
        if g.nodes == 1:
            return cluster.intra_latency_s + nbytes / cluster.intra_bus_bandwidth
        return cluster.inter_latency_s + nbytes / cluster.inter_bus_bandwidth
    if op == "all_to_all":
        return _all_to_all(cluster, nbytes, g)
    ring = _ring(cluster, op, nbytes, g)
    if op == "all_reduce" and g.nodes > 1:
        return min(ring, _tree_all_reduce(cluster, nbytes, g))
    return ring
