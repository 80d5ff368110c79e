"""Which replica group a process belongs to, under the ``ft`` launcher.

The launcher (``dtlab.launch.ft``) starts each replica group as a world of its
own and tells its ranks, in their environment, which group and which attempt
they are and where torchft's lighthouse listens; the tiers (``ft``, ``diloco``)
read it back with ``identity()``. Both sides take the names from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REPLICA_ENV, ATTEMPT_ENV = "DTLAB_FT_REPLICA", "DTLAB_FT_ATTEMPT"
REPLICAS_ENV, LIGHTHOUSE_ENV = "DTLAB_FT_REPLICAS", "DTLAB_FT_LIGHTHOUSE"
NODE_ADDR_ENV = "DTLAB_NODE_ADDR"  # a simulated host's address (set by the torchrun launcher)

# A replica group whose heartbeats stop for HEARTBEAT_TIMEOUT_MS is out of the lighthouse's next quorum: what a
# dead group costs the others. Each group's manager beats every HEARTBEAT_INTERVAL_MS from a Rust thread, which
# a busy Python does not delay, so six missed beats mean a dead process. (A live group left out by mistake only
# joins the next quorum, healing if it fell behind.)
HEARTBEAT_INTERVAL_MS = 50
HEARTBEAT_TIMEOUT_MS = 300


@dataclass(frozen=True)
class ReplicaIdentity:
    replica: int  # the replica group, 0..replicas-1
    attempt: int  # 0 at the first start, +1 at each restart of this group
    replicas: int
    lighthouse: str  # http://host:port
    host: str  # the address this group's servers bind (loopback, or its simulated host's)


def environment(replica: int, attempt: int, replicas: int, lighthouse: str) -> dict[str, str]:
    """The variables a replica group's ranks start with."""
    return {REPLICA_ENV: str(replica), ATTEMPT_ENV: str(attempt), REPLICAS_ENV: str(replicas),
            LIGHTHOUSE_ENV: lighthouse}


def identity() -> ReplicaIdentity:
    """This process's replica group; ValueError if it was not started by the ft launcher."""
    if REPLICA_ENV not in os.environ or LIGHTHOUSE_ENV not in os.environ:
        raise ValueError("this tier runs replica groups around torchft's lighthouse: start it with dtlab.run(cfg)")
    return ReplicaIdentity(int(os.environ[REPLICA_ENV]), int(os.environ.get(ATTEMPT_ENV, 0)),
                           int(os.environ.get(REPLICAS_ENV, 1)), os.environ[LIGHTHOUSE_ENV],
                           os.environ.get(NODE_ADDR_ENV, "127.0.0.1"))
