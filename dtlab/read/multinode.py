"""Reading a multi-node run: where each rank ran, and how the torchrun agents started the ranks."""

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
