"""Reading a multi-node run: where each rank ran, how the torchrun agents started the ranks, and the link
sweep's rows (``benchmarks/link_sweep.py``: one per round, link and comm hook)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from dtlab.core.results import RunResult

PLACEMENT = ("global_rank", "node", "local_rank", "addr", "ifname")


def placement(result: RunResult, keys: Sequence[str] = PLACEMENT) -> pd.DataFrame:
    """One row per rank, in rank order: the ``keys`` of what each rank recorded about where it ran.

    The multinode tier records ``global_rank``, ``node`` (its ``GROUP_RANK``),
    ``local_rank``, ``addr`` and ``ifname`` (the node's address and interface)
    and ``network`` (loopback or netns).
    """
    return pd.DataFrame([{k: r.strategy[k] for k in keys} for r in result.ranks], columns=list(keys))


def launch(result: RunResult | Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How the ranks came to exist, from the agents' and workers' events.

    ``agent_pids``: one per torchrun agent (node), in the order they started;
    ``rdzv_ids``: the distinct rendezvous ids the agents used (one for a normal
    job); ``parents``: ``{rank: pid of the agent that started it}``, in rank
    order (a rank restarted by its agent appears once, with its last parent).
    """
    events = pd.DataFrame(list(result.run_events if isinstance(result, RunResult) else result))
    if events.empty:
        return {"agent_pids": [], "rdzv_ids": [], "parents": {}}
    agents = events[events["kind"] == "node_start"]
    workers = events[events["kind"] == "worker_start"].sort_values("rank", kind="stable")
    return {"agent_pids": [int(p) for p in agents["agent_pid"]],
            "rdzv_ids": list(dict.fromkeys(agents["rdzv_id"])) if "rdzv_id" in agents else [],
            "parents": {int(w.rank): int(w.agent_pid) for w in workers.itertuples()}}


def step_ratios(runs: pd.DataFrame, hook: str, mbit: float, delay: float) -> list[float]:
    """Link sweep, per round: ``hook``'s step time over the all-reduce's on the same link."""
    at = runs[(runs["link_mbit"] == mbit) & (runs["link_delay_ms"] == delay)].set_index(["round", "comm_hook"])
    return [at.loc[(r, hook), "step_ms"] / at.loc[(r, "allreduce"), "step_ms"] for r in sorted(set(runs["round"]))]


def slowdown(runs: pd.DataFrame, slow: float, fast: float = 10_000.0) -> list[float]:
    """Link sweep, per round: the all-reduce's step time on ``slow`` Mbit/s over ``fast`` (no delay)."""
    at = runs[(runs["comm_hook"] == "allreduce") & (runs["link_delay_ms"] == 0)].pivot(
        index="round", columns="link_mbit", values="step_ms")
    return list(at[slow] / at[fast])
